"""End to end: `worldloop up` with a learner, 2 actors, 1 judge and the evaluator on a real Redis.

One actor is SIGKILLed mid-run (its admitted episodes' leases run out and give their budget back),
then the learner after its first step (up restarts it with --resume); the run still completes its
learner steps, the evaluator wrote held-out records for the first and the final version, every process's /metrics was scraped, and the run directory holds
metrics.jsonl, the plot and the logs.
"""

from __future__ import annotations

import json
import os
import platform
import re
import signal
import time

import pytest
import redis
import yaml

import sys

from worldloop.common.contracts.config import load_config
from worldloop.common.transport.control import list_processes, write_control
from worldloop.common.contracts.keys import Keys
from procs import Child, wait_for

@pytest.mark.slow
@pytest.mark.timeout(1300)  # its waits: 240 s for actor-0's first push, 300 for the learner's first step, 600 for the end
def test_up_completes_three_steps_despite_a_killed_actor(tmp_path, redis_url):
    ns = "e2e"
    cfg_path = tmp_path / "tiny.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "run": {"name": "e2e", "run_dir": str(tmp_path / "run")},
        "redis": {"url": redis_url, "namespace": ns, "max_backlog": 32, "claim_idle_ms": 3000},
        "weights": {"pub_port": 0, "fetch_port": 0},
        "model": {"path": str(tmp_path / "model"), "make_tiny_if_missing": True, "max_image_side": 56},
        "actor": {
            "num_envs": 2, "max_turns": 2, "max_new_tokens": 24, "n_samples_per_seed": 2, "admission_lease_s": 10,
            "envs": [{"id": "worldloop/FrozenLake-v0",
                      "kwargs": {"size": 3, "min_actions_to_succeed": 2, "render_mode": "vision",
                                     "prompt_format": "grounding_worldmodeling"}}],
        },
        "judge": {"enabled": True, "scorers": {"default": ["rule"]}},
        "trainer": {"total_steps": 3, "train_batch_size": 4, "ppo_mini_batch_size": 2, "micro_batch_size": 1,
                    "checkpoint_every": 2, "eval_every": 2, "eval_episodes": 2, "final_eval_episodes": 3},
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

        # then kill -9 the learner once it has trained a step: up restarts it with --resume
        def learner_after_a_step():
            if not (run_dir / "learner_ledger.jsonl").exists():
                return None
            learners = [p for p in list_processes(r, keys) if p["role"] == "learner"]
            return max(learners, key=lambda p: p["seen_at"])["pid"] if learners else None

        learner_pid = wait_for(learner_after_a_step, "the learner's first step", 300, [up], extra=run_logs)
        os.kill(learner_pid, signal.SIGKILL)
        rc = up.wait(timeout=600)
    finally:
        up.stop()
    out = up.output(None)
    assert rc == 0, f"worldloop up exited {rc}\n{out[-4000:]}{run_logs()}"
    assert "actor-0 exited with -9; restarting" in out  # the killed actor was noticed and replaced
    assert "learner exited with -9; restarting with --resume" in out
    # processes that exit cleanly once the learner has said stopped are not restarted
    assert "exited with 0; restarting" not in out, out[-3000:]

    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [x for x in lines if "step" in x]
    assert [s["step"] for s in steps][-1] >= 3
    # held-out evaluation during training: the start (v0) in-run, and the final version on the final
    # evaluation's seeds after the learner stopped, in both files
    evals = [json.loads(line)["eval"] for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    versions = [e["policy_version"] for e in evals]
    in_run = [e["policy_version"] for e in evals if not e["final"]]
    assert versions[0] == 0 and in_run == sorted(set(in_run)) and [e["final"] for e in evals][-1], (
        f"evaluated versions {versions}\n{out[-3000:]}{run_logs()}")
    assert versions[-1] == steps[-1]["policy_version"], f"final v{steps[-1]['policy_version']}, evaluated {versions}"
    assert [x["eval"] for x in lines if "eval" in x] == evals
    # the learner kept its trackers open for the final evaluation (TensorBoard/wandb get it too)
    final = steps[-1]["policy_version"]
    assert f"the final version v{final}'s held-out evaluation is in the trackers" in (run_dir / "logs" / "learner.log").read_text()
    for e in evals:
        n_env = 3 if e["final"] else 2
        assert e["episodes"] == {"frozenlake": n_env, "all": n_env}
        k, n = e["successes"]["all"], e["episodes"]["all"]
        assert e["success_rate"]["all"] == k / n and e["ci95"]["all"][0] <= k / n <= e["ci95"]["all"][1]
        # first-turn reading: every first turn of the 3x3 FrozenLake asks for an observation and is scored
        reading = e["first_turn_reading"]
        assert reading["turns"] == {"frozenlake": n_env, "all": n_env}
        assert reading["rate"]["all"] == reading["right"]["all"] / n_env
        # the evaluator's CPU: its evaluations' seconds against the run's, from the heartbeats
        assert e["cpu_s"] > 0 and 0 < e["cpu"]["in_run_eval_s"] <= e["cpu"]["evaluator_s"] < e["cpu"]["run_s"]
    # the in-run evaluations' share of the run's CPU when it stopped, before the final evaluation
    at_stop = evals[-1]["cpu_at_stop"]
    assert at_stop["in_run_eval_s"] == evals[-1]["cpu"]["in_run_eval_s"] and at_stop["run_s"] < evals[-1]["cpu"]["run_s"]
    # the made model: where it came from, and the recipe's reports
    model = json.loads((run_dir / "model.json").read_text())
    assert model["source"] in ("built", "cache") and model["recipe"]["recipe_hash"] == model["recipe_hash"]
    assert json.loads((run_dir / "sft.json").read_text())["demonstrations"] == 4
    cpu = json.loads((run_dir / "cpu.json").read_text())
    assert set(cpu["seconds"]) == {"learner", "actor", "judge", "evaluator"} and 0 < cpu["share"]["evaluator"] < 1
    assert "the evaluator's share" in out
    assert "held-out success at v" in out
    assert (run_dir / "training.png").stat().st_size > 1000
    scrapes = json.loads((run_dir / "scrapes.json").read_text())
    roles = {k.split(":")[0] for k, n in scrapes.items() if n >= 1}
    assert roles == {"learner", "actor", "judge", "evaluator"}, scrapes
    assert sum(1 for k in scrapes if k.startswith("actor:")) >= 2
    assert (run_dir / "config.yaml").exists() and (run_dir / "logs" / "learner.log").exists()
    versions = json.loads((run_dir / "versions.json").read_text())
    import torch
    assert versions["torch"] == torch.__version__ and versions["python"] == platform.python_version()
    assert versions["worldloop"] and versions["transformers"]


def test_package_versions_reads_metadata_and_marks_missing_packages(monkeypatch) -> None:
    from importlib import metadata

    from worldloop.common import versions

    monkeypatch.setattr(versions, "VERSIONED_PACKAGES", ("numpy", "no-such-package-xyz"))
    v = versions.package_versions()
    assert v == {"python": platform.python_version(), "numpy": metadata.version("numpy"), "no-such-package-xyz": None}


@pytest.mark.parametrize("run_state, restarted", [("stopped", False), ("running", True)])
def test_a_clean_exit_is_restarted_only_while_the_run_goes_on(tmp_path, redis_url, capsys, run_state, restarted):
    """After the learner said stopped, actors and judges exit 0 while it waits for the final
    evaluation: up leaves them be. Before that a clean exit is restarted like a crash."""
    from worldloop.up import Child as UpChild, Progress, _supervise

    r = redis.Redis.from_url(redis_url)
    keys = Keys(f"sup-{run_state}")
    write_control(r, keys, run_state=run_state)
    cfg = load_config(None, ["up.progress_interval_s=60"])
    py = sys.executable
    # the learner ends 3 s after the actor's first run has (a fixed 3 s from the start was once less
    # than a loaded machine took to start the actor's Python: up saw the learner end first)
    learner = ("import os, sys, time\nt = time.time()\nwhile not os.path.exists(sys.argv[1]) and time.time() - t < 120:\n"
               "    time.sleep(0.05)\ntime.sleep(3)")
    children = [UpChild("learner", "learner", [py, "-c", learner, str(tmp_path / "ran")], tmp_path / "learner.log"),
                # exits 0 at once the first time, then stays up (a restarted actor)
                UpChild("actor-0", "actor", [py, "-c", "import os, sys, time\nif os.path.exists(sys.argv[1]): time.sleep(30)\n"
                                                 "open(sys.argv[1], 'w').close()", str(tmp_path / "ran")], tmp_path / "actor.log")]
    try:
        for c in children:
            c.start(dict(os.environ))
        rc = _supervise(cfg, children, dict(os.environ), r, keys, tmp_path, Progress(), {"flag": False})
    finally:
        for c in children:
            c.stop(signal.SIGKILL)
            c.close()
    out = capsys.readouterr().out
    assert rc == 0, out
    assert children[1].restarts == (1 if restarted else 0), out
    assert ("actor-0 finished (run_state stopped)" in out) == (not restarted), out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_grounding_stops_up_at_once_and_leaves_no_half_made_model(tmp_path, sig):
    """Grounding and SFT run inside `worldloop up` for minutes: Ctrl-C (or supervisor's SIGTERM) there
    must end the run now, with its private redis-server, and must leave nothing in the model cache
    that the next run would take as prepared (it would skip grounding and SFT)."""
    cfg_path = tmp_path / "up.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "run": {"name": "sig", "run_dir": str(tmp_path / "run")},
        "redis": {"url": None},
        "model": {"max_image_side": 56, "tiny_grounding_steps": 100_000, "tiny_grounding_batch_size": 2},
        "actor": {"max_turns": 2, "envs": [{"id": "worldloop/FrozenLake-v0",
                                            "kwargs": {"size": 3, "min_actions_to_succeed": 2, "render_mode": "vision",
                                                       "image_size": 56}}]},
        "sft": {"enabled": False},
        "trainer": {"total_steps": 1},
    }))
    cache = tmp_path / "cache"
    up = Child(["up", str(cfg_path)], tmp_path / "up.log", env={"XDG_CACHE_HOME": str(cache)})
    try:
        wait_for(lambda: "model: grounding pre-training" in up.output(None), "grounding to start", 240, [up])
        time.sleep(2.0)  # into its steps
        url = re.search(r"started a local redis-server at (\S+)", up.output(None)).group(1)
        assert redis.Redis.from_url(url).ping()  # up's own redis-server
        models = cache / "worldloop" / "models"
        assert any(".build-" in p.name for p in models.iterdir())  # the build runs in a temporary folder
        os.kill(up.pid, sig)
        rc = up.wait(timeout=60)  # a liveness bound: without the fix it ran all 100,000 steps first
    finally:
        up.stop()
    assert rc == 130, up.describe()
    # nothing a later run would take as a finished model, and no half-made one left behind
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == [], up.describe()
    with pytest.raises(redis.ConnectionError, match="(?i)connect"):  # stopped with the run
        redis.Redis.from_url(url, socket_connect_timeout=2).ping()
