"""The worldloop command in a subprocess: help for every subcommand, bad overrides exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from worldloop.cli import COMMANDS

ROOT = Path(__file__).resolve().parent.parent


def cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "worldloop", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def test_top_level_help_lists_every_subcommand() -> None:
    out = cli("--help")
    assert out.returncode == 0
    for name in COMMANDS:
        assert name in out.stdout


@pytest.mark.parametrize("name", list(COMMANDS))
def test_subcommand_help_explains(name: str) -> None:
    out = cli(name, "--help")
    assert out.returncode == 0, out.stderr
    first_words = " ".join(COMMANDS[name][3].split()[:4])
    assert first_words in " ".join(out.stdout.split())


def test_bad_override_exits_2_naming_the_key() -> None:
    out = cli("status", "redis.max_backlogg=3")
    assert out.returncode == 2
    assert "redis.max_backlogg" in out.stderr and "unknown key" in out.stderr
    out = cli("status", "redis.max_backlog=many")
    assert out.returncode == 2 and "redis.max_backlog" in out.stderr


def test_learner_takes_the_deepspeed_launchers_local_rank() -> None:
    from worldloop.cli import build_parser

    args = build_parser().parse_args(["learner", "--local_rank=1", "--config", "x.yaml", "trainer.zero_stage=2"])
    assert args.local_rank == 1 and args.overrides == ["trainer.zero_stage=2"]
    with pytest.raises(SystemExit, match="^2$"):  # argparse exits 2; only the learner is launched that way
        build_parser().parse_args(["actor", "--local_rank=1"])


def test_no_subcommand_exits_2() -> None:
    assert cli().returncode == 2


def test_status_without_redis_url_fails_clearly() -> None:
    out = cli("status")
    assert out.returncode == 1 and "redis.url is null" in out.stderr


def test_status_unreachable_redis_fails_clearly() -> None:
    from worldloop.common.metrics import free_port

    out = cli("status", f"redis.url=redis://:hidden@127.0.0.1:{free_port()}/0")
    assert out.returncode == 1 and "cannot read Redis" in out.stderr
    assert "hidden" not in out.stderr  # the password is never printed


def test_status_of_a_populated_run(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    import time

    from worldloop import status
    from worldloop.common.contracts.config import load_config
    from worldloop.common.transport.control import read_stats, register_process, stats_incr, write_control
    from worldloop.common.contracts.keys import Keys, ROLLOUTS_GROUP, SCORED_GROUP
    from worldloop.common.transport.streams import StreamConsumer, StreamProducer, connect

    keys, r = Keys("demo"), connect(redis_url)
    prod = StreamProducer(redis_url, keys.rollouts, max_backlog=100)
    for i in range(5):
        prod.add(b"%d" % i)
    judge = StreamConsumer(redis_url, keys.rollouts, ROLLOUTS_GROUP, "judge-7", deadletter_stream=keys.deadletter)
    judge.ack([m.id for m in judge.read(1)])  # 1 done
    judge.read(2)  # 2 pending, 2 undelivered
    StreamConsumer(redis_url, keys.scored, SCORED_GROUP, "learner-0")
    r.xadd(keys.rollouts, {b"nodata": b"1"})
    judge.read(5)  # the 2 undelivered + the poison one -> dead letter
    write_control(r, keys, policy_version=12, max_turns=3, run_state="paused")
    register_process(r, keys, "actor", "a-1", 9100)
    old = {"role": "actor", "id": "gone", "seen_at": time.time() - 3600}
    r.hset(keys.procs, "actor:gone", __import__("json").dumps(old))
    r.hset(keys.procs, "junk", b"{not json")
    assert stats_incr(r, keys, "judge_failures", 2) == 2
    stats_incr(r, keys, "judge_fallbacks")
    assert read_stats(r, keys) == {"judge_failures": 2, "judge_fallbacks": 1}

    info = status.collect(r, keys)
    roll, scored, dead = info["streams"]
    assert roll["length"] == 4 and roll["groups"][0]["pending"] == 4 and roll["groups"][0]["lag"] == 0
    assert roll["groups"][0]["consumers"][0]["name"] == "judge-7"
    assert scored["length"] == 0 and scored["groups"][0]["name"] == SCORED_GROUP
    assert dead["length"] == 1 and dead["groups"] == []
    assert [p["id"] for p in info["processes"]] == ["a-1"]

    cfg = load_config(None, [f"redis.url={redis_url}", "redis.namespace=demo"])
    assert status.run(cfg, None) == 0
    out = capsys.readouterr().out
    for text in (keys.rollouts, "length 4", "group judges: pending 4, lag 0", "consumer judge-7: pending 4",
                 keys.deadletter, "policy_version 12, max_turns 3, run_state paused",
                 "http://127.0.0.1:9100/metrics", "judge_failures: 2", "judge_fallbacks: 1"):
        assert text in out, text
    assert "gone" not in out


def test_sigusr1_prints_every_threads_stack_and_the_process_goes_on(tmp_path: Path) -> None:
    from worldloop.common.metrics import free_port
    from procs import Child, wait_for

    # a judge whose Redis is not there keeps reconnecting: a live process that is "stuck"
    judge = Child(["judge", f"redis.url=redis://127.0.0.1:{free_port()}/0", "metrics.enabled=false"],
                  tmp_path / "judge.log")
    try:
        wait_for(lambda: "reconnecting" in judge.output(None), "the judge to retry Redis", 60, [judge])
        judge.dump_stacks()
        # faulthandler writes thread by thread: wait for the whole dump, not its first header
        def whole_dump() -> bool:
            text = judge.output(None)
            return "most recent call first" in text and "Current thread" in text and "judge/process.py" in text

        assert wait_for(whole_dump, "a whole stack dump naming judge/process.py", 30, [judge])
        assert judge.returncode is None  # the dump does not stop it
    finally:
        judge.kill()
