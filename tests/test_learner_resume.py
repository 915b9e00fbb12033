"""kill -9 of a ``worldloop learner`` process mid-run, then ``--resume``: the version sequence
continues from the checkpoint, no acked trajectory is lost and none is trained twice.

Also: the same config run under ``torchrun --nproc_per_node 2`` (two CPU ranks, gloo, ZeRO-3)
completes its updates."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from redis.exceptions import ResponseError

from worldloop.common.contracts.config import to_dict
from worldloop.common.contracts.keys import Keys, SCORED_GROUP
from worldloop.common.contracts.modeling import ChatCodec
from worldloop.common.contracts.schemas import decode_trajectory, encode_trajectory
from worldloop.common.transport.streams import StreamProducer, connect
from worldloop.learner import checkpoint
from worldloop.testing.trajectories import synthetic_trajectory
from worldloop.testing.learner import tiny_learner_config
from procs import run_to_end, wait_for

ROOT = Path(__file__).resolve().parent.parent
_DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")


@pytest.fixture(scope="module")
def model_dir(shared_tiny_model) -> Path:
    return shared_tiny_model(max_image_side=112)


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _write_config(cfg, path: Path) -> Path:
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return path


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _produce(redis_url: str, ns: str, model_dir: Path, order: list[str]) -> None:
    codec = ChatCodec(model_dir, max_image_side=112)
    prod = StreamProducer(redis_url, Keys(ns).scored, 1000)
    for tid in order:
        n = int(tid[1:])
        prod.add(encode_trajectory(synthetic_trajectory(codec, trajectory_id=tid, seed=n, turns=1 + n % 2, response_tokens=5,
                                                        env_reward=float(n % 3))))


@pytest.mark.slow
def test_kill_9_and_resume_loses_nothing_and_trains_nothing_twice(redis_url, model_dir, tmp_path):
    ns = "resume"
    run_dir = tmp_path / "run"
    # 30 entries: t0..t27 plus re-sent copies of t3 and t10 (as an actor retrying an XADD would). The
    # first learner gets only the 17 entries of steps 1-4 (t0..t15 and the copy of t3, dropped as a
    # duplicate): it waits for more after step 4, so the kill comes at a known step, not a raced one
    order = [f"t{i}" for i in range(10)] + ["t3"] + [f"t{i}" for i in range(10, 20)] + ["t10"] + [f"t{i}" for i in range(20, 28)]
    _produce(redis_url, ns, model_dir, order[:17])
    cfg = tiny_learner_config(model_dir, redis_url, run_dir, namespace=ns, total_steps=6, checkpoint_every=3,
                              max_staleness=100, use_critic=True)
    conf = _write_config(cfg, tmp_path / "learner.yaml")
    cmd = [sys.executable, "-m", "worldloop", "learner", "--config", str(conf)]
    log1 = open(tmp_path / "first.log", "wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=log1, stderr=subprocess.STDOUT)
    metrics = run_dir / "metrics.jsonl"
    r = connect(redis_url)
    keys = Keys(ns)

    def waiting_after_step_4() -> bool:
        assert proc.poll() is None, f"the learner exited with {proc.returncode}\n" + (tmp_path / "first.log").read_text()[-3000:]
        # step 4's line is written and every entry is read (the 13 read before the checkpoint of step 3
        # are acked and deleted, step 4's 4 are held): the learner now waits for a 5th batch
        try:
            pending = r.xpending(keys.scored, SCORED_GROUP)["pending"]
        except ResponseError:  # NOGROUP: the learner has not created its group yet
            return False
        return any(x["step"] >= 4 for x in _lines(metrics)) and pending == r.xlen(keys.scored) == 4

    wait_for(waiting_after_step_4, "step 4, then the wait for more data", 240,
             extra=lambda: (tmp_path / "first.log").read_text()[-3000:])
    os.kill(proc.pid, signal.SIGKILL)  # kill -9: no checkpoint, no ack, no cleanup
    proc.wait()
    log1.close()
    killed_at = max(x["step"] for x in _lines(metrics))
    ckpt = checkpoint.latest(run_dir / "checkpoints")
    assert ckpt is not None
    ckpt_step = checkpoint.read_state(ckpt)["step"]
    # killed after step 4 (no data for a 5th): step 4 was trained, published and lost with the process
    assert ckpt_step == 3 and killed_at == 4
    assert r.xpending(keys.scored, SCORED_GROUP)["pending"] == 4  # the dead learner held step 4's entries
    _produce(redis_url, ns, model_dir, order[17:])

    n_before = len(_lines(metrics))
    second = run_to_end(cmd + ["--resume"], 240, "learner --resume", cwd=ROOT, env=_env())
    assert second.returncode == 0, second.stdout.decode()[-2000:] + second.stderr.decode()[-4000:]

    resumed = _lines(metrics)[n_before:]
    # the version sequence continues from the checkpoint: steps ckpt+1..6, version == step
    assert [x["step"] for x in resumed] == list(range(ckpt_step + 1, 7))
    assert all(x["policy_version"] == x["step"] for x in resumed)
    state = checkpoint.read_state(checkpoint.latest(run_dir / "checkpoints"))
    assert state["step"] == 6 and state["policy_version"] == 6

    # the surviving lineage: for every step, its last ledger line (lines of the lost updates are superseded)
    last = {}
    for x in _lines(run_dir / "learner_ledger.jsonl"):
        last[x["step"]] = x
    assert sorted(last) == [1, 2, 3, 4, 5, 6]
    trained = [tid for s in sorted(last) for tid in last[s]["trained"]]
    assert len(trained) == len(set(trained)) == 24  # none trained twice, re-sent copies included
    assert set(trained) == {f"t{i}" for i in range(24)}  # FIFO: the first 24 distinct trajectories

    # nothing acked is lost: what left the stream was trained (or was a copy of a trained one),
    # and what is left (never read) was not trained
    left = [decode_trajectory(f[b"data"]).trajectory_id for _, f in r.xrange(keys.scored)]
    assert sorted(left) == [f"t{i}" for i in range(24, 28)]
    assert r.xpending(keys.scored, SCORED_GROUP)["pending"] == 0
    assert set(state["trained"]) == set(trained)


@pytest.mark.slow
def test_two_cpu_ranks_under_torchrun(redis_url, model_dir, tmp_path):
    ns = "ranks"
    run_dir = tmp_path / "run"
    _produce(redis_url, ns, model_dir, [f"t{i}" for i in range(8)])
    cfg = tiny_learner_config(model_dir, redis_url, run_dir, namespace=ns, total_steps=2, checkpoint_every=2,
                              zero_stage=3, max_staleness=100)
    conf = _write_config(cfg, tmp_path / "learner.yaml")
    # torchrun is `python -m torch.distributed.run` (its script may be missing beside this interpreter)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "worldloop",
           "learner", "--config", str(conf)]
    done = run_to_end(cmd, 300, "learner under torchrun", cwd=ROOT, env=_env())
    assert done.returncode == 0, done.stdout.decode()[-2000:] + done.stderr.decode()[-4000:]
    lines = _lines(run_dir / "metrics.jsonl")  # written by rank 0 only
    assert [x["step"] for x in lines] == [1, 2] and all(x["trajectories"] == 4 for x in lines)
    ledger = _lines(run_dir / "learner_ledger.jsonl")
    assert sorted(t for x in ledger for t in x["trained"]) == sorted(f"t{i}" for i in range(8))
    state = checkpoint.read_state(checkpoint.latest(run_dir / "checkpoints"))
    assert state["world_size"] == 2 and state["policy_version"] == 2
    assert (checkpoint.latest(run_dir / "checkpoints") / "hf" / "model.safetensors").exists()
    assert connect(redis_url).xlen(Keys(ns).scored) == 0
