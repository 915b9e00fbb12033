"""The Redis link under faults (issue 31, items 1-3): links shared between threads while Redis is
killed, writes Redis refuses (OOM, MISCONF, READONLY, NOPERM), and a Redis restarted without
persistence in the middle of a consumer's calls. Every test runs a real redis-server."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import redis
from redis.exceptions import RedisError

from worldloop.common.keys import ROLLOUTS_GROUP, Keys
from worldloop.common.redis_link import RedisLink
from worldloop.common.redis_local import LocalRedis
from worldloop.common.streams import FORWARDED, Forwarder, StreamConsumer, StreamProducer, connect


def test_threads_sharing_one_forwarder_survive_redis_kills_and_forward_each_entry_once() -> None:
    """Eight threads share one consumer and one Forwarder (as a judge's I/O pool does) while Redis is
    killed with kill -9 and restarted three times: no exception other than Redis's own may escape
    (a reset that closed the pool under the other threads gave ValueError / AttributeError), and
    every entry reaches ``scored`` exactly once."""
    keys, n = Keys("threads"), 400
    with LocalRedis(persist=True) as srv:
        prod = StreamProducer(srv.url, keys.rollouts, max_backlog=10_000, reconnect_max_s=0.2)
        for i in range(n):
            prod.add(b"%d" % i)
        stop = threading.Event()
        cons = StreamConsumer(srv.url, keys.rollouts, ROLLOUTS_GROUP, "j", block_ms=100, claim_idle_ms=2000,
                              reconnect_max_s=0.2, socket_timeout_s=2.0)
        fw = Forwarder(srv.url, keys.rollouts, ROLLOUTS_GROUP, keys.scored, keys.judge_forwarded, max_backlog=10_000,
                       dedup_window_s=600, reconnect_max_s=0.2, socket_timeout_s=2.0)
        escaped: list[BaseException] = []
        forwarded = Counter()

        def work() -> None:
            while not stop.is_set():
                try:
                    for m in cons.read(2, block_ms=50):
                        if fw.forward(m.id, m.payload, m.payload.decode()) == FORWARDED:
                            forwarded[m.payload] += 1
                except RedisError:  # a Redis error is the retry layer's to report, not a crash
                    continue
                except BaseException as e:  # noqa: BLE001 - the finding: anything else escaped
                    escaped.append(e)

        threads = [threading.Thread(target=work, daemon=True) for _ in range(8)]
        for t in threads:
            t.start()
        r = connect(srv.url)
        for _ in range(3):
            time.sleep(0.4)
            srv.stop(kill=True)
            time.sleep(0.3)
            srv.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and sum(forwarded.values()) < n:
            time.sleep(0.1)
        stop.set()
        for t in threads:
            t.join(30)
        assert not escaped, [f"{type(e).__name__}: {e}" for e in escaped[:5]]
        scored = Counter(f[b"data"] for _, f in r.xrange(keys.scored))
        assert len(scored) == n and max(scored.values()) == 1
        assert sum(forwarded.values()) == n
        for c in (prod, cons, fw):
            c.close()
