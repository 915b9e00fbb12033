"""`worldloop judge` as real processes on a real Redis with a real HTTP judge endpoint:
exactly-once forwarding, pause/stop/SIGTERM, metrics, heartbeat, run-wide stats, the key never
logged, and a judge SIGKILLed mid-batch whose entries the other judge reclaims."""
from __future__ import annotations

import signal
import socket
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
import yaml
from redis.exceptions import ResponseError

from worldloop.common.transport.control import list_processes, read_stats, write_control

from worldloop.common.contracts.keys import Keys, ROLLOUTS_GROUP
from worldloop.common.contracts.schemas import Trajectory, decode_deadletter, decode_trajectory, encode_trajectory
from worldloop.common.transport.streams import DUPLICATE, FORWARDED, LOST_RACE, Forwarder, StreamConsumer, StreamProducer, connect
from worldloop.testing.fake_openai import FakeOpenAI
from tests.procs import Child, wait_for
from tests.test_judge_llm import above_judge
from tests.test_judge_rule import judge_trajectory, sokoban_state


def _trajectory(i: int) -> Trajectory:
    """Trajectory i: the player walks right in a 6x6 room; the observation is the true description."""
    before = sokoban_state((3, 1 + i % 3), [(2, 2)], [(1, 3)])
    after = sokoban_state((3, 2 + i % 3), [(2, 2)], [(1, 3)])
    return judge_trajectory(f"traj-{i:03d}", [(". ".join(before["relations"]) + f" (step {i})",
                                               ". ".join(after["relations"]), before, after)])


def _push(url: str, keys: Keys, n: int) -> None:
    prod = StreamProducer(url, keys.rollouts, max_backlog=10_000)
    for i in range(n):
        prod.add(encode_trajectory(_trajectory(i)))
    prod.close()


def _scored(r, keys: Keys) -> list[dict]:
    return [decode_trajectory(fields[b"data"]) for _, fields in r.xrange(keys.scored)]


def _spawn(tmp_path: Path, name: str, cfg: dict, env: dict | None = None) -> tuple[Child, Path]:
    cfg_path = tmp_path / f"{name}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    child = Child(["judge", "--config", str(cfg_path)], tmp_path / f"{name}.log", env=env)
    return child, child.log


def _consumer_name(proc: Child) -> str:
    return f"judge-{socket.gethostname()}-{proc.pid}"


def _pending_of(r, keys: Keys, consumer: str) -> list[str]:
    try:
        rows = r.xpending_range(keys.rollouts, ROLLOUTS_GROUP, min="-", max="+", count=1000, consumername=consumer)
    except ResponseError:  # no group yet: the judges are still starting
        return []
    return [row["message_id"].decode() for row in rows]


# ----------------------------------------------------------------------------- exactly once


def test_forward_is_exactly_once_under_a_reclaim_race_and_duplicate_ids(redis_url: str) -> None:
    keys = Keys("fw")
    r = connect(redis_url)
    prod = StreamProducer(redis_url, keys.rollouts, 100)
    payload = encode_trajectory(_trajectory(0))
    prod.add(payload)
    slow = StreamConsumer(redis_url, keys.rollouts, ROLLOUTS_GROUP, "slow", claim_idle_ms=0)
    fast = StreamConsumer(redis_url, keys.rollouts, ROLLOUTS_GROUP, "fast", claim_idle_ms=0)
    (m_slow,) = slow.read(1)
    (m_fast,) = fast.read(1)  # idle >= 0 ms: reclaimed while "slow" still works on it
    assert m_fast.id == m_slow.id and m_fast.reclaimed
    fw = Forwarder(redis_url, keys.rollouts, ROLLOUTS_GROUP, keys.scored, keys.judge_forwarded, max_backlog=100,
                   dedup_window_s=60)
    assert fw.forward(m_fast.id, payload, "traj-000") == FORWARDED
    assert fw.forward(m_slow.id, payload, "traj-000") == LOST_RACE  # the slow judge's XADD never happens
    assert r.xlen(keys.scored) == 1 and r.xlen(keys.rollouts) == 0
    assert r.xpending(keys.rollouts, ROLLOUTS_GROUP)["pending"] == 0
    # the actor sent the same trajectory twice (a retried XADD): acked, not forwarded again
    prod.add(payload)
    (m,) = slow.read(1)
    assert fw.forward(m.id, payload, "traj-000") == DUPLICATE
    assert r.xlen(keys.scored) == 1 and r.xlen(keys.rollouts) == 0
    assert r.zscore(keys.judge_forwarded, "traj-000") is not None
    # a retry after a lost reply finds the entry acked and adds nothing
    assert fw.forward(m.id, payload, "traj-000") == LOST_RACE and r.xlen(keys.scored) == 1
    for c in (prod, slow, fast, fw):
        c.close()


def test_a_live_judge_keeps_its_entries_from_being_reclaimed(redis_url: str) -> None:
    keys = Keys("touch")
    r = connect(redis_url)
    prod = StreamProducer(redis_url, keys.rollouts, 100)
    for i in range(2):
        prod.add(encode_trajectory(_trajectory(i)))
    idle_ms = 2000  # the touch-to-read window below is two Redis calls: far shorter than this, however loaded
    a = StreamConsumer(redis_url, keys.rollouts, ROLLOUTS_GROUP, "a", claim_idle_ms=idle_ms)
    b = StreamConsumer(redis_url, keys.rollouts, ROLLOUTS_GROUP, "b", claim_idle_ms=idle_ms)
    m1, m2 = a.read(2)

    def idle() -> dict[str, int]:  # each pending entry's idle time as Redis counts it
        rows = r.xpending_range(keys.rollouts, ROLLOUTS_GROUP, min="-", max="+", count=10)
        return {row["message_id"].decode(): int(row["time_since_delivered"]) for row in rows}

    # both idle longer than claim_idle_ms now, by Redis's own clock (not a sleep that a loaded machine stretches)
    wait_for(lambda: all(t > idle_ms for t in idle().values()), "both entries to pass claim_idle_ms", 60,
             extra=lambda: f"idle ms: {idle()}")
    assert a.touch([m1.id]) == 1  # a is still working on m1
    got = b.read(2, block_ms=10)
    assert [m.id for m in got] == [m2.id] and got[0].reclaimed, idle()  # only the untouched entry moves
    assert a.touch([m2.id]) == 0  # b owns it now: a does not steal it back
    for c in (prod, a, b):
        c.close()


# ----------------------------------------------------------------------------- one judge process


def test_judge_process_scores_pauses_counts_and_stops_cleanly(redis_url: str, tmp_path: Path) -> None:
    keys = Keys("jp")
    r = connect(redis_url)
    secret = "sk-worldloop-never-log-me-4242"
    with FakeOpenAI(above_judge, fail_first=2, fail_status=500) as fake:
        write_control(r, keys, run_state="paused")
        _push(redis_url, keys, 6)
        r.xadd(keys.rollouts, {b"data": b"\x93not a trajectory"})
        cfg = {"redis": {"url": redis_url, "namespace": keys.ns, "block_ms": 200},
               "judge": {"scorers": {"sokoban": ["rule", "llm"]}, "base_url": fake.base_url, "model": "fake-judge",
                         "api_key_env": "WORLDLOOP_JUDGE_TEST_KEY", "backoff_s": 0.01, "timeout_s": 5.0},
               "metrics": {"enabled": True, "port": 0}}
        proc, log_path = _spawn(tmp_path, "judge", cfg, {"WORLDLOOP_JUDGE_TEST_KEY": secret})
        try:
            wait_for(lambda: any(p["role"] == "judge" for p in list_processes(r, keys)), "the heartbeat", 90, [proc])
            time.sleep(1.0)  # paused: it must not take work
            assert r.xlen(keys.scored) == 0 and r.xpending(keys.rollouts, ROLLOUTS_GROUP)["pending"] == 0
            write_control(r, keys, run_state="running")
            wait_for(lambda: r.xlen(keys.scored) == 6, "6 scored trajectories", 30, [proc])
            (info,) = [p for p in list_processes(r, keys) if p["role"] == "judge"]
            metrics = urllib.request.urlopen(info["metrics_url"], timeout=5).read().decode()
            assert "worldloop_judge_trajectories_total 6.0" in metrics
            assert 'worldloop_judge_scored_turns_total{scorer="llm"} 6.0' in metrics
            assert 'worldloop_judge_request_seconds_count{scorer="llm"}' in metrics
            proc.proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=20) == 0
        finally:
            proc.kill()
        scored = _scored(r, keys)
        assert sorted(t.trajectory_id for t in scored) == [f"traj-{i:03d}" for i in range(6)]
        for t in scored:
            turn = t.turns[0]
            assert t.scored is True and turn.judge["fallback"] is False
            # rule F1 = 1.0 passes the gate, the stand-in judge says YES: (1 + 1) / 2 = 1.0 for both parts
            assert turn.grounding_score == 1.0 and turn.worldmodeling_score == 1.0
            assert turn.reasoning_reward == pytest.approx(1.0)
        assert r.xlen(keys.deadletter) == 1 and r.xlen(keys.rollouts) == 0
        assert read_stats(r, keys).get("judge_failures") == 2  # the two injected 500s, retried
        # the poison rollouts entry is counted run-wide like the learner's (found by bench/chaos.py)
        assert read_stats(r, keys).get("deadletter_rollouts_decode_error") == 1
        headers = {k.lower(): v for k, v in fake.chat_requests()[0]["headers"].items()}
        assert headers["authorization"] == f"Bearer {secret}"
    log = log_path.read_text()
    assert "stopped after forwarding 6 trajectories" in log
    assert secret not in log


def test_stopped_run_state_ends_the_process_and_bad_config_is_named(redis_url: str, tmp_path: Path) -> None:
    keys = Keys("js")
    r = connect(redis_url)
    write_control(r, keys, run_state="stopped")
    proc, log_path = _spawn(tmp_path, "stopped", {"redis": {"url": redis_url, "namespace": keys.ns},
                                                  "metrics": {"enabled": False}})
    assert proc.wait(timeout=60) == 0
    assert "run_state is stopped" in log_path.read_text()
    bad, bad_log = _spawn(tmp_path, "bad", {"redis": {"url": redis_url}, "judge": {"scorers": {"default": ["llm"]}},
                                            "metrics": {"enabled": False}}, {"OPENAI_API_KEY": ""})
    assert bad.wait(timeout=60) == 2
    assert "judge.base_url" in bad_log.read_text()


# ----------------------------------------------------------------------------- a judge dies mid-batch


def test_killed_judge_is_reclaimed_and_every_trajectory_is_scored_exactly_once(redis_url: str, tmp_path: Path) -> None:
    keys = Keys("jk")
    r = connect(redis_url)
    n = 40
    with FakeOpenAI(above_judge, delay_s=0.4) as fake:  # slow judge endpoint: entries stay pending a while
        _push(redis_url, keys, n)
        cfg = {"redis": {"url": redis_url, "namespace": keys.ns, "claim_idle_ms": 1500, "block_ms": 200},
               "judge": {"scorers": {"default": ["llm"]}, "base_url": fake.base_url, "concurrency": 4,
                         "batch_size": 4, "backoff_s": 0.01},
               "metrics": {"enabled": False}}
        victim, _ = _spawn(tmp_path, "victim", cfg)
        survivor, _ = _spawn(tmp_path, "survivor", cfg)
        try:
            held: list[str] = []

            def victim_mid_batch() -> bool:
                nonlocal held
                held = _pending_of(r, keys, _consumer_name(victim))
                return r.xlen(keys.scored) >= 4 and len(held) > 0

            wait_for(victim_mid_batch, "the victim to hold pending entries mid-run", 60, [victim, survivor])
            held_tids = {decode_trajectory(f[b"data"]).trajectory_id
                         for i in held for _, f in r.xrange(keys.rollouts, i, i)}
            victim.proc.send_signal(signal.SIGKILL)
            victim.wait(timeout=10)
            wait_for(lambda: r.xlen(keys.scored) >= n, "all trajectories scored", 60, [survivor])
            time.sleep(0.5)  # anything in flight would land now
            assert _pending_of(r, keys, _consumer_name(victim)) == []
            survivor.proc.send_signal(signal.SIGTERM)
            assert survivor.wait(timeout=20) == 0
        finally:
            for p in (victim, survivor):
                p.kill()
    ids = Counter(t.trajectory_id for t in _scored(r, keys))
    assert set(ids) == {f"traj-{i:03d}" for i in range(n)}
    assert max(ids.values()) == 1, [k for k, v in ids.items() if v > 1]
    assert held_tids and held_tids <= set(ids)  # what the victim held was reclaimed and scored
    assert r.xlen(keys.rollouts) == 0 and r.xpending(keys.rollouts, ROLLOUTS_GROUP)["pending"] == 0


# ----------------------------------------------------------------------------- a poison entry


def test_a_poison_entry_that_kills_each_judge_is_dead_lettered_after_max_deliveries(redis_url: str, tmp_path: Path) -> None:
    """Issue 31, item 4: a rollouts entry that kills whichever judge takes it (the chaos soak's
    poison, common/faults.py: exit 70 before anything is acked). A supervisor restarts the judge;
    each restart reclaims the entry and counts one more attempt, and past redis.max_deliveries the
    judge dead-letters it instead of dying again. The entries that were in flight with it (in the
    first judge's batch) are scored once each, not dead-lettered with it, and the poison's
    admission budget comes back."""
    from worldloop.common.transport.admission import Admission
    from worldloop.common.faults import POISON_ENV, POISON_EXIT

    keys = Keys("jpoison")
    r = connect(redis_url)
    adm = Admission(redis_url, keys, max_staleness=4, batch_size=4)
    ids = [f"traj-{i:03d}" for i in range(4)]
    assert adm.admit(ids, actor_version=0).admitted
    for t in ids:
        adm.settle(t)
    _push(redis_url, keys, 4)
    cfg = {"redis": {"url": redis_url, "namespace": keys.ns, "claim_idle_ms": 1000, "block_ms": 200,
                     "max_deliveries": 2},
           "judge": {"scorers": {"default": ["rule"]}}, "metrics": {"enabled": False}}
    exits = []
    proc = None
    try:
        for attempt in range(6):
            proc, _ = _spawn(tmp_path, f"judge{attempt}", cfg, {POISON_ENV: "traj-002"})
            done = wait_for(lambda: (proc.returncode is not None or (r.xlen(keys.scored) == 3 and r.xlen(keys.deadletter)))
                            or None, "the judge to die or finish", 120)
            if proc.returncode is None:
                break
            exits.append(proc.returncode)
        assert done and proc.returncode is None, exits
    finally:
        if proc is not None:
            proc.kill()
    assert exits == [POISON_EXIT, POISON_EXIT]  # attempts 1 and 2 killed a judge; the 3rd was refused
    assert sorted(t.trajectory_id for t in _scored(r, keys)) == ["traj-000", "traj-001", "traj-003"]
    (rec,) = [decode_deadletter(f[b"data"]) for _, f in r.xrange(keys.deadletter)]
    assert "attempted 2 times" in rec.reason and decode_trajectory(rec.payload).trajectory_id == "traj-002"
    assert read_stats(r, keys)["deadletter_rollouts_poison"] == 1
    assert adm.state()["refunded"] == 1
    adm.close()


def test_an_error_on_one_entry_leaves_it_pending_and_never_ends_the_judge(redis_url: str, monkeypatch) -> None:
    """Issue 31, items 1 and 4: an exception while one entry is handled (here the I/O error the
    shared-pool reset used to cause, raised by the hand-over) ended the judge. Now the entry stays
    pending for a retry and the judge carries on."""
    import asyncio

    from worldloop.common.contracts.config import load_config
    from worldloop.judge.process import JudgeWorker
    from worldloop.judge.scoring import TrajectoryScorer

    keys = Keys("jerr")
    _push(redis_url, keys, 1)
    cfg = load_config(None, [f"redis.url={redis_url}", f"redis.namespace={keys.ns}", "metrics.enabled=false",
                             "judge.scorers={default: [rule]}"])
    worker = JudgeWorker(cfg, proc_id="j")
    worker.scorer = TrajectoryScorer(cfg.judge, None)
    cons = StreamConsumer(redis_url, keys.rollouts, ROLLOUTS_GROUP, "j", decode=decode_trajectory, block_ms=10)
    fw = Forwarder(redis_url, keys.rollouts, ROLLOUTS_GROUP, keys.scored, keys.judge_forwarded, max_backlog=10,
                   dedup_window_s=60)
    (m,) = cons.read(1)

    def broken(*_a, **_k):
        raise ValueError("I/O operation on closed file.")

    monkeypatch.setattr(fw, "forward", broken)
    asyncio.run(worker._handle(m, cons, fw))  # no exception
    r = connect(redis_url)
    assert r.xpending(keys.rollouts, ROLLOUTS_GROUP)["pending"] == 1 and r.xlen(keys.scored) == 0
    monkeypatch.undo()
    asyncio.run(worker._handle(m, cons, fw))  # the retry forwards it
    assert r.xlen(keys.scored) == 1 and r.xpending(keys.rollouts, ROLLOUTS_GROUP)["pending"] == 0
    for c in (cons, fw):
        c.close()
