"""Resource faults as a user meets them: each ends in a clear error or a bounded, visible wait, never
a corrupt checkpoint or a silent stall.

* a disk that fills under the run directory while a checkpoint is written: the run directory is a
  real (small) tmpfs, filled by a real file; the learner fails naming ENOSPC and the path, leaves no
  half-written checkpoint that ``checkpoint.latest`` could pick, and ``--resume`` once there is
  space again continues from the last complete checkpoint with nothing lost or trained twice;
* a disk that is full when a record is appended to a run's JSON-lines file: the error names the
  file and ENOSPC, and the file is cut back to its length before the record;
* a judge endpoint that accepts requests and never answers: every turn gets the flagged fallback
  after ``judge.timeout_s`` x (1 + ``judge.max_retries``) and the trajectory moves on to ``scored``;
* the ``rollouts`` stream held at ``redis.max_backlog``: the producer waits, the wait is visible
  (metric, log line, the actor's phase in Redis) and bounded per slice, and it resumes when drained.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from worldloop.common.contracts.config import to_dict
from worldloop.common.files import append_lines
from worldloop.common.contracts.keys import Keys, SCORED_GROUP
from worldloop.common.contracts.modeling import ChatCodec
from worldloop.common.contracts.schemas import encode_trajectory
from worldloop.common.transport.streams import StreamProducer, connect
from worldloop.learner import checkpoint
from worldloop.testing.trajectories import synthetic_trajectory
from worldloop.testing.learner import tiny_learner_config
from worldloop.bootstrap.tiny_model import make_tiny_model
from ci import unavailable
from procs import exit_code, run_to_end, wait_for

ROOT = Path(__file__).resolve().parent.parent
_DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


# ----------------------------------------------------------------------------- disk full


def _mount_tmpfs(path: Path, size: str) -> None:
    """A real small filesystem at ``path`` (root only); skips (fails on CI) where mounting is refused."""
    path.mkdir(parents=True, exist_ok=True)
    why = None
    if os.geteuid() != 0:
        why = "mounting a tmpfs needs root"
    else:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            why = f"mount -t tmpfs failed: {done.stderr.strip()}"
    if why:
        unavailable(f"{why}; CI must allow the disk-full test (.ci/run runs as root)")


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _fill(fs: Path, leave: int) -> Path:
    """Fill the filesystem of ``fs`` with one real file until ``leave`` bytes are free."""
    filler = fs / "filler.bin"
    free = shutil.disk_usage(fs).free
    fd = os.open(filler, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        os.posix_fallocate(fd, 0, max(free - leave, 1))
    finally:
        os.close(fd)
    return filler


def test_a_record_appended_to_a_full_disk_fails_naming_the_file_and_leaves_no_torn_line(tmp_path):
    fs = tmp_path / "fs"
    _mount_tmpfs(fs, "1m")
    try:
        path = fs / "metrics.jsonl"
        append_lines(path, ['{"step": 1}\n'])
        filler = _fill(fs, leave=0)
        big = json.dumps({"step": 2, "pad": "x" * (256 << 10)}) + "\n"  # more than any page left over
        with pytest.raises(OSError, match=r"no space left on device \(ENOSPC\)") as info:
            append_lines(path, [big, '{"step": 3}\n'])
        err = info.value
        assert err.errno == errno.ENOSPC and err.filename == str(path)
        assert "no space left on device (ENOSPC)" in str(err) and str(path) in str(err)
        assert path.read_text() == '{"step": 1}\n'  # cut back: no half record
        filler.unlink()  # space again: the next append lands whole after the old line
        append_lines(path, [big])
        assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2]
    finally:
        _umount(fs)


@pytest.mark.slow
@pytest.mark.timeout(2000)  # its waits: 600 s for the step-2 checkpoint, 600 for the failure, 600 for --resume
def test_disk_full_during_a_checkpoint_fails_clearly_and_resume_continues(redis_url, tmp_path):
    ns = "diskfull"
    model_dir = make_tiny_model(tmp_path / "tiny", max_image_side=112)
    run_dir = tmp_path / "run"
    _mount_tmpfs(run_dir, "256m")
    try:
        cfg = tiny_learner_config(model_dir, redis_url, run_dir, namespace=ns, total_steps=4, checkpoint_every=2,
                                  max_staleness=100, use_critic=True)
        conf = tmp_path / "learner.yaml"
        conf.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        codec = ChatCodec(model_dir, max_image_side=112)
        prod = StreamProducer(redis_url, Keys(ns).scored, 1000)

        def produce(ids):
            for n in ids:
                prod.add(encode_trajectory(synthetic_trajectory(codec, trajectory_id=f"t{n}", seed=n, turns=1,
                                                                response_tokens=5, env_reward=float(n % 3))))

        produce(range(8))  # steps 1 and 2 (4 per update): the checkpoint of step 2 fits
        cmd = [sys.executable, "-m", "worldloop", "learner", "--config", str(conf)]
        log_path = tmp_path / "first.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT)
            try:
                def step_2_checkpointed() -> bool:
                    assert proc.poll() is None, f"the learner exited with {proc.returncode}\n" + log_path.read_text()[-3000:]
                    ck = checkpoint.latest(run_dir / "checkpoints")
                    return ck is not None and ck.name == "step_00000002"

                wait_for(step_2_checkpointed, "the checkpoint of step 2", 600, extra=lambda: log_path.read_text()[-3000:])
                # the disk fills: 256 KiB stay free, room for the metrics and ledger lines, not for a checkpoint
                filler = _fill(run_dir, 256 << 10)
                produce(range(8, 16))  # steps 3 and 4; the checkpoint of step 4 meets the full disk
                rc = exit_code(proc, 600, "the learner, after the disk filled", log_path)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        out = log_path.read_text()
        assert rc != 0, out[-3000:]
        # the error says what happened and where
        assert "no space left on device (ENOSPC)" in out, out[-4000:]
        assert str(run_dir / "checkpoints" / ".step_00000004.tmp") in out, out[-4000:]
        assert "step_00000002" in out.split("ENOSPC", 1)[1]  # names the checkpoint a resume will use
        # no half-written checkpoint anywhere that latest() (or a scan) would pick up
        ck_root = run_dir / "checkpoints"
        assert checkpoint.latest(ck_root).name == "step_00000002"
        assert sorted(p.name for p in ck_root.iterdir()) == ["latest", "run.json", "step_00000002"]
        assert (ck_root / "latest").read_text().strip() == "step_00000002"
        # step 4's ledger and metrics lines travel with its checkpoint (learner/process.py): none was written
        assert [x["step"] for x in _lines(run_dir / "metrics.jsonl")] == [1, 2, 3]
        r = connect(redis_url)
        assert r.xpending(Keys(ns).scored, SCORED_GROUP)["pending"] == 8  # steps 3-4: never acked

        # space again: --resume continues from step 2 and trains 3 and 4 again, from the same entries
        filler.unlink()
        second = run_to_end(cmd + ["--resume"], 600, "learner --resume", cwd=ROOT, env=_env())
        assert second.returncode == 0, second.stdout.decode()[-2000:] + second.stderr.decode()[-4000:]
        assert "resumed from " + str(ck_root / "step_00000002") in second.stdout.decode() + second.stderr.decode()
        state = checkpoint.read_state(checkpoint.latest(ck_root))
        assert state["step"] == 4 and state["policy_version"] == 4
        assert [x["step"] for x in _lines(run_dir / "metrics.jsonl")] == [1, 2, 3, 3, 4]
        last = {}
        for x in _lines(run_dir / "learner_ledger.jsonl"):
            last[x["step"]] = x  # the surviving lineage: the last line of each step wins
        trained = [t for s in sorted(last) for t in last[s]["trained"]]
        assert sorted(last) == [1, 2, 3, 4]
        assert len(trained) == len(set(trained)) == 16 and set(trained) == {f"t{i}" for i in range(16)}
        assert r.xpending(Keys(ns).scored, SCORED_GROUP)["pending"] == 0 and r.xlen(Keys(ns).scored) == 0
    finally:
        _umount(run_dir)


# ----------------------------------------------------------------------------- a judge endpoint that hangs


def test_hanging_judge_endpoint_gives_the_flagged_fallback_after_timeout_and_retries(redis_url, tmp_path):
    """The endpoint accepts every request and never answers. Each part of each turn makes
    (1 + max_retries) attempts, each ended by timeout_s, then gets ``fallback_score`` flagged
    ``fallback``; the trajectories move on to ``scored``, none stays pending, the judge stays up.
    How soon (about (1 + max_retries) x timeout_s, the parts waiting concurrently) is measured by
    ``python bench/judge.py --hang``, not here."""
    from tests.procs import Child, wait_for
    from tests.test_judge_process import _push, _scored
    from worldloop.common.contracts.keys import ROLLOUTS_GROUP
    from worldloop.testing.fake_openai import FakeOpenAI

    keys = Keys("jhang")
    r = connect(redis_url)
    timeout_s, retries, n = 1.0, 1, 3
    with FakeOpenAI() as fake:
        fake.hang = True
        cfg = {"redis": {"url": redis_url, "namespace": keys.ns, "block_ms": 200},
               "judge": {"scorers": {"sokoban": ["llm"]}, "base_url": fake.base_url, "model": "fake-judge",
                         "api_key_env": "WORLDLOOP_JUDGE_TEST_KEY", "timeout_s": timeout_s, "max_retries": retries,
                         "backoff_s": 0.05, "fallback_score": 0.25},
               "metrics": {"enabled": False}}
        cfg_path = tmp_path / "judge.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg))
        judge = Child(["judge", "--config", str(cfg_path)], tmp_path / "judge.log", env={"WORLDLOOP_JUDGE_TEST_KEY": "k"})
        try:
            _push(redis_url, keys, n)
            wait_for(lambda: fake.chat_requests(), "the first judge request", 120, [judge])
            # a liveness bound (the timing is bench/judge.py --hang's): every attempt ends at its timeout
            wait_for(lambda: r.xlen(keys.scored) == n, f"{n} scored trajectories", 60, [judge],
                     extra=lambda: f"{len(fake.chat_requests())} requests so far; rollouts {r.xlen(keys.rollouts)}")
            assert judge.returncode is None  # the judge is still up, reading
        finally:
            judge.kill()
        reqs = fake.chat_requests()
    attempts_per_part = 1 + retries
    assert len(reqs) == n * 2 * attempts_per_part  # 2 parts (grounding, world modeling) per turn
    scored = _scored(r, keys)
    assert sorted(t.trajectory_id for t in scored) == [f"traj-{i:03d}" for i in range(n)]
    for t in scored:
        turn = t.turns[0]
        assert turn.judge["fallback"] is True
        for part in ("grounding", "worldmodeling"):
            d = turn.judge[part]["scorers"]["llm"]
            assert d["fallback"] is True and d["reason"] == "timeout" and d["attempts"] == attempts_per_part
        assert turn.grounding_score == 0.25 and turn.worldmodeling_score == 0.25
    assert r.xlen(keys.rollouts) == 0 and r.xpending(keys.rollouts, ROLLOUTS_GROUP)["pending"] == 0
    print(f"\nhanging judge: {n} trajectories scored by flagged fallback (timeout_s={timeout_s}, "
          f"max_retries={retries}), {len(reqs)} requests")


# ----------------------------------------------------------------------------- backlog at its limit


@pytest.mark.slow
@pytest.mark.timeout(800)  # its waits add up to 630 s
def test_backlog_at_its_limit_blocks_visibly_and_recovers_when_drained(redis_url, tmp_path):
    """A real actor with ``redis.max_backlog`` 2 and no judge: the stream fills, the actor waits in
    slices of ``PUSH_SLICE_S`` (each one ends, re-checks stop and adds to the wait metric), says so in
    its log, its phase (with the seconds waited) and /metrics, and goes on once a consumer drains
    the stream; SIGTERM during such a wait ends it within a slice or two."""
    import re
    import signal
    import urllib.request

    from tests.procs import Child, wait_for
    from worldloop.actor.process import PUSH_SLICE_S
    from worldloop.common.transport.control import list_processes
    from worldloop.common.contracts.keys import ROLLOUTS_GROUP
    from worldloop.common.contracts.schemas import decode_trajectory
    from worldloop.common.transport.streams import StreamConsumer

    keys = Keys("bp")
    r = connect(redis_url)
    limit = 2
    cfg = {
        "redis": {"url": redis_url, "namespace": keys.ns, "max_backlog": limit, "block_ms": 200},
        "weights": {"pub_port": 0, "fetch_port": 0},
        "metrics": {"enabled": True, "port": 0},
        "model": {"path": str(make_tiny_model(tmp_path / "model", max_image_side=56)), "make_tiny_if_missing": False,
                  "max_image_side": 56},
        "actor": {"num_envs": 2, "max_turns": 1, "max_new_tokens": 8, "admission": False, "actor_id": "bp-actor",
                  "envs": [{"id": "worldloop/FrozenLake-v0", "kwargs": {"size": 3, "render_mode": "text"}}]},
    }
    cfg_path = tmp_path / "actor.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    actor = Child(["actor", "--config", str(cfg_path)], tmp_path / "actor.log")

    def info() -> dict:
        return next((p for p in list_processes(r, keys) if p["role"] == "actor"), {})

    def scrape() -> dict[str, float]:
        text = urllib.request.urlopen(info()["metrics_url"], timeout=5).read().decode()
        out = {}
        for line in text.splitlines():
            m = re.match(r'(worldloop_stream_backpressure_\w+)\{stream="\{bp\}:rollouts"\} (\S+)', line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    try:
        wait_for(lambda: "waiting on backpressure" in info().get("phase", ""), "the actor to block on the full stream",
                 240, [actor])
        assert r.xlen(keys.rollouts) == limit
        assert f"{keys.rollouts} is at its backlog limit (2 undelivered entries): waiting on backpressure" in actor.output(None)
        # visible and growing, slice by slice: the phase's seconds, the metrics
        total = "worldloop_stream_backpressure_seconds_total"
        w1, m1 = info()["backpressure_wait_s"], scrape()
        assert m1["worldloop_stream_backpressure_blocked"] == 1.0

        def grown():  # each 1 s slice ends and adds its wait: both grow by two slices while the block lasts
            w, m = info()["backpressure_wait_s"], scrape()
            return (w, m) if w >= w1 + 2 * PUSH_SLICE_S and m[total] >= m1[total] + 2 * PUSH_SLICE_S else None

        w2, m2 = wait_for(grown, "the phase's wait seconds and the wait counter to grow by two slices", 120, [actor],
                          extra=lambda: f"phase {info()}, metrics {scrape()} (first read: {w1}, {m1})")
        assert m2["worldloop_stream_backpressure_blocked"] == 1.0  # still the same block
        assert r.xlen(keys.rollouts) == limit  # nothing past the limit

        # drain, as a judge would (read, ack + delete): the actor goes on
        drain = StreamConsumer(redis_url, keys.rollouts, ROLLOUTS_GROUP, "drainer", decode=decode_trajectory)
        got = drain.read(10)
        drain.ack([m.id for m in got])
        wait_for(lambda: f"room in {keys.rollouts} again after" in actor.output(None), "the actor to resume", 60, [actor])
        resumed = re.findall(r"room in \{bp\}:rollouts again after ([\d.]+) s of backpressure", actor.output(None))
        # the log's account of the block covers what the phase showed of it before the drain (the
        # same wait, measured by the actor from the same start; both rounded to 0.1 s)
        assert float(resumed[0]) >= w2 - 0.1, (resumed, w2)
        wait_for(lambda: r.xlen(keys.rollouts) == limit, "the stream to fill again", 120, [actor])
        wait_for(lambda: "waiting on backpressure" in info().get("phase", ""), "the second block", 60, [actor])
        # a stop during the wait: bounded by a slice, clean exit
        t0 = time.monotonic()
        actor.proc.send_signal(signal.SIGTERM)
        assert actor.wait(timeout=30) == 0
        stop_s = time.monotonic() - t0
        drain.close()
    finally:
        actor.kill()
    assert "not pushed" in actor.output(None)  # it said what it gave up on
    print(f"\nbackpressure: blocked {resumed[0]} s before the drain; phase wait {w1} -> {w2} s; "
          f"backpressure_seconds {m1['worldloop_stream_backpressure_seconds_total']:.1f} -> "
          f"{m2['worldloop_stream_backpressure_seconds_total']:.1f}; SIGTERM while blocked -> exit 0 in {stop_s:.1f} s")
