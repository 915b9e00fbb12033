"""End to end: ``worldloop up ... actor.backend=server`` on a real Redis, with its inference server
(``worldloop serve``: vLLM on CPU) killed mid-run.

The run starts a local server, trains 4 steps with the actor generating on it, and survives a
kill -9 of the server's whole process group while requests are in flight after the first step
(up restarts it; the actor's requests wait for it and go out again): the run completes, every trajectory the actor pushed is
trained once or accounted for (dropped by the learner, still queued), none is trained twice, the
servers loaded the learner's versions as they came, and the trained turns carry the versions
that produced them. (That a server loads every version, and labels each response with one, is
tested precisely in test_server_backend.py.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import urllib.request
from collections import Counter

import pytest
import redis
import yaml

from procs import Child, wait_for
from test_vllm_backend import SIDE, _require_vllm, make_vllm_tiny_model
from worldloop.actor.process import ProducedLog
from worldloop.common.transport.control import list_processes
from worldloop.common.contracts.keys import Keys
from worldloop.common.contracts.schemas import decode_deadletter, decode_trajectory

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

DROP_RE = re.compile(r"dropping (\w+) trajectory (\S+) \(entry")  # learner/data.py's log line


def _fates(run_dir, produced: list[str], r, keys: Keys) -> dict[str, str]:
    """Each produced trajectory id's fate: trained once / twice, dead-lettered, queued, dropped, lost."""
    by_step = {}
    for line in (run_dir / "learner_ledger.jsonl").read_text().splitlines():
        rec = json.loads(line)
        by_step[rec["step"]] = rec["trained"]  # the last line of a step wins (a restarted learner)
    trained = Counter(t for ids in by_step.values() for t in ids)
    dead = {decode_trajectory(decode_deadletter(f[b"data"]).payload).trajectory_id for _, f in r.xrange(keys.deadletter)}
    queued = {decode_trajectory(f[b"data"]).trajectory_id for s in (keys.rollouts, keys.scored) for _, f in r.xrange(s)}
    logs = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("learner*.log"))
    dropped = {m.group(2): m.group(1) for m in DROP_RE.finditer(logs)}
    return {t: ("trained once" if trained[t] == 1 else "trained twice" if trained[t] > 1 else "dead-lettered" if t in dead
                else "queued" if t in queued else f"dropped ({dropped[t]})" if t in dropped else "lost") for t in produced}


def test_up_with_a_server_backend_survives_a_killed_server(tmp_path, redis_url):
    _require_vllm()
    ns = "srv"
    model = make_vllm_tiny_model(tmp_path / "model")
    run_dir = tmp_path / "run"
    cfg_path = tmp_path / "server-run.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "run": {"name": "srv", "run_dir": str(run_dir)},
        "redis": {"url": redis_url, "namespace": ns, "max_backlog": 32, "claim_idle_ms": 3000},
        "weights": {"pub_port": 0, "fetch_port": 0},
        "model": {"path": str(model), "make_tiny_if_missing": False, "max_image_side": SIDE, "max_model_len": 1024,
                  "dtype": "float32"},
        "actor": {
            # 128 tokens a turn (two turns stay within max_model_len): requests stay in flight long
            # enough for the test to find one on a fast machine (64 were missed once under -n 3)
            "backend": "server", "num_envs": 4, "max_turns": 2, "max_new_tokens": 128, "n_samples_per_seed": 2,
            "envs": [{"id": "worldloop/FrozenLake-v0",
                      "kwargs": {"size": 3, "min_actions_to_succeed": 2, "render_mode": "vision",
                                 "prompt_format": "grounding_worldmodeling"}}],
        },
        "judge": {"enabled": True, "scorers": {"default": ["rule"]}},
        # max_staleness 1: the third batch can only be admitted once the server holds v1 or newer, the
        # fourth once it holds v2. 4 steps: the learner writes step 1's ledger line after publishing
        # v1, so on a fast machine the whole third batch could be generated before the test saw the
        # line (once, with 3 steps, the run ended without a request in flight after it); the fourth
        # batch is generated after that line, and the run needs it
        "trainer": {"total_steps": 4, "train_batch_size": 4, "ppo_mini_batch_size": 2, "micro_batch_size": 1,
                    "checkpoint_every": 2, "max_staleness": 1, "sample_every": 1},
        "sft": {"enabled": False},
        "up": {"num_actors": 1, "num_judges": 1, "progress_interval_s": 1.0},
    }))
    produced_log = tmp_path / "produced.ids"
    up = Child(["up", str(cfg_path)], tmp_path / "up.log", env={ProducedLog.ENV: str(produced_log)})
    r = redis.Redis.from_url(redis_url)
    keys = Keys(ns)
    servers_seen: set[int] = set()

    def run_logs() -> str:
        return "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted((run_dir / "logs").glob("*.log")))

    found: dict = {}  # the server's pid and URL, once the learner trained a step

    def busy_server():
        """The server's pid once the learner trained a step and the server has requests in flight.
        Once the step is there, each poll is one GET: a turn's requests are in flight for a fraction
        of a second, and a poll that also read Redis and the run's config missed them all once."""
        if not found:
            pids = [p["pid"] for p in list_processes(r, keys) if p["role"] == "server"]
            servers_seen.update(pids)
            if not pids or not (run_dir / "learner_ledger.jsonl").exists():
                return None
            found.update(pid=pids[0], url=yaml.safe_load((run_dir / "config.yaml").read_text())["actor"]["servers"][0])
        pid, url = found["pid"], found["url"]
        try:
            with urllib.request.urlopen(url + "/worldloop/info", timeout=5) as resp:
                return pid if json.loads(resp.read())["requests"] > 0 else None
        except OSError:
            return None

    try:
        # mid-episode, after the learner's first step: kill -9 the server with its engine and workers
        pid = wait_for(busy_server, "requests on the server after the learner's first step", 600, [up], extra=run_logs)
        os.killpg(pid, signal.SIGKILL)
        rc = up.wait(timeout=900)
    finally:
        up.stop()
        for pid in servers_seen:  # a server left behind by a failed run (up was killed)
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    out = up.output(None)
    assert rc == 0, f"worldloop up exited {rc}\n{out[-4000:]}{run_logs()}"
    assert "server-0 exited with -9; restarting" in out, out[-3000:]
    # the actor's requests in flight failed with the server and were sent again
    assert "sending the request again" in (run_dir / "logs" / "actor-0.log").read_text(), run_logs()

    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [s["step"] for s in steps if "step" in s][-1] == 4
    # nothing the actor pushed is lost or trained twice
    produced = produced_log.read_text().split()
    fates = _fates(run_dir, produced, r, keys)
    counts = Counter(fates.values())
    assert counts["trained once"] == 16 and counts["lost"] == 0 and counts["trained twice"] == 0, (counts, run_logs())
    # the servers (before and after the kill) loaded newer and newer versions: at least v1 or v2
    # (the third batch is admitted only once a server holds v1 or newer), each trained turn
    # carries the version that generated it
    server_log = (run_dir / "logs" / "server-0.log").read_text(errors="replace")
    # one instance per start (a restarted server applies the newest version before it says ready)
    for instance in server_log.split("starting the inference server")[1:]:
        order = [int(v) for v in re.findall(r"applied weights v(\d+) ", instance)]
        assert order == sorted(set(order)), order
    loaded = {int(v) for v in re.findall(r"applied weights v(\d+) ", server_log)}
    assert loaded & {1, 2}, server_log[-3000:]
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines() if x.strip()]
    versions = [t["policy_version"] for s in samples for t in s["turns"]]
    assert versions and set(versions) <= loaded | {0} and max(versions) >= 1, versions
    # the server heartbeat as role server with its /metrics, and up scraped it
    scrapes = json.loads((run_dir / "scrapes.json").read_text())
    assert any(k.startswith("server:") and n >= 1 for k, n in scrapes.items()), scrapes
