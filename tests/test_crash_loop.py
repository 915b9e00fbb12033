"""Issue 38, finding 3: a learner crash loop does not turn good data into poison.

Every restart's ``recover()`` re-read the dead learner's pending list with XREADGROUP, which counts
one more delivery of every entry, whatever killed the process: 4 good trajectories were
dead-lettered by the 6th learner process. Now only the entries whose deciding or training raised
an error of their making (blamed from ``{ns}:learner:inflight``) count a delivery; a learner killed
from outside counts nothing, and a real poison entry, one that makes every learner that trains it
fail, is still dead-lettered after ``redis.max_deliveries``.

Each "learner process" here is a real ``ScoredSource`` (its own connections) on a real
redis-server; it dies by being dropped without acking anything, as kill -9 leaves it, after
blaming its entries in flight when its update raised (as ``Learner.step`` does).
"""

from __future__ import annotations

from worldloop.common.contracts.config import config_from_dict
from worldloop.common.transport.control import read_stats
from worldloop.common.contracts.keys import SCORED_GROUP, Keys
from worldloop.common.contracts.schemas import decode_deadletter, encode_trajectory
from worldloop.common.transport.streams import StreamProducer, connect
from tests.test_learner_data import NS, _cfg, _pending, _source, _traj, _Versions, codec, model_dir  # noqa: F401

MAX_DELIVERIES = config_from_dict({}).redis.max_deliveries  # the default, 5


def _delivery_counts(url: str) -> dict[str, int]:
    rows = connect(url).xpending_range(Keys(NS).scored, SCORED_GROUP, min="-", max="+", count=100)
    return {row["message_id"].decode(): int(row["times_delivered"]) for row in rows}


def test_a_learner_restarted_more_than_max_deliveries_times_dead_letters_no_good_entry(redis_url, codec) -> None:
    """7 learner lives (more than the default max_deliveries 5, and than `up`'s 5 restarts), each
    training the same 4 good entries and dying before its checkpoint acks them. Lives 2, 3 and 4
    are killed in the middle of the update (kill -9: no strike); life 5's update raises an error of
    the entries' making (blamed: a strike against the batch); the others die after the update (the
    entries merely held). Nothing is dead-lettered, and the count is exactly 1 + 1 strike."""
    cfg = _cfg(redis_url)
    assert MAX_DELIVERIES == 5 and cfg.redis.max_deliveries == MAX_DELIVERIES
    keys = Keys(NS)
    prod = StreamProducer(redis_url, keys.scored, 100)
    for i in range(4):
        prod.add(encode_trajectory(_traj(codec, f"good-{i}")))
    prod.close()
    v = _Versions()
    for life in range(1, 8):
        src = _source(cfg, codec, v)
        assert src.recover() == (0 if life == 1 else 4)
        items = src.collect(4, lambda: False, max_wait_s=30)  # (before the fix: [] from life 6 on, dead-lettered)
        assert sorted(it.trajectory_id for it in items) == [f"good-{i}" for i in range(4)], life
        if life == 5:
            assert src.blame() == 4  # the update raised on these entries: Learner.step blames them
        elif life not in (2, 3, 4):
            src.mark_trained(items)  # the update went through; it dies later (publishing, checkpointing, idle)
        src.close()  # dies: nothing acked
    r = connect(redis_url)
    assert r.xlen(keys.deadletter) == 0 and "deadletter_scored_poison" not in read_stats(r, keys)
    assert _pending(redis_url) == 4
    # 1 for the first read + one strike for life 5 (nothing for the 3 kills mid-update nor the other restarts)
    assert sorted(_delivery_counts(redis_url).values()) == [2, 2, 2, 2]
    assert not r.exists(keys.learner_inflight) and not r.exists(keys.learner_inflight + ":blamed")


def test_a_poison_entry_that_kills_every_learner_is_still_dead_lettered(redis_url, codec) -> None:
    """The poison (first in the stream, trained alone in batches of 1) makes each learner's update
    raise. After max_deliveries (5) failures on it, the 6th learner dead-letters it as poison and
    trains the good entry behind it, which no failure counted against."""
    from worldloop.common.transport.admission import Admission

    cfg = _cfg(redis_url)
    keys = Keys(NS)
    adm = Admission(redis_url, keys, max_staleness=2, batch_size=4)
    assert adm.admit(["poison-0"], actor_version=0).admitted
    adm.settle("poison-0")
    prod = StreamProducer(redis_url, keys.scored, 100)
    for tid in ("poison-0", "good-0"):
        prod.add(encode_trajectory(_traj(codec, tid)))
    prod.close()
    v = _Versions()
    for life in range(1, MAX_DELIVERIES + 1):
        src = _source(cfg, codec, v)
        src.recover()
        assert [it.trajectory_id for it in src.collect(1, lambda: False)] == ["poison-0"], life
        assert src.blame() == 1  # the update on it raised: blamed, then the process exits
        src.close()
    last = _source(cfg, codec, v)
    last.recover()
    items = last.collect(1, lambda: False)
    assert [it.trajectory_id for it in items] == ["good-0"]
    last.mark_trained(items)
    r = connect(redis_url)
    (rec,) = [decode_deadletter(f[b"data"]) for _, f in r.xrange(keys.deadletter)]
    assert "trajectory poison-0 was read 6 times: 5 learner processes failed deciding or training it" in rec.reason
    assert f"max_deliveries={MAX_DELIVERIES}" in rec.reason
    assert read_stats(r, keys)["deadletter_scored_poison"] == 1 and adm.state()["refunded"] == 1
    assert list(_delivery_counts(redis_url).values()) == [1]  # good-0: read once, never struck
    last.close()
    adm.close()


def test_only_failures_of_the_entries_making_are_theirs() -> None:
    """What Learner.step blames: an error deciding or training (a bad tensor, a bug on this data), never
    Redis, the lease, host or CUDA memory, the disk, or a stop."""
    import redis
    import torch

    from worldloop.common.transport.lease import LeaseLost
    from worldloop.common.transport.redis_link import RedisUnreachable
    from worldloop.learner.data import entries_fault

    assert entries_fault(ValueError("a trajectory's tensors do not line up"))
    assert entries_fault(RuntimeError("index out of range in self"))
    for machine in (redis.exceptions.ConnectionError("gone"), RedisUnreachable("gone"), MemoryError(),
                    OSError(28, "No space left on device"), torch.OutOfMemoryError("CUDA out of memory")):
        assert not entries_fault(machine), machine
    assert not entries_fault(LeaseLost("taken"))  # a Fenced: the lease, not the data
    assert not entries_fault(KeyboardInterrupt())
