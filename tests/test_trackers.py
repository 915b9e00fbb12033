"""Experiment trackers (learner/trackers.py), read back from what they leave on disk: TensorBoard's
event files (tensorboard's own EventAccumulator), wandb's offline run (the .wandb transaction log,
decoded record by record with wandb's own protobuf messages, and the artifact files of the samples
table) and samples.jsonl (rendered by ``worldloop show``). One test drives a real learner step on
the tiny model and compares every tracker's numbers with that step's metrics.jsonl line."""

from __future__ import annotations

import glob
import io
import json
import os
import logging
import struct
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from worldloop.common.contracts.config import ConfigError, config_from_dict
from worldloop.common.contracts.schemas import TRAJECTORY_SCHEMA, State, Trajectory, Turn
from worldloop.learner.trackers import (FINAL_EVAL_OVERHEAD_S, FINAL_EXIT_S, final_eval_deadline,
                                       final_eval_estimate_s, final_eval_processes, flatten, open_trackers, pick_samples, sample_record)

# --------------------------------------------------------------------------- readers


def wandb_records(path: Path):
    """The records of a .wandb file: a LevelDB-style log (7-byte file header ``:W&B`` + magic +
    version; 32 KiB blocks of chunks ``crc32(type + data) | length | type``), each record a
    ``wandb_internal_pb2.Record``. CRCs are checked."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0)
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:  # zero padding up to the block end
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc
        pos += 7 + length
        if kind == 2:  # FIRST
            pending = chunk
            continue
        if kind == 3:  # MIDDLE
            pending += chunk
            continue
        rec = pb.Record()
        rec.ParseFromString(pending + chunk if kind == 4 else chunk)
        pending = b""
        yield rec


class WandbRun:
    """What an offline wandb run holds: config, history rows (flat keys), artifacts."""

    def __init__(self, wandb_dir: Path):
        runs = sorted(glob.glob(str(wandb_dir / "wandb" / "offline-run-*" / "run-*.wandb")))
        assert len(runs) == 1, runs
        self.path = Path(runs[0])
        self.config: dict = {}
        self.history: list[dict] = []
        self.artifacts = []
        self.exit_code = None
        for rec in wandb_records(self.path):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                self.config.update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
            elif kind == "config":
                self.config.update({i.key: json.loads(i.value_json) for i in rec.config.update})
            elif kind == "history":
                self.history.append({i.key or ".".join(i.nested_key): json.loads(i.value_json)
                                     for i in rec.history.item})
            elif kind == "artifact":
                self.artifacts.append(rec.artifact)
            elif kind == "exit":
                self.exit_code = rec.exit.exit_code
        assert self.exit_code == 0  # the run was finished and written out completely

    def rows_with(self, key: str) -> list[dict]:
        return [r for r in self.history if key in r]

    def value(self, key: str, step_key: str, step: int):
        got = [r[key] for r in self.history if r.get(step_key) == step and key in r]
        assert len(got) == 1, (key, step, got)
        return got[0]

    def table(self, name: str) -> tuple[dict, dict[str, bytes]]:
        """The logged table ``name`` (its JSON) and the files of its artifact by path."""
        art = [a for a in self.artifacts if a.name.endswith(f"-{name}")]
        assert len(art) == 1
        files = {c.path: Path(c.local_path).read_bytes() for c in art[0].manifest.contents}
        return json.loads(files[f"{name}.table.json"]), files


def tb_accumulator(logdir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc


def tb_scalar(acc, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in acc.Scalars(tag)}


def tb_text(acc, tag: str) -> dict[int, str]:
    return {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors(f"{tag}/text_summary")}


def pixels(png: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(png)) as im:
        return np.asarray(im.convert("RGB"))


# --------------------------------------------------------------------------- inputs


def png(seed: int, side: int = 24) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def episode(i: int, env_rewards: list[float], env_name: str = "sokoban") -> Trajectory:
    turns = []
    for t, r in enumerate(env_rewards):
        turns.append(Turn(
            index=t, policy_version=3, obs_ids=[1, 2, 3], response_ids=[5, 6], logprobs=[-0.5, -0.25],
            images=[png(100 * i + t)],
            response_text=f"<think><observation>ep{i} sees | box at {t}</observation></think><answer>Up</answer>",
            observation=f"ep{i} sees | box at {t}", prediction=f"ep{i} predicts box at {t + 1}",
            actions=["Up"], format_ok=True, env_reward=r, format_reward=0.5, done=t == len(env_rewards) - 1,
            success=False, state_before=State(relations=[f"box at {t}"], symbolic=None, structured={}),
            state_after=State(relations=[f"box at {t + 1}"], symbolic=None, structured={}),
            actions_total=1, actions_effective=1, reasoning_reward=0.25, grounding_score=0.5))
    return Trajectory(schema=TRAJECTORY_SCHEMA, trajectory_id=f"traj-{i}", group_id="g", env_id="worldloop/Sokoban-v0",
                      env_name=env_name, env_kwargs={}, seed=1000 + i, actor_id="a", created_at=0.0,
                      prompt_format="grounding_worldmodeling", max_turns=3, turns=turns, success=False, scored=True)


def step_record(step: int) -> dict:
    """The shape learner/process.py's _after_update builds (values chosen per step)."""
    return {
        "step": step, "policy_version": step, "time": 1.7e9, "trajectories": 4,
        "losses": {"policy": 0.125 * step, "value": 2.5 + step, "entropy": 1.75, "kl": None},
        "kl": 0.001 * step, "entropy": 1.75, "clip_fraction": 0.0625, "approx_kl": 1e-4,
        "value_clip_fraction": 0.0, "explained_variance": -0.5,
        "advantage": {"mean": 0.0, "std": 1.0, "max": 2.0, "min": -1.5},
        "return_mean": 0.75,
        "importance_weight": {"mean": 1.0, "max": 1.5, "min": 0.5, "truncated_fraction": 0.0},
        "ratio": {"mean": 1.0, "max": 1.25, "min": 0.75},
        "grad_norm": {"policy": 3.5, "critic": 7.0},
        "reward": {"total": 1.5 * step, "env": 1.0, "format": 0.5, "reasoning": 0.25},
        "success_rate": {"all": 0.25 * step, "sokoban": 0.5},
        "staleness_mean": 0.5, "staleness_max": 1, "dropped": 0, "pending_entries": 8,
        "tokens": 1000, "response_tokens": 100, "tokens_per_s": 250.0 * step,
        "step_seconds": {"wait": 0.5, "forward": 1.5, "backward": 2.5, "publish": 0.25, "checkpoint": 0.0},
        "max_turns": 3,
    }


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """wandb with no network and every file under tmp_path."""
    d = tmp_path / "wandb-home"
    d.mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(d))
    for var, sub in (("WANDB_DATA_DIR", "data"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_CONFIG_DIR", "config"),
                     ("WANDB_ARTIFACT_DIR", "artifacts")):
        monkeypatch.setenv(var, str(d / sub))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "worldloop-test")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return d


def make_cfg(run_dir: Path, loggers: list[str], sample_every: int = 2, resume: bool = False):
    return config_from_dict({"run": {"name": "tracked", "run_dir": str(run_dir), "loggers": loggers},
                             "trainer": {"sample_every": sample_every, "total_steps": 4, "resume": resume}})


# --------------------------------------------------------------------------- pure parts


def test_the_final_evaluation_estimate_scales_the_in_run_cpu_seconds():
    # 12 CPU s for 64 episodes per env -> 512 per env take 12 * 512 / 64 = 96 s, plus the overhead
    assert FINAL_EVAL_OVERHEAD_S == 15.0
    assert final_eval_estimate_s({"cpu_s": 12.0, "seconds": 40.0}, 64, 512) == 96.0 + 15.0
    assert final_eval_estimate_s({"cpu_s": 12.0}, 64, 64) == 27.0
    for unusable in (None, {}, {"cpu_s": None}, {"cpu_s": 0.0}):
        assert final_eval_estimate_s(unusable, 64, 512) is None
    assert final_eval_estimate_s({"cpu_s": 12.0}, 0, 512) is None
    # two processes share the 96 CPU s: 48 s each, and the overhead once
    assert final_eval_estimate_s({"cpu_s": 12.0}, 64, 512, processes=2) == 48.0 + 15.0


def test_the_final_evaluation_takes_one_process_per_core_on_an_hf_cpu_backend_only(tmp_path):
    cfg = make_cfg(tmp_path, ["jsonl"])
    assert cfg.trainer.final_eval_processes == 0  # the default: one per core
    assert final_eval_processes(cfg, cores=4) == 4 and final_eval_processes(cfg, cores=1) == 1
    assert final_eval_processes(cfg) == len(os.sched_getaffinity(0))
    assert final_eval_processes(cfg, cores=4, cuda=True) == 1  # a fork would share the device
    cfg.trainer.final_eval_processes = 3
    assert final_eval_processes(cfg, cores=2) == 3  # asked for: as many, whatever the cores
    cfg.actor.backend = "vllm"
    assert final_eval_processes(cfg, cores=4) == 1  # a vLLM engine keeps one
    cfg.actor.backend = "server"  # the evaluator of a server run generates with HF itself
    assert final_eval_processes(cfg, cores=4) == 3


def test_the_final_evaluation_deadline_is_the_learners_share_of_the_budget_plus_the_reserve(tmp_path):
    cfg = make_cfg(tmp_path, ["jsonl"])
    assert final_eval_deadline(cfg, 1000.0) is None  # no up.time_limit_s
    cfg.up.time_limit_s, cfg.up.final_reserve_s = 600.0, 60.0
    assert final_eval_deadline(cfg, 1000.0) is None  # no trainer.time_limit_s: nothing to go by
    cfg.trainer.time_limit_s = 500.0
    assert FINAL_EXIT_S == 10.0 and final_eval_deadline(cfg, 1000.0) == 1000.0 + 500.0 + 60.0 - 10.0


def test_the_learner_keeps_back_what_the_newest_in_run_evaluation_says_beyond_the_reserve(tmp_path):
    cfg = make_cfg(tmp_path, ["jsonl"])
    cfg.trainer.eval_every, cfg.trainer.eval_episodes, cfg.trainer.final_eval_episodes = 5, 64, 512
    cfg.up.final_reserve_s = 60.0
    cfg.up.final_eval_max_share = 1.0  # no cap here (the next test has it)
    cfg.trainer.final_eval_processes = 1  # the evaluator alone (two: the last lines)
    trackers = open_trackers(tmp_path, cfg)
    try:
        def write(**rec):
            with open(tmp_path / "eval.jsonl", "a") as f:
                f.write(json.dumps({"eval": {"policy_version": rec.pop("v"), "episodes": {"all": 64}, **rec}}) + "\n")

        assert trackers.final_eval_extra_s(cfg) == 0.0  # no up.time_limit_s: up kept nothing back
        cfg.up.time_limit_s = 600.0
        assert trackers.final_eval_extra_s(cfg) == 0.0  # no evaluation yet: the reserve alone
        write(v=0, cpu_s=12.0, final=False)
        trackers.poll_evals()
        assert trackers.final_eval_extra_s(cfg) == 111.0 - 60.0
        write(v=5, cpu_s=4.0, final=False)  # the newest decides: 4 * 8 + 15 = 47 s fits the reserve
        write(v=5, cpu_s=90.0, final=True)  # a final record is not an in-run measurement
        trackers.poll_evals()
        assert trackers.final_eval_extra_s(cfg) == 0.0
        cfg.trainer.eval_every = 0  # no evaluator
        write(v=10, cpu_s=40.0, final=False)
        trackers.poll_evals()
        assert trackers.final_eval_extra_s(cfg) == 0.0
        cfg.trainer.eval_every = 5
        assert trackers.final_eval_extra_s(cfg) == 40.0 * 8 + 15.0 - 60.0
        cfg.trainer.final_eval_processes = 2  # two processes share the 320 CPU s
        assert trackers.final_eval_extra_s(cfg) == 40.0 * 8 / 2 + 15.0 - 60.0
    finally:
        trackers.close()


def test_the_final_evaluation_keeps_back_at_most_its_share_of_the_budget(tmp_path, caplog):
    # the run of 2026-11-29 on a 2-core VM under the test suite: 98.7 CPU s for 64 in-run episodes ->
    # 98.7 * 8 + 15 = 804.6 s for 512, which stopped the learner after 1 of 60 updates
    cfg = make_cfg(tmp_path, ["jsonl"])
    cfg.trainer.eval_every, cfg.trainer.eval_episodes, cfg.trainer.final_eval_episodes = 5, 64, 512
    cfg.up.time_limit_s, cfg.up.final_reserve_s = 570.0, 60.0
    cfg.trainer.final_eval_processes = 1
    assert cfg.up.final_eval_max_share == 0.25  # the default
    (tmp_path / "eval.jsonl").write_text(json.dumps({"eval": {"policy_version": 0, "episodes": {"all": 64},
                                                              "cpu_s": 98.7, "final": False}}) + "\n")
    trackers = open_trackers(tmp_path, cfg)
    try:
        trackers.poll_evals()
        with caplog.at_level(logging.INFO, logger="worldloop.learner.trackers"):
            assert trackers.final_eval_extra_s(cfg) == pytest.approx(0.25 * 570.0 - 60.0)  # 82.5 s, not 744.6
        assert "up.final_eval_max_share=0.25 caps it" in caplog.text
        cfg.up.final_eval_max_share = 0.5
        assert trackers.final_eval_extra_s(cfg) == pytest.approx(0.5 * 570.0 - 60.0)
        cfg.up.final_eval_max_share = 0.1  # less than the reserve itself: nothing more is kept back
        assert trackers.final_eval_extra_s(cfg) == 0.0
        cfg.up.time_limit_s = 2000.0  # a budget whose share holds the estimate: kept back as estimated
        cfg.up.final_eval_max_share = 0.5
        assert trackers.final_eval_extra_s(cfg) == pytest.approx(98.7 * 8 + 15.0 - 60.0)
    finally:
        trackers.close()



def test_flatten_keeps_every_number_on_slash_keys():
    flat = flatten(step_record(2))
    assert flat["losses/policy"] == 0.25 and flat["losses/value"] == 4.5
    assert "losses/kl" not in flat  # None
    assert "time" not in flat  # wall clock, not a metric
    assert flat["success_rate/sokoban"] == 0.5 and flat["step_seconds/backward"] == 2.5
    assert flat["importance_weight/truncated_fraction"] == 0.0 and flat["tokens_per_s"] == 500.0
    assert flatten({"a": True, "b": "text", "c": float("nan"), "d": {"e": {"f": 3}}}) == {"a": 1.0, "d/e/f": 3.0}


def test_pick_samples_spans_the_rewards():
    trajs = [episode(i, [float(r)]) for i, r in enumerate([5, 0, 9, 2, 7, 1, 3])]
    got = [t.trajectory_id for t in pick_samples(trajs, 4)]
    # sorted rewards 0,1,2,3,5,7,9 -> positions 0, 2, 4, 6
    assert got == ["traj-1", "traj-3", "traj-0", "traj-2"]
    assert [t.trajectory_id for t in pick_samples(trajs[:2], 4)] == ["traj-1", "traj-0"]
    assert pick_samples(trajs, 0) == []


def test_sample_record_is_the_trajectory_without_tokens():
    t = episode(0, [1.0, -0.5])
    rec = sample_record(t, 6)
    assert rec["step"] == 6 and rec["trajectory_id"] == "traj-0"
    assert rec["total_reward"] == pytest.approx((1.0 + 0.5 + 0.25) + (-0.5 + 0.5 + 0.25))
    assert rec["turns"][1]["reward"] == pytest.approx(0.25)
    assert "obs_ids" not in rec["turns"][0] and "logprobs" not in rec["turns"][0]
    import base64
    assert base64.b64decode(rec["turns"][0]["images"][0]) == t.turns[0].images[0]


# --------------------------------------------------------------------------- config


def test_config_validates_logger_names_and_sample_every():
    with pytest.raises(ConfigError, match="run.loggers.*jsonl, tensorboard, wandb"):
        config_from_dict({"run": {"loggers": ["jsonl", "mlflow"]}})
    with pytest.raises(ConfigError, match="run.loggers.*expected a list"):
        config_from_dict({"run": {"loggers": "wandb"}})
    with pytest.raises(ConfigError, match="trainer.sample_every"):
        config_from_dict({"trainer": {"sample_every": -1}})
    assert config_from_dict({}).run.loggers == ["jsonl"]


@pytest.mark.parametrize("name", ["wandb", "tensorboard"])
def test_a_missing_package_fails_at_start_naming_run_loggers(tmp_path, monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)  # import and find_spec both see it as absent
    with pytest.raises(ConfigError, match=rf"run.loggers.*'{name}'.*worldloop\[{name}\]"):
        open_trackers(tmp_path, make_cfg(tmp_path, ["jsonl", name]))
    assert not (tmp_path / "tensorboard").exists()


def test_wandb_that_cannot_start_fails_at_start_naming_run_loggers(tmp_path, offline_wandb, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "bogus")  # rejected by wandb before anything else happens
    with pytest.raises(ConfigError, match=r"run.loggers.*'wandb' could not start a run.*WANDB_MODE=offline"):
        open_trackers(tmp_path, make_cfg(tmp_path, ["jsonl", "tensorboard", "wandb"]))
    assert not list(offline_wandb.glob("wandb/*run-*"))


# --------------------------------------------------------------------------- all three, read back


def _drive(run_dir: Path, loggers: list[str]):
    cfg = make_cfg(run_dir, loggers, sample_every=2)
    batch = [episode(i, [float(i), 0.5 * i]) for i in range(6)]
    trackers = open_trackers(run_dir, cfg)
    with open(run_dir / "eval.jsonl", "a") as f:  # what worldloop/heldout.py appends
        f.write(json.dumps({"eval": {"policy_version": 0, "step": 0, "success_rate": {"all": 0.125, "sokoban": 0.125},
                                     "episodes": {"all": 8}, "reward_mean": -0.5, "ci95": {"all": [0.0, 0.5]}}}) + "\n")
    for step in (1, 2, 3):
        trackers.log_step(step, step_record(step), batch)
        if step == 2:
            with open(run_dir / "eval.jsonl", "a") as f:
                f.write(json.dumps({"eval": {"policy_version": 2, "step": 2, "success_rate": {"all": 0.375},
                                             "episodes": {"all": 8}, "reward_mean": 0.25}}) + "\n")
    with open(run_dir / "eval.jsonl", "a") as f:  # the final evaluation, seen at close
        f.write(json.dumps({"eval": {"policy_version": 3, "step": 3, "success_rate": {"all": 0.5}}}) + "\n")
    trackers.close()
    return cfg, batch


def test_tensorboard_event_files_hold_metrics_config_and_samples(tmp_path):
    cfg, batch = _drive(tmp_path, ["tensorboard"])
    acc = tb_accumulator(tmp_path / "tensorboard")
    # samples.jsonl is written whatever run.loggers lists
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == 4
    for step in (1, 2, 3):
        rec = flatten(step_record(step))
        for tag in ("losses/policy", "losses/value", "kl", "entropy", "clip_fraction", "advantage/min",
                    "importance_weight/max", "reward/total", "reward/reasoning", "success_rate/all",
                    "success_rate/sokoban", "staleness_mean", "step_seconds/forward", "tokens_per_s"):
            assert tb_scalar(acc, tag)[step] == pytest.approx(rec[tag], rel=1e-6), tag
    assert tb_scalar(acc, "losses/policy") == {1: 0.125, 2: 0.25, 3: 0.375}
    assert not {"losses/kl", "time", "step", "eval/step"} & set(acc.Tags()["scalars"])
    # held-out evaluations on the policy-version axis, including the one written after the last step
    assert tb_scalar(acc, "eval/success_rate/all") == {0: 0.125, 2: 0.375, 3: 0.5}
    assert tb_scalar(acc, "eval/reward_mean") == {0: -0.5, 2: 0.25}
    config_text = tb_text(acc, "config")[0]
    assert '"name": "tracked"' in config_text and '"sample_every": 2' in config_text
    # sample_every=2: only step 2 has samples; 4 of 6 episodes (rewards 0, 2.25, 4.5, 6.75 ...)
    texts = tb_text(acc, "samples/0")
    assert list(texts) == [2]
    picked = pick_samples(batch)
    assert [t.trajectory_id for t in picked] == ["traj-0", "traj-2", "traj-3", "traj-5"]
    for e, traj in enumerate(picked):
        text = tb_text(acc, f"samples/{e}")[2]
        assert traj.trajectory_id in text and "ep%s sees \\| box at 1" % traj.trajectory_id[-1] in text
        assert f"ep{traj.trajectory_id[-1]} predicts box at 2" in text
        for t, turn in enumerate(traj.turns):
            (img,) = acc.Images(f"samples/{e}/turn{t}")
            assert img.step == 2
            assert np.array_equal(pixels(img.encoded_image_string), pixels(turn.images[0]))
    # the markdown table row of turn 1 of the last episode: rewards env 2.5, format 0.5, judge 0.25
    assert "| 2.5 | 0.5 | 0.25 | 3.25 |" in tb_text(acc, "samples/3")[2]


def test_wandb_offline_run_holds_metrics_config_and_samples_table(tmp_path, offline_wandb):
    run_dir = tmp_path / "run"
    cfg, batch = _drive(run_dir, ["jsonl", "tensorboard", "wandb"])
    run = WandbRun(offline_wandb)
    assert (run_dir / "wandb_run_id").read_text().strip() in run.path.name
    assert run.config["run"]["name"] == "tracked" and run.config["trainer"]["sample_every"] == 2
    assert run.config["run"]["loggers"] == ["jsonl", "tensorboard", "wandb"]
    for step in (1, 2, 3):
        rec = flatten(step_record(step))
        for key in ("losses/policy", "kl", "clip_fraction", "importance_weight/mean", "reward/env",
                    "success_rate/all", "step_seconds/wait", "tokens_per_s", "staleness_max"):
            assert run.value(key, "step", step) == pytest.approx(rec[key]), key
    assert [r["losses/policy"] for r in run.rows_with("losses/policy")] == [0.125, 0.25, 0.375]
    assert not run.rows_with("losses/kl")
    assert run.value("eval/success_rate/all", "eval/step", 0) == 0.125
    assert run.value("eval/success_rate/all", "eval/step", 2) == 0.375
    assert run.value("eval/success_rate/all", "eval/step", 3) == 0.5
    # the samples table: logged once (step 2), one row per turn, images in the table's artifact
    (row,) = run.rows_with("samples._type")
    assert row["step"] == 2 and row["samples._type"] == "table-file" and row["samples.nrows"] == 8
    table, files = run.table("samples")
    cols = table["columns"]
    picked = pick_samples(batch)
    assert len(table["data"]) == 8
    for data, (traj, turn) in zip(table["data"], [(t, u) for t in picked for u in t.turns]):
        r = dict(zip(cols, data))
        assert (r["step"], r["trajectory_id"], r["turn"]) == (2, traj.trajectory_id, turn.index)
        assert r["response"] == turn.response_text and r["prediction"] == turn.prediction
        assert r["state_after"] == turn.state_after.relations[0]
        assert r["env_reward"] == turn.env_reward and r["total_reward"] == pytest.approx(turn.env_reward + 0.75)
        assert r["image"]["_type"] == "image-file"
        assert np.array_equal(pixels(files[r["image"]["path"]]), pixels(turn.images[0]))
    # nothing was sent anywhere: the run is an offline one, with its files under WANDB_DIR
    assert run.path.parent.name.startswith("offline-run-")
    # TensorBoard ran beside it
    assert tb_scalar(tb_accumulator(run_dir / "tensorboard"), "kl") == pytest.approx({1: 0.001, 2: 0.002, 3: 0.003})


def test_no_tracker_holds_a_query_string_password(tmp_path, offline_wandb):
    """Issue 38, finding 7: ``redis.url=...?password=PW`` (a form redis-py reads) and a judge URL
    with ``?api_key=`` reach neither TensorBoard's config text nor wandb's run config, nor any
    byte of any file either writes; the rest of the URL is there."""
    pw = "qs-PW-5d2e8a"
    run_dir = tmp_path / "run"
    cfg = config_from_dict({"run": {"name": "tracked", "run_dir": str(run_dir), "loggers": ["tensorboard", "wandb"]},
                            "redis": {"url": f"redis://10.0.0.5:6379/0?password={pw}&db=2"},
                            "judge": {"base_url": f"https://llm.example/v1?api_key={pw}"}})
    open_trackers(run_dir, cfg).close()
    config_text = tb_text(tb_accumulator(run_dir / "tensorboard"), "config")[0]
    assert '"url": "redis://10.0.0.5:6379/0?db=2"' in config_text and pw not in config_text
    run = WandbRun(offline_wandb)
    assert run.config["redis"]["url"] == "redis://10.0.0.5:6379/0?db=2"
    assert run.config["judge"]["base_url"] == "https://llm.example/v1"
    leaks = [str(p) for p in tmp_path.rglob("*") if p.is_file() and pw.encode() in p.read_bytes()]
    assert leaks == []


def test_samples_jsonl_renders_in_worldloop_show(tmp_path):
    _, batch = _drive(tmp_path, ["jsonl"])
    lines = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(x["step"], x["trajectory_id"]) for x in lines] == [(2, t.trajectory_id) for t in pick_samples(batch)]
    assert not (tmp_path / "tensorboard").exists()
    from worldloop.show import build_page, episode_view, read_records

    records, bad, file = read_records(tmp_path / "samples.jsonl")
    assert bad == 0 and len(records) == 4
    ep = episode_view(records[3], file.parent, 3, replay=False)
    assert ep.ident == "traj-5" and len(ep.turns) == 2
    assert ep.turns[1].images[0].startswith("data:image/png;base64,")
    assert ep.turns[1].rewards == {"env": 2.5, "format": 0.5, "judge": 0.25, "total": 3.25}
    assert ep.turns[0].state_after == "box at 1" or "box at 1" in (ep.turns[0].state_after or "")
    assert ep.total_reward == pytest.approx(sum(t.env_reward + 0.75 for t in batch[5].turns))
    page = build_page(tmp_path / "samples.jsonl", replay=False)
    assert page.count("data:image/png;base64,") >= 8 and "ep5 predicts box at 2" in page


def test_resumed_learner_continues_the_wandb_run_and_skips_old_evals(tmp_path, offline_wandb):
    trackers = open_trackers(tmp_path, make_cfg(tmp_path, ["wandb"]))
    trackers.log_step(1, step_record(1), [])
    (tmp_path / "eval.jsonl").write_text(json.dumps({"eval": {"step": 0, "success_rate": {"all": 0.25}}}) + "\n")
    trackers.close()
    first = (tmp_path / "wandb_run_id").read_text().strip()
    trackers = open_trackers(tmp_path, make_cfg(tmp_path, ["wandb"], resume=True))
    trackers.log_step(2, step_record(2), [])
    trackers.close()
    assert (tmp_path / "wandb_run_id").read_text().strip() == first
    runs = glob.glob(str(offline_wandb / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 2 and all(first in r for r in runs)  # two segments of one run id
    steps = {}
    for p in runs:
        for rec in wandb_records(Path(p)):
            if rec.WhichOneof("record_type") == "history":
                row = {i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                for k in ("step", "eval/step"):
                    if k in row:
                        steps.setdefault(k, []).append(row[k])
    assert {k: sorted(v) for k, v in steps.items()} == {"step": [1, 2], "eval/step": [0]}  # the resumed learner did not log eval 0 again


# --------------------------------------------------------------------------- a real learner


@pytest.mark.slow
def test_a_real_learner_step_reaches_tensorboard_wandb_and_samples(tmp_path, offline_wandb, shared_tiny_model):
    """Two PPO updates of the tiny model (real DeepSpeed, Redis, ZeroMQ): every number of each
    step's metrics.jsonl line is in TensorBoard and wandb at that step; samples of step 2."""
    from worldloop.common.contracts.modeling import ChatCodec
    from worldloop.common.transport.redis_local import LocalRedis
    from worldloop.testing.trajectories import synthetic_trajectory
    from worldloop.testing.learner import tiny_learner_config, train_until_stopped

    model_dir = shared_tiny_model(max_image_side=112)
    codec = ChatCodec(model_dir, max_image_side=112)
    trajs = [synthetic_trajectory(codec, trajectory_id=f"s{i}", seed=i, turns=2, response_tokens=4,
                                  env_reward=float(i % 3), success=i % 3 == 2, reasoning_reward=0.1 * i)
             for i in range(8)]
    srv = LocalRedis().start()
    try:
        cfg = tiny_learner_config(model_dir, srv.url, tmp_path / "run", namespace="trk", total_steps=2,
                                  checkpoint_every=2, sample_every=2)
        cfg.run.loggers = ["jsonl", "tensorboard", "wandb"]
        _, rc = train_until_stopped(cfg, trajs)
        assert rc == 0
    finally:
        srv.close()
    run_dir = tmp_path / "run"
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]
    acc = tb_accumulator(run_dir / "tensorboard")
    run = WandbRun(offline_wandb)
    for line in lines:
        flat = flatten(line)
        assert {"losses/policy", "losses/value", "kl", "entropy", "clip_fraction", "advantage/std",
                "importance_weight/mean", "reward/total", "reward/reasoning", "success_rate/sokoban",
                "staleness_mean", "step_seconds/backward", "tokens_per_s"} <= set(flat)
        for key, v in flat.items():
            if key != "step":  # TensorBoard's own axis
                assert tb_scalar(acc, key)[line["step"]] == pytest.approx(v, rel=1e-6, abs=1e-12), key
            assert run.value(key, "step", line["step"]) == pytest.approx(v, rel=1e-12), key
    assert run.config["trainer"]["train_batch_size"] == 4 and run.config["model"]["path"] == str(model_dir)
    # step 2 trained s4..s7 (rewards per episode 2*(env + 0.5 + 0.1 i)): samples are s4..s7 by reward
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    by_id = {t.trajectory_id: t for t in trajs}
    assert sorted(x["trajectory_id"] for x in samples) == ["s4", "s5", "s6", "s7"]
    assert [x["total_reward"] for x in samples] == sorted(x["total_reward"] for x in samples)
    for s in samples:
        assert s["step"] == 2 and s["total_reward"] == pytest.approx(
            sum(u.env_reward + u.format_reward + u.reasoning_reward for u in by_id[s["trajectory_id"]].turns))
    table, files = run.table("samples")
    rows = [dict(zip(table["columns"], d)) for d in table["data"]]
    assert len(rows) == 8 and {r["step"] for r in rows} == {2}
    for r in rows:
        turn = by_id[r["trajectory_id"]].turns[r["turn"]]
        assert r["response"] == turn.response_text and r["reasoning_reward"] == pytest.approx(turn.reasoning_reward)
        assert np.array_equal(pixels(files[r["image"]["path"]]), pixels(turn.images[0]))
    first = by_id[samples[0]["trajectory_id"]]
    (img,) = acc.Images("samples/0/turn1")
    assert np.array_equal(pixels(img.encoded_image_string), pixels(first.turns[1].images[0]))


# --------------------------------------------------------------------------- the final evaluation


def _eval_line(version: int, rate: float) -> str:
    return json.dumps({"eval": {"policy_version": version, "step": version, "success_rate": {"all": rate}}}) + "\n"


def test_wait_for_eval_logs_the_final_version_written_while_it_waits(tmp_path):
    import threading

    trackers = open_trackers(tmp_path, make_cfg(tmp_path, ["tensorboard"]))
    (tmp_path / "eval.jsonl").write_text(_eval_line(2, 0.25))

    def evaluator():  # the evaluator writes the final version a little later, half a line first
        with open(tmp_path / "eval.jsonl", "a") as f:
            line = _eval_line(3, 0.5)
            f.write(line[:10])
            f.flush()
            threading.Event().wait(0.3)
            f.write(line[10:])

    t = threading.Thread(target=evaluator)
    t.start()
    try:
        assert trackers.wait_for_eval(3, lambda: True, 120, poll_s=0.05) is True
    finally:
        t.join()
        trackers.close()
    assert trackers.eval_versions == {2, 3}
    assert tb_scalar(tb_accumulator(tmp_path / "tensorboard"), "eval/success_rate/all") == {2: 0.25, 3: 0.5}


def test_wait_for_eval_gives_up_without_an_evaluator_on_a_stop_or_at_the_limit(tmp_path):
    trackers = open_trackers(tmp_path, make_cfg(tmp_path, ["jsonl"]))
    (tmp_path / "eval.jsonl").write_text(_eval_line(2, 0.25))
    try:
        alive_calls = []
        assert trackers.wait_for_eval(3, lambda: alive_calls.append(1) or False, 120) is False
        assert alive_calls == [1]  # asked once, then no waiting for an evaluator that is gone
        assert trackers.wait_for_eval(3, lambda: True, 120, should_stop=lambda: True) is False
        assert trackers.wait_for_eval(3, lambda: True, 0.2, poll_s=0.05) is False  # another version only
        assert trackers.eval_versions == {2}
        # an evaluator that wrote the final version just before it exited still counts
        with open(tmp_path / "eval.jsonl", "a") as f:
            f.write(_eval_line(3, 0.5))
        assert trackers.wait_for_eval(3, lambda: False, 120) is True
    finally:
        trackers.close()
