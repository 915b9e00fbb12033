"""Scaling out: two actors started on their own join a running learner over Redis AUTH and CURVE.

Each actor is given only what an actor on another machine would have: the Redis URL (with its
password), the learner's ZeroMQ address with the server's public CURVE key, and a model directory.
The learner was started first and knows nothing about them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import urllib.request
from pathlib import Path

import pytest
import redis
import yaml
import zmq.auth

from worldloop.common.transport.control import list_processes, write_control
from worldloop.common.contracts.keys import Keys
from worldloop.common.transport.redis_local import LocalRedis
from worldloop.bootstrap.tiny_model import make_tiny_model
from procs import Child, wait_for

ENV = {"id": "worldloop/FrozenLake-v0",
       "kwargs": {"size": 3, "min_actions_to_succeed": 2, "render_mode": "vision", "image_size": 56}}


# the weight publisher's start-up line (common/transport/weights/publisher.py) with the ports the OS gave it
WEIGHTS_LINE = re.compile(r"weights publisher: PUB tcp://127\.0\.0\.1:(?P<pub>\d+), ROUTER tcp://127\.0\.0\.1:(?P<fetch>\d+)")


def _scrape(url: str) -> dict[str, float]:
    sums: dict[str, float] = {}
    for line in urllib.request.urlopen(url, timeout=5).read().decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            key = name.split("{", 1)[0]
            sums[key] = sums.get(key, 0.0) + float(value)
    return sums


@pytest.mark.slow
@pytest.mark.timeout(1300)  # its waits add up to 1,200 s
def test_two_separately_started_actors_join_a_running_learner(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    certs.mkdir()
    zmq.auth.create_certificates(str(certs), "server")  # server.key (actors) + server.key_secret (learner)
    model = make_tiny_model(tmp_path / "model", seed=0, max_image_side=56)
    srv = LocalRedis(password="not-in-any-log").start()
    ns = "scale"
    learner_cfg = {
        "run": {"run_dir": str(tmp_path / "run")},
        "redis": {"url": srv.url, "namespace": ns},
        # ports 0: the OS hands the learner free ones (no pick-then-bind race); the actors are told
        # the ports the learner's log names
        "weights": {"bind": "127.0.0.1", "pub_port": 0, "fetch_port": 0,
                    "curve_server_secret": str(certs / "server.key_secret")},
        "model": {"path": str(model), "max_image_side": 56},
        "actor": {"max_turns": 2, "envs": [ENV]},
        "judge": {"enabled": False},
        # more steps than the test waits for: it stops the run once both actors' trajectories were trained
        "trainer": {"total_steps": 1000, "train_batch_size": 4, "ppo_mini_batch_size": 2, "micro_batch_size": 2,
                    "checkpoint_every": 1, "max_staleness": 8},
    }
    (tmp_path / "learner.yaml").write_text(yaml.safe_dump(learner_cfg))

    def write_actor_config(pub_port: int, fetch_port: int) -> None:
        # what an actor machine gets: Redis URL, learner address + server public key, a model directory
        actor_cfg = {
            "redis": {"url": srv.url, "namespace": ns},
            "weights": {"host": "127.0.0.1", "pub_port": pub_port, "fetch_port": fetch_port,
                        "curve_server_public": str(certs / "server.key")},
            "model": {"path": str(model), "max_image_side": 56},
            "actor": {"num_envs": 2, "max_turns": 2, "max_new_tokens": 24, "envs": [ENV]},
            "judge": {"enabled": False},
        }
        (tmp_path / "actor.yaml").write_text(yaml.safe_dump(actor_cfg))
    r = redis.Redis.from_url(srv.url)
    keys = Keys(ns)
    procs: dict[str, Child] = {}

    def spawn(name: str, *args: str, env: dict | None = None) -> None:
        procs[name] = Child(list(args), tmp_path / f"{name}.log", env=env, new_session=True)

    def produced(name: str) -> set[str]:  # ids whose XADD returned, in the actor's own log (ProducedLog)
        path = tmp_path / f"{name}.ids"
        return set(path.read_text().split()) if path.exists() else set()

    def ledger() -> list[dict]:
        path = tmp_path / "run" / "learner_ledger.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []

    def trained() -> set[str]:
        return {t for line in ledger() for t in line["trained"]}

    def live() -> list[Child]:
        return [c for c in procs.values() if c.returncode is None]

    scraped: dict[str, dict[str, float]] = {}

    def scrape_actors() -> None:
        for p in list_processes(r, keys):
            if p["role"] == "actor" and p.get("metrics_url"):
                try:
                    scraped[p["id"]] = _scrape(p["metrics_url"])
                except OSError:
                    pass

    try:
        spawn("learner", "learner", "--config", str(tmp_path / "learner.yaml"))
        wait_for(lambda: any(p["role"] == "learner" for p in list_processes(r, keys)), "the learner to register",
                 180, live())
        bound = wait_for(lambda: WEIGHTS_LINE.search(procs["learner"].output(None)),
                         "the learner's log to name its weight ports", 60, live())
        write_actor_config(int(bound["pub"]), int(bound["fetch"]))
        for name in ("remote-a", "remote-b"):
            spawn(name, "actor", "--config", str(tmp_path / "actor.yaml"), f"actor.actor_id={name}",
                  env={"WORLDLOOP_PRODUCED_LOG": str(tmp_path / f"{name}.ids")})

        def both_trained() -> bool:
            scrape_actors()
            done = trained()
            return len(ledger()) >= 4 and all(produced(n) & done for n in ("remote-a", "remote-b"))

        # a fast actor may feed many batches before a slow one (2 CI cores) finishes its first episode:
        # the run goes on until the learner has trained 4 steps and trajectories of both actors
        wait_for(both_trained, "4 steps and trained trajectories of both actors", 600, live(),
                 extra=lambda: f"steps {len(ledger())}, produced a/b {len(produced('remote-a'))}/"
                               f"{len(produced('remote-b'))}, trained of a/b {len(produced('remote-a') & trained())}/"
                               f"{len(produced('remote-b') & trained())}")
        scrape_actors()  # once more: after the ledger showed their trajectories, so it counts their episodes
        write_control(r, keys, run_state="stopped")  # as a learner does after its last step
        assert procs["learner"].wait(120) == 0, procs["learner"].describe()

        # the run is stopped: each actor ends its current generation and exits by itself
        for name in ("remote-a", "remote-b"):
            procs[name].wait(120)
    finally:
        for c in live():
            os.killpg(c.pid, signal.SIGTERM)
        for c in procs.values():
            try:
                c.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(c.pid, signal.SIGKILL)
                c.proc.wait()
        srv.close()
    for name in ("remote-a", "remote-b"):
        assert procs[name].returncode == 0, procs[name].describe()
        assert name in scraped, f"{name} never served its metrics while registered"
        # the learner published a version after each update; each actor applied at least one of them
        # between generations. Read from the log: an actor may apply its last version and exit
        # between two scrapes of its metrics.
        applied = (tmp_path / f"{name}.log").read_text().count("applied weights v")
        assert applied >= 1, procs[name].describe()
        assert scraped[name].get("worldloop_actor_episodes_total", 0.0) >= 1
    # both actors' trajectories were trained, and nothing that neither produced
    done = trained()
    assert produced("remote-a") & done and produced("remote-b") & done
    assert done <= produced("remote-a") | produced("remote-b")
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [s["step"] for s in steps] == list(range(1, len(steps) + 1)) and len(steps) >= 4
    assert sum(len(x["trained"]) for x in ledger()) == 4 * len(steps) == len(done)  # none trained twice
    logs = "".join(p.read_text() for p in tmp_path.glob("*.log"))
    assert "not-in-any-log" not in logs  # the Redis password never reaches a log
