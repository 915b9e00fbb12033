"""End to end: `worldloop up` with a learner, 2 actors and 1 judge on a real Redis.

One actor is SIGKILLed mid-run; the run still completes its learner steps, every process's
/metrics was scraped, and the run directory holds metrics.jsonl, the plot and the logs.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import redis
import yaml

from common.control import Keys, list_processes
from procs import Child, wait_for

@pytest.mark.slow
def test_up_completes_three_steps_despite_a_killed_actor(tmp_path, redis_url):
    ns = "e2e"
    cfg_path = tmp_path / "tiny.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "run": {"name": "e2e", "run_dir": str(tmp_path / "run")},
        "redis": {"url": redis_url, "namespace": ns, "max_backlog": 32, "claim_idle_ms": 3000},
        "weights": {"pub_port": 0, "fetch_port": 0},
        "model": {"path": str(tmp_path / "model"), "make_tiny_if_missing": True, "max_image_side": 56},
        "actor": {
            "num_envs": 2, "max_turns": 2, "max_new_tokens": 24, "n_samples_per_seed": 2,
            "envs": [{"id": "worldloop/FrozenLake-v0",
                      "kwargs": {"size": 3, "min_actions_to_succeed": 2, "render_mode": "vision",
                                     "prompt_format": "grounding_worldmodeling"}}],
        },
        "judge": {"enabled": True, "scorers": {"default": ["rule"]}},
        "trainer": {"total_steps": 3, "train_batch_size": 4, "ppo_mini_batch_size": 2, "micro_batch_size": 1,
                    "checkpoint_every": 2},
        "sft": {"enabled": True, "episodes": 4, "epochs": 1},
        "up": {"num_actors": 2, "num_judges": 1, "progress_interval_s": 1.0},
    }))
    up = Child(["up", str(cfg_path)], tmp_path / "up.log")
    r = redis.Redis.from_url(redis_url)
    keys = Keys(ns)
    run_dir = tmp_path / "run"

    def run_logs() -> str:
        return "".join(f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((run_dir / "logs").glob("*.log")))

    try:
        # kill actor-0 once it has pushed at least one trajectory
        def first_trajectory():
            actors = {p["id"]: p for p in list_processes(r, keys) if p["role"] == "actor"}
            if "actor-0" in actors and (r.xlen(keys.rollouts) + r.xlen(keys.scored)) > 0:
                return actors["actor-0"]["pid"]
            return None

        killed = wait_for(first_trajectory, "actor-0 to push a trajectory", 240, [up], extra=run_logs)
        os.kill(killed, signal.SIGKILL)
        rc = up.wait(timeout=300)
    finally:
        up.kill()
    out = up.output(None)
    assert rc == 0, f"worldloop up exited {rc}\n{out[-4000:]}{run_logs()}"
    assert "restarting" in out  # the killed actor was noticed and replaced

    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [s["step"] for s in steps][-1] >= 3
    assert (run_dir / "training.png").stat().st_size > 1000
    scrapes = json.loads((run_dir / "scrapes.json").read_text())
    roles = {k.split(":")[0] for k, n in scrapes.items() if n >= 1}
    assert roles == {"learner", "actor", "judge"}, scrapes
    assert sum(1 for k in scrapes if k.startswith("actor:")) >= 2
    assert (run_dir / "config.yaml").exists() and (run_dir / "logs" / "learner.log").exists()
