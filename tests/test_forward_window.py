"""Issue 38, finding 10: the forwarder's exactly-once window runs on Redis's clock, and it expires.

Before, each judge passed its own ``time.time()`` to the forward script: a judge whose clock ran
2 days ahead pruned every id "older than a day" by its clock, i.e. the whole set, and the next
duplicate from a judge with a right clock reached ``scored`` a second time.
"""

from __future__ import annotations

import time
import types

from worldloop.common.transport import streams
from worldloop.common.contracts.keys import ROLLOUTS_GROUP, Keys
from worldloop.common.transport.streams import DUPLICATE, FORWARDED, Forwarder, StreamConsumer, StreamProducer, connect
from tests.procs import wait_for

DAY_S = 86400.0


def _forward_one(prod: StreamProducer, judge: StreamConsumer, fw: Forwarder, tid: str) -> int:
    """Add ``tid``'s entry to rollouts, read it as ``judge`` and hand it over with ``fw``."""
    payload = f"payload of {tid}".encode()
    prod.add(payload)
    (m,) = judge.read(1)
    return fw.forward(m.id, payload, tid)


def test_a_judge_with_a_clock_days_ahead_lets_no_duplicate_through(redis_url: str, monkeypatch) -> None:
    keys = Keys("skew")
    r = connect(redis_url)
    prod = StreamProducer(redis_url, keys.rollouts, 100)
    judge = StreamConsumer(redis_url, keys.rollouts, ROLLOUTS_GROUP, "judge-a")
    right = Forwarder(redis_url, keys.rollouts, ROLLOUTS_GROUP, keys.scored, keys.judge_forwarded, max_backlog=100,
                      dedup_window_s=DAY_S)
    ahead = Forwarder(redis_url, keys.rollouts, ROLLOUTS_GROUP, keys.scored, keys.judge_forwarded, max_backlog=100,
                      dedup_window_s=DAY_S)
    assert _forward_one(prod, judge, right, "traj-x") == FORWARDED
    # the second judge's clock is 2 days ahead (what time.time() says in its process)
    real_time = time.time
    monkeypatch.setattr(streams, "time", types.SimpleNamespace(time=lambda: real_time() + 2 * DAY_S,
                                                                monotonic=time.monotonic, sleep=time.sleep))
    assert _forward_one(prod, judge, ahead, "traj-y") == FORWARDED
    monkeypatch.undo()
    # traj-x is still remembered: its retried XADD from the actor is a duplicate, not a second score
    assert r.zscore(keys.judge_forwarded, "traj-x") is not None
    assert _forward_one(prod, judge, right, "traj-x") == DUPLICATE
    assert r.xlen(keys.scored) == 2
    # every score in the set is Redis's time of the hand-over (within the seconds this test ran)
    now_s, now_us = r.time()
    redis_now = now_s + now_us / 1e6
    scores = dict(r.zrange(keys.judge_forwarded, 0, -1, withscores=True))
    assert set(scores) == {b"traj-x", b"traj-y"}
    assert all(redis_now - 600 < s <= redis_now for s in scores.values()), (scores, redis_now)
    for c in (prod, judge, right, ahead):
        c.close()


def test_the_dedup_window_expires_by_redis_time(redis_url: str) -> None:
    """An id is remembered ``dedup_window_s`` of Redis time and then forgotten: within the window a
    second copy is a DUPLICATE; once Redis's clock passed the window, the next hand-over prunes it
    and a copy arriving that late is forwarded (the documented bound of the exactly-once window).
    Two forwarders on one set: a 1-hour window for the copy within it, a 1-second one to expire."""
    keys = Keys("window")
    r = connect(redis_url)
    prod = StreamProducer(redis_url, keys.rollouts, 100)
    judge = StreamConsumer(redis_url, keys.rollouts, ROLLOUTS_GROUP, "judge-a")
    hour, second = (Forwarder(redis_url, keys.rollouts, ROLLOUTS_GROUP, keys.scored, keys.judge_forwarded,
                              max_backlog=100, dedup_window_s=w) for w in (3600.0, 1.0))
    assert _forward_one(prod, judge, hour, "traj-old") == FORWARDED
    first = r.zscore(keys.judge_forwarded, "traj-old")
    assert _forward_one(prod, judge, hour, "traj-old") == DUPLICATE
    assert r.xlen(keys.scored) == 1

    def redis_now() -> float:
        s, us = r.time()
        return s + us / 1e6

    wait_for(lambda: redis_now() - first > 1.0, "Redis's clock to pass the 1 s window", 30)
    assert _forward_one(prod, judge, second, "traj-new") == FORWARDED  # this hand-over prunes traj-old
    assert r.zscore(keys.judge_forwarded, "traj-old") is None
    assert r.zscore(keys.judge_forwarded, "traj-new") is not None
    assert _forward_one(prod, judge, hour, "traj-old") == FORWARDED  # past the window: forgotten
    assert r.xlen(keys.scored) == 2 + 1
    for c in (prod, judge, hour, second):
        c.close()
