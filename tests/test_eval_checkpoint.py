"""``worldloop eval --model <learner checkpoint>``: real DeepSpeed checkpoints written by
``learner/checkpoint.py`` (tiny Qwen2.5-VL, CPU, ZeRO-0) resolve to the weights the learner trained:
the ``hf/`` export when there is one, else the DeepSpeed state consolidated into the base model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from worldloop.common.contracts.config import load_config
from worldloop.common.contracts.modeling import load_policy
from worldloop.eval.model import ModelNotFound, resolve_model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, shared_tiny_model) -> dict:
    """A run dir with a checkpoint that has the hf/ export and one without, after a weight change."""
    from worldloop.learner import checkpoint
    from worldloop.learner.engine import build_models, gather_policy_weights, init_distributed
    from worldloop.testing.learner import tiny_learner_config

    root = tmp_path_factory.mktemp("ckpt")
    model_dir = shared_tiny_model(max_image_side=112)
    cfg = tiny_learner_config(model_dir, "redis://127.0.0.1:1/0", root / "run", kl_coef=0.0, use_critic=False)
    models = build_models(cfg, init_distributed(cfg))
    with torch.no_grad():  # a visible "training" change: the learner's weights differ from the base
        name, param = next(iter(models.policy_hf.named_parameters()))
        param.add_(0.25)
    weights = gather_policy_weights(models)
    with_hf = checkpoint.save(models, root / "run" / "checkpoints", {"step": 7, "policy_version": 7, "max_turns": 3},
                              weights=weights, model_dir=model_dir)
    # a second run whose checkpoint has no hf/ export; its config.yaml names the base model (as `worldloop up` does)
    (root / "run2").mkdir()
    (root / "run2" / "config.yaml").write_text(yaml.safe_dump({"model": {"path": str(model_dir)}}))
    bare = checkpoint.save(models, root / "run2" / "checkpoints", {"step": 9, "policy_version": 9, "max_turns": 3},
                           weights=None, model_dir=model_dir)
    return {"root": root, "base": model_dir, "with_hf": with_hf, "bare": bare, "name": name,
            "trained": weights[name].clone()}


def test_checkpoint_with_hf_export(checkpoints, tmp_path: Path) -> None:
    cfg = load_config()
    for given in (checkpoints["with_hf"], checkpoints["with_hf"].parent, checkpoints["root"] / "run"):
        ref = resolve_model(str(given), base_url=None, cfg=cfg, scratch=tmp_path)
        assert ref.kind == "local" and ref.path == checkpoints["with_hf"].resolve() / "hf"
        assert ref.policy_version == 7 and ref.name.endswith("@v7")


def test_checkpoint_without_export_is_consolidated(checkpoints, tmp_path: Path) -> None:
    ref = resolve_model(str(checkpoints["root"] / "run2"), base_url=None, cfg=load_config(), scratch=tmp_path)
    assert ref.policy_version == 9 and ref.path.parent == tmp_path and "consolidated" in ref.source
    got = load_policy(ref.path).state_dict()
    base = load_policy(checkpoints["base"]).state_dict()
    name = checkpoints["name"]
    assert torch.equal(got[name], checkpoints["trained"])  # the learner's weights, not the base model's
    assert torch.allclose(got[name], base[name] + 0.25)
    assert all(torch.equal(got[k], base[k]) for k in base if k != name)
    assert (ref.path / "tokenizer.json").is_file()
    # the consolidated copy is reused by a rerun
    mtime = (ref.path / "model.safetensors").stat().st_mtime_ns
    again = resolve_model(str(checkpoints["bare"]), base_url=None, cfg=load_config(), scratch=tmp_path)
    assert again.path == ref.path and (ref.path / "model.safetensors").stat().st_mtime_ns == mtime


def test_checkpoint_problems_are_named(checkpoints, tmp_path: Path) -> None:
    empty = tmp_path / "empty-run" / "checkpoints"
    empty.mkdir(parents=True)
    (empty / "step_00000001").mkdir()  # incomplete: no state.json
    with pytest.raises(ModelNotFound, match="no complete learner checkpoint"):
        resolve_model(str(empty.parent), base_url=None, cfg=load_config(), scratch=tmp_path)
    with pytest.raises(ModelNotFound, match="neither a model directory"):
        resolve_model(str(tmp_path), base_url=None, cfg=load_config(), scratch=tmp_path)
    # no export and no way to find the base model: the error says what is needed
    import shutil

    lone = tmp_path / "lone" / "step_00000009"
    shutil.copytree(checkpoints["bare"], lone)
    with pytest.raises(ModelNotFound, match="model.path"):
        resolve_model(str(lone), base_url=None, cfg=load_config(None, ["model.path=/nonexistent"]), scratch=tmp_path)


def test_eval_runs_on_checkpoint_dirs(checkpoints, tmp_path: Path, capsys) -> None:
    """The whole command on a run directory (hf export) and on a checkpoint without one."""
    import json

    from worldloop.cli import main

    for given, version in ((checkpoints["root"] / "run", 7), (checkpoints["bare"], 9)):
        out = tmp_path / f"v{version}"
        assert main(["eval", "--model", str(given), "--envs", "frozenlake", "--episodes", "1", "--max-tokens", "8",
                     "--output", str(out), "model.max_image_side=112"]) == 0
        (rec,) = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
        assert rec["policy_version"] == version and rec["model"].endswith(f"@v{version}") and rec["error"] is None
        assert f"policy version {version}" in capsys.readouterr().out  # in the table's title


def test_a_stopping_evaluator_takes_the_final_version_from_the_checkpoint(checkpoints, tmp_path: Path) -> None:
    """The learner closes its weight channel after the last checkpoint: the evaluator's final version
    comes from that checkpoint, and only when it holds exactly that version."""
    from worldloop.actor.hf_backend import HFBackend
    from worldloop.heldout import checkpoint_weights

    cfg = load_config()
    run = checkpoints["root"] / "run"
    assert checkpoint_weights(cfg, run, 6) is None  # the newest checkpoint is v7
    assert checkpoint_weights(cfg, tmp_path / "no-run", 7) is None  # no checkpoints at all
    got = checkpoint_weights(cfg, run, 7)
    assert torch.equal(got[checkpoints["name"]], checkpoints["trained"])
    backend = HFBackend(checkpoints["base"])  # an evaluator's backend at v0 takes them whole
    backend.update_weights(got, 7)
    assert backend.version == 7
    assert torch.equal(backend.model.state_dict()[checkpoints["name"]], checkpoints["trained"])


def test_the_final_evaluation_takes_the_idle_cores_and_never_the_busy_ones() -> None:
    """worldloop up gives each child its share of the cores (OMP_NUM_THREADS); the final evaluation
    runs once the actors stopped, so an HF backend's torch takes the cores idle then (within 0.25
    of a whole one), never fewer than it has, and a vLLM engine keeps its own threads."""
    from worldloop.common.contracts.config import config_from_dict
    from worldloop.heldout import idle_core_threads

    threads = torch.get_num_threads()
    hf = config_from_dict({"actor": {"backend": "hf"}})
    try:
        for idle, want in ((1.9, 2), (1.74, 1), (1.76, 2), (0.2, 1), (None, 1), (3.0, 3)):
            torch.set_num_threads(1)
            assert idle_core_threads(hf, idle=lambda: idle) == want, idle
        torch.set_num_threads(1)  # the evaluator of a server run generates with HF itself
        assert idle_core_threads(config_from_dict({"actor": {"backend": "server"}}), idle=lambda: 2.0) == 2
        torch.set_num_threads(1)
        assert idle_core_threads(config_from_dict({"actor": {"backend": "vllm"}}), idle=lambda: 2.0) == 1
        torch.set_num_threads(2)
        assert idle_core_threads(hf, idle=lambda: 0.5) == 2  # what up gave it stays
    finally:
        torch.set_num_threads(threads)


def test_idle_cores_counts_a_busy_process_as_busy() -> None:
    """/proc/stat over a second: a process spinning on one core leaves at most cores - 0.5 idle
    (other work only lowers it), and the count is never outside [0, cores]."""
    import os
    import subprocess
    import sys

    from worldloop.eval.cpu import idle_cores

    cores = len(os.sched_getaffinity(0))
    quiet = idle_cores(0.5)
    assert quiet is not None and 0.0 <= quiet <= cores + 1e-9
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        busy = idle_cores(1.0)
    finally:
        spin.kill()
        spin.wait()
    assert 0.0 <= busy <= cores - 0.5, (busy, cores)


def test_the_final_evaluation_stops_between_chunks_at_its_deadline(shared_tiny_model) -> None:
    """play_final: the envs interleaved (every env's first seed, then the second, ...), in chunks; no
    deadline plays them all; a deadline already past plays the first chunk only and says so."""
    import time

    from worldloop.actor.hf_backend import HFBackend
    from worldloop.common.contracts.config import config_from_dict
    from worldloop.heldout import held_out_specs, play_final

    kw = {"size": 3, "is_slippery": False, "min_actions_to_succeed": 2, "render_mode": "vision", "image_size": 56}
    cfg = config_from_dict({"actor": {"envs": [{"id": "worldloop/FrozenLake-v0", "kwargs": kw},
                                               {"id": "worldloop/FrozenLake-v0", "name": "lake-b", "kwargs": kw}],
                                      "max_turns": 1, "max_new_tokens": 8, "num_envs": 2},
                            "model": {"max_image_side": 112}, "trainer": {"eval_episodes": 3}})
    backend = HFBackend(str(shared_tiny_model(seed=0, max_image_side=112)), max_image_side=112)
    specs = held_out_specs(cfg)
    start = cfg.eval.seed_start
    assert [(s.env_name, s.seed - start) for s in specs][:2] == [("frozenlake", 0), ("frozenlake", 1)]
    trajs, cut = play_final(backend, cfg, specs, by=0.0, chunk=2)
    assert cut is None
    assert [(t.env_name, t.seed - start) for t in trajs] == [
        ("frozenlake", 0), ("lake-b", 0), ("frozenlake", 1), ("lake-b", 1), ("frozenlake", 2), ("lake-b", 2)]
    trajs, cut = play_final(backend, cfg, specs, by=time.time() - 1.0, chunk=2)
    assert [(t.env_name, t.seed - start) for t in trajs] == [("frozenlake", 0), ("lake-b", 0)]
    assert cut is not None and (cut["planned"], cut["played"]) == (6, 2)
    trajs, cut = play_final(backend, cfg, specs, by=time.time() + 3600.0, chunk=4)  # far off: all of them
    assert cut is None and len(trajs) == 6


def test_the_final_evaluation_split_over_forked_processes_plays_what_one_process_plays(shared_tiny_model, tmp_path,
                                                                                   monkeypatch, caplog) -> None:
    """play_final_split: every second episode of the seed order in a fork of the evaluator, which holds its
    weights; each part's trajectories are exactly those of that part played here (the same batches, keyed
    sampling), merged in the seed order. A fork that fails has its part played here; a deadline already
    past cuts every process after its first chunk, and the record says how many were played."""
    import logging
    import time

    from worldloop.actor.hf_backend import HFBackend
    from worldloop.common.contracts.config import config_from_dict
    from worldloop.heldout import held_out_specs, play_final, play_final_split
    import worldloop.heldout as heldout

    kw = {"size": 3, "is_slippery": False, "min_actions_to_succeed": 2, "render_mode": "vision", "image_size": 56}
    cfg = config_from_dict({"actor": {"envs": [{"id": "worldloop/FrozenLake-v0", "kwargs": kw}],
                                      "max_turns": 2, "max_new_tokens": 8, "num_envs": 2},
                            "eval": {"sampling": "keyed"}, "model": {"max_image_side": 112},
                            "trainer": {"eval_episodes": 6}})
    backend = HFBackend(str(shared_tiny_model(seed=0, max_image_side=112)), max_image_side=112)
    specs = held_out_specs(cfg)
    key = lambda t: (t.seed, [list(turn.response_ids) for turn in t.turns], [list(turn.logprobs) for turn in t.turns])  # noqa: E731
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each process of the split plays
    try:
        want = [key(t) for t in sorted(play_final(backend, cfg, specs[0::2], 0.0)[0] + play_final(backend, cfg, specs[1::2], 0.0)[0],
                                       key=lambda t: t.seed)]
    finally:
        torch.set_num_threads(threads)
    caplog.set_level(logging.INFO, logger="worldloop.evaluator")
    trajs, cut = play_final_split(backend, cfg, specs, 0.0, 2, tmp_path)
    assert cut is None and [key(t) for t in trajs] == want
    assert "plays 6 episodes in 2 processes (this one and 1 forks)" in caplog.text
    assert list(tmp_path.iterdir()) == []  # the fork's file was read and removed
    assert play_final_split(backend, cfg, specs, 0.0, 1, tmp_path)[0] and "brought nothing back" not in caplog.text

    def broken(traj):
        raise RuntimeError("a fork that cannot write")

    monkeypatch.setattr(heldout, "encode_trajectory", broken)  # only the fork encodes: its part comes back here
    trajs, cut = play_final_split(backend, cfg, specs, 0.0, 2, tmp_path)
    assert cut is None and [key(t) for t in trajs] == want
    assert "brought nothing back: its 3 episodes are played here" in caplog.text
    monkeypatch.undo()
    trajs, cut = play_final_split(backend, cfg, specs, time.time() - 1.0, 2, tmp_path)
    assert cut is None and len(trajs) == 6  # each part is one chunk (FINAL_CHUNK 64), and a first chunk always runs
    chunked = heldout.play_final

    def small_chunks(backend, cfg, specs, by, chunk=heldout.FINAL_CHUNK):
        return chunked(backend, cfg, specs, by, chunk=2)

    monkeypatch.setattr(heldout, "play_final", small_chunks)
    trajs, cut = play_final_split(backend, cfg, specs, time.time() - 1.0, 2, tmp_path)
    assert [t.seed - cfg.eval.seed_start for t in trajs] == [0, 1, 2, 3] and (cut["planned"], cut["played"]) == (6, 4)


_SPLIT_SCRIPT = """
import logging, sys
logging.basicConfig(level=logging.INFO)
from worldloop.actor.hf_backend import HFBackend
from worldloop.common.contracts.config import config_from_dict
from worldloop.heldout import held_out_specs, play_final_split
kw = {"size": 3, "is_slippery": False, "min_actions_to_succeed": 2, "render_mode": "vision", "image_size": 56}
cfg = config_from_dict({"actor": {"envs": [{"id": "worldloop/FrozenLake-v0", "kwargs": kw}], "max_turns": 3,
                                  "max_new_tokens": 64, "num_envs": 2}, "model": {"max_image_side": 112},
                        "trainer": {"eval_episodes": 100000}})
backend = HFBackend(sys.argv[1], max_image_side=112)
play_final_split(backend, cfg, held_out_specs(cfg), 0.0, 2, __import__("pathlib").Path(sys.argv[2]))
"""


@pytest.mark.slow
def test_a_killed_evaluator_takes_its_final_evaluations_fork_with_it(shared_tiny_model, tmp_path) -> None:
    """The fork of play_final_split dies with the process that made it (PR_SET_PDEATHSIG): an evaluator
    that worldloop up SIGKILLs does not leave a copy playing on alone. The parent here plays 100,000
    episodes, so neither ends on its own within the test's bounds."""
    import signal

    import psutil

    from procs import Child, wait_for

    helper = Child.script(_SPLIT_SCRIPT, [str(shared_tiny_model(seed=0, max_image_side=112)), str(tmp_path / "scratch")],
                          tmp_path / "split.log")
    fork = None
    try:
        forks = wait_for(lambda: "in 2 processes" in helper.output(None) and psutil.Process(helper.pid).children(),
                         "the final evaluation to fork", 120, [helper])
        fork = forks[0]
        assert fork.is_running() and fork.status() != psutil.STATUS_ZOMBIE
        helper.proc.send_signal(signal.SIGKILL)
        helper.proc.wait(timeout=30)

        def gone() -> bool:
            try:
                return fork.status() == psutil.STATUS_ZOMBIE  # dead, waiting for whoever adopted it to reap it
            except psutil.NoSuchProcess:
                return True

        wait_for(gone, "the fork to die with its parent", 60)
    finally:
        for p in (fork, psutil.Process(helper.pid) if helper.proc.poll() is None else None):
            try:
                if p is not None:
                    p.kill()
            except psutil.NoSuchProcess:
                pass
        helper.proc.wait(timeout=30)
