"""Stream entries under faults (issue 31, items 4, 6, 8 and 12): counters and dead letters that a
retry after a lost reply must not double, poison entries capped by their delivery count, admission
budget given back for whatever is dead-lettered, the message size limit and the trimmed dead-letter
stream. A real redis-server throughout; lost replies come from a real TCP relay (lossy_proxy)."""

from __future__ import annotations

import pytest

from lossy_proxy import LossyProxy
from worldloop.common.transport.control import read_stats
from worldloop.common.contracts.keys import Keys
from worldloop.common.contracts.schemas import decode_deadletter
from worldloop.common.transport.stream_consumer import ACK_LUA, DEADLETTER_LUA
from worldloop.common.transport.streams import StreamConsumer, StreamProducer, connect


@pytest.fixture
def proxy(redis_server):
    p = LossyProxy(redis_server.port)
    yield p
    p.close()


def _consumer(url: str, keys: Keys, **kw) -> StreamConsumer:
    return StreamConsumer(url, keys.scored, "learner", "learner-0", deadletter_stream=keys.deadletter,
                          stats_key=keys.stats, block_ms=50, reconnect_max_s=0.05, **kw)


# --------------------------------------------------------------------------- item 8: lost replies


def test_a_counted_ack_whose_reply_is_lost_counts_once(redis_url, proxy) -> None:
    keys = Keys("lostack")
    r = connect(redis_url)
    StreamProducer(redis_url, keys.scored, 10).add(b"a")
    cons = _consumer(proxy.url(), keys)
    (m,) = cons.read(1)
    # the script already loaded, as on a live Redis: else the request that loses its reply is an
    # EVALSHA answered NOSCRIPT, which ran nothing, and no executed ack would lose its reply
    r.script_load(ACK_LUA)
    proxy.lose_reply_to(m.id.encode())
    # the ack ran on Redis and its reply was lost; the retry finds the entry no longer pending, so
    # the call reports 0 acked by itself, and the counter still counts the first run once
    assert cons.ack([m.id], counters={m.id: "learner_dropped_stale"}) == 0
    assert proxy.lost == 1  # the reply was lost and the call was retried
    assert read_stats(r, keys) == {"learner_dropped_stale": 1}
    assert r.xlen(keys.scored) == 0
    cons.close()


def test_a_dead_letter_whose_reply_is_lost_is_recorded_and_counted_once(redis_url, proxy) -> None:
    keys = Keys("lostdead")
    r = connect(redis_url)
    StreamProducer(redis_url, keys.scored, 10).add(b"a")
    cons = _consumer(proxy.url(), keys)
    (m,) = cons.read(1)
    r.script_load(DEADLETTER_LUA)  # loaded, so the request whose reply is lost ran (see above)
    proxy.lose_reply_to(m.id.encode())
    cons.deadletter(m, "unusable", kind="unusable")
    assert proxy.lost == 1
    assert r.xlen(keys.deadletter) == 1
    assert read_stats(r, keys) == {cons.deadletter_counter("unusable"): 1}
    cons.close()


# --------------------------------------------------------------------------- item 12: size, trimming


def test_an_oversized_payload_is_dead_lettered_at_decode_with_its_head_kept(redis_url) -> None:
    keys = Keys("big")
    r = connect(redis_url)
    prod = StreamProducer(redis_url, keys.scored, 10)
    prod.add(b"x" * 200_000)
    prod.add(b"small")
    cons = _consumer(redis_url, keys, max_message_bytes=100_000)
    got = cons.read(2)
    assert [m.payload for m in got] == [b"small"]
    (rec,) = [decode_deadletter(f[b"data"]) for _, f in r.xrange(keys.deadletter)]
    assert "200000 bytes" in rec.reason and "100000" in rec.reason
    assert rec.payload == b"x" * 65536
    assert read_stats(r, keys) == {cons.deadletter_counter("too_large"): 1}
    cons.close()


def test_the_dead_letter_stream_is_trimmed(redis_url) -> None:
    keys = Keys("trim")
    r = connect(redis_url)
    prod = StreamProducer(redis_url, keys.scored, 10_000)
    for _ in range(1000):
        prod.add(b"\xc1 not msgpack")
    cons = _consumer(redis_url, keys, decode=lambda b: __import__("msgspec").msgpack.decode(b), deadletter_maxlen=100)
    while r.xlen(keys.scored):
        assert cons.read(256) == []
    assert read_stats(r, keys) == {cons.deadletter_counter("decode_error"): 1000}
    assert 100 <= r.xlen(keys.deadletter) < 300  # MAXLEN ~ trims whole nodes of 100 entries
    cons.close()


# --------------------------------------------------------------------------- items 4, 6: poison entries


def _admitted(url: str, keys: Keys, tids: list[str]):
    from worldloop.common.transport.admission import Admission

    adm = Admission(url, keys, max_staleness=4, batch_size=4)
    assert adm.admit(tids, actor_version=0).admitted
    for t in tids:
        adm.settle(t)
    return adm


def test_an_entry_delivered_more_than_max_deliveries_is_dead_lettered_and_refunded(redis_url) -> None:
    """Consumers that take an entry and never ack it (each died, or gave up on it) hand it on with
    its attempt count; past ``max_deliveries`` attempts it goes to the dead-letter stream as ``poison``
    instead of to the next victim, and its admission budget comes back."""
    from worldloop.common.contracts.schemas import decode_trajectory, encode_trajectory
    from worldloop.testing.trajectories import make_trajectory

    keys = Keys("poison")
    r = connect(redis_url)
    adm = _admitted(redis_url, keys, ["p1"])
    StreamProducer(redis_url, keys.rollouts, 10).add(encode_trajectory(make_trajectory("p1")))
    judges = [StreamConsumer(redis_url, keys.rollouts, "judges", name, decode=decode_trajectory,
                             deadletter_stream=keys.deadletter, stats_key=keys.stats, block_ms=10, claim_idle_ms=0,
                             max_deliveries=3, on_deadletter=adm.refund_payload) for name in ("a", "b")]
    seen, refused = [], 0
    for i in range(12):  # a consumer's claim scan resumes after what it last claimed: some reads find nothing
        for m in judges[i % 2].read(1, block_ms=10):
            if judges[i % 2].attempt(m):
                seen.append(m.deliveries)  # ... and the consumer dies (or gives up) without acking
            else:
                refused += 1
    assert seen == [1, 2, 3] and refused == 1  # the 4th attempt is refused
    assert judges[1].read(1, block_ms=10) == [] and judges[0].read(1, block_ms=10) == []
    (rec,) = [decode_deadletter(f[b"data"]) for _, f in r.xrange(keys.deadletter)]
    assert "attempted 3 times" in rec.reason and "max_deliveries=3" in rec.reason
    assert read_stats(r, keys) == {judges[0].deadletter_counter("poison"): 1}
    assert r.xlen(keys.rollouts) == 0
    assert adm.state()["refunded"] == 1 and adm.state()["admitted"] == 0
    for c in (*judges, adm):
        c.close()


def test_every_dead_letter_of_a_judge_gives_the_admission_budget_back(redis_url) -> None:
    """Item 6: an entry the consumer dead-letters at decode (too large here) refunds the trajectory
    it names, once, and an entry that names none refunds nothing."""
    from worldloop.common.contracts.schemas import decode_trajectory, encode_trajectory
    from worldloop.testing.trajectories import make_trajectory

    keys = Keys("refund")
    adm = _admitted(redis_url, keys, ["big1", "ok1"])
    prod = StreamProducer(redis_url, keys.rollouts, 10)
    prod.add(encode_trajectory(make_trajectory("big1")))
    prod.add(b"\xc1 not msgpack at all")
    small = len(encode_trajectory(make_trajectory("ok1")))
    cons = StreamConsumer(redis_url, keys.rollouts, "judges", "j", block_ms=10, deadletter_stream=keys.deadletter,
                          decode=decode_trajectory, max_message_bytes=small - 1, on_deadletter=adm.refund_payload)
    assert cons.read(5) == []
    assert connect(redis_url).xlen(keys.deadletter) == 2
    assert adm.state()["refunded"] == 1  # big1's; the garbage names no trajectory
    assert adm.release(["ok1"], refund=False) == 1  # ok1 still admitted, untouched
    cons.close()
    adm.close()
