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


def test_the_final_evaluation_takes_every_core_with_an_hf_backend() -> None:
    """worldloop up gives each child its share of the cores (OMP_NUM_THREADS); the final evaluation
    runs alone, so an HF backend's torch takes them all, and a vLLM engine keeps its own threads."""
    import os

    import torch

    from worldloop.common.contracts.config import config_from_dict
    from worldloop.heldout import every_core

    cores = len(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert every_core(config_from_dict({"actor": {"backend": "vllm"}})) == 1
        for backend in ("hf", "server"):  # the evaluator of a server run generates with HF itself
            torch.set_num_threads(1)
            assert every_core(config_from_dict({"actor": {"backend": backend}})) == cores
    finally:
        torch.set_num_threads(threads)
