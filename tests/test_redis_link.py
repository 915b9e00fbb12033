"""The Redis link under faults (issue 31, items 1-3): links shared between threads while Redis is
killed, writes Redis refuses (OOM, MISCONF, READONLY, NOPERM), and a Redis restarted without
persistence in the middle of a consumer's calls. Every test runs a real redis-server."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from collections import Counter

import pytest
import redis
from redis.exceptions import RedisError

from worldloop.common.contracts.keys import ROLLOUTS_GROUP, Keys
from worldloop.common.transport.redis_local import LocalRedis
from worldloop.common.transport.streams import FORWARDED, Forwarder, StreamConsumer, StreamProducer, connect
from procs import wait_for


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
        wait_for(lambda: escaped or sum(forwarded.values()) >= n, f"all {n} entries forwarded after 3 kills", 120,
                 extra=lambda: f"forwarded {sum(forwarded.values())}, escaped {escaped[:3]}")
        stop.set()
        wait_for(lambda: not any(t.is_alive() for t in threads), "the 8 worker threads to stop", 60,
                 extra=lambda: f"{sum(t.is_alive() for t in threads)} still running")
        assert not escaped, [f"{type(e).__name__}: {e}" for e in escaped[:5]]
        scored = Counter(f[b"data"] for _, f in r.xrange(keys.scored))
        assert len(scored) == n and max(scored.values()) == 1
        assert sum(forwarded.values()) == n
        for c in (prod, cons, fw):
            c.close()


# --------------------------------------------------------------------------- refused writes


def _refuse(srv: LocalRedis, r: redis.Redis, kind: str, tmp_path) -> tuple:
    """Make the real server refuse writes of ``kind``; returns (url to use, undo())."""
    if kind == "OOM":
        r.config_set("maxmemory", 1)
        return srv.url, lambda: r.config_set("maxmemory", 0)
    if kind == "MISCONF":  # a background save that fails: the server's folder vanished under it
        # (CONFIG SET dir is a protected config from Redis 7 on, so the folder it runs in is removed:
        # its log stays open, and a background save can no longer create its file there)
        folder = Path(srv.data_dir)
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()
        r.config_set("stop-writes-on-bgsave-error", "yes")
        r.config_set("save", "3600 1")  # MISCONF needs save points
        r.bgsave()

        def failed() -> bool:
            info = r.info("persistence")
            return info["rdb_last_bgsave_status"] == "err" and not info["rdb_bgsave_in_progress"]

        wait_for(failed, "the background save to fail (MISCONF)", 60,
                 extra=lambda: {k: v for k, v in r.info("persistence").items() if k.startswith("rdb_")})

        def undo() -> None:  # what an operator does once the disk is back: let writes through again
            folder.mkdir()  # (for the LocalRedis clean-up)
            r.config_set("stop-writes-on-bgsave-error", "no")
        return srv.url, undo
    if kind == "READONLY":  # a replica of a primary that is not there
        r.replicaof("127.0.0.1", 1)
        return srv.url, lambda: r.replicaof("NO", "ONE")
    assert kind == "NOPERM"  # an ACL user that may read but not write, given the right later
    r.acl_setuser("w", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-@write"])
    return f"redis://w:pw@127.0.0.1:{srv.port}/0", lambda: r.acl_setuser("w", commands=["+@all"])


@pytest.mark.parametrize("kind", ["OOM", "MISCONF", "READONLY", "NOPERM"])
def test_a_refused_write_waits_with_a_log_line_and_a_metric_then_goes_through(kind, tmp_path, caplog) -> None:
    from prometheus_client import REGISTRY

    stream = f"refused-{kind}"
    with LocalRedis() as srv:
        r = connect(srv.url)
        url, undo = _refuse(srv, r, kind, tmp_path)
        prod = StreamProducer(url, stream, max_backlog=100, reconnect_max_s=0.2)
        done: list = []

        def add() -> None:
            try:
                done.append(prod.add(b"x"))
            except BaseException as e:  # noqa: BLE001 - the finding: the write crashed its caller
                done.append(e)

        t = threading.Thread(target=add, daemon=True)
        metric = lambda: REGISTRY.get_sample_value(  # noqa: E731
            "worldloop_stream_refused_writes_total", {"stream": stream, "reason": kind}) or 0
        before = metric()  # the counter belongs to the process: this test's part is the change
        with caplog.at_level("WARNING", logger="worldloop.common.transport.redis_link"):
            t.start()
            wait_for(lambda: done or metric() - before >= 2, f"the {kind}-refused write to be tried twice", 60,
                     extra=lambda: f"refused writes counted {metric() - before}")
            assert not done, f"the refused write ended its caller: {done}"
            assert metric() - before >= 2
            assert any(f"redis refused a write ({kind}" in rec.getMessage() for rec in caplog.records)
            undo()
            wait_for(lambda: not t.is_alive(), f"the write to go through once {kind} is undone", 60,
                     extra=lambda: f"refused writes counted {metric() - before}, done {done}")
        assert done and not isinstance(done[0], BaseException), done
        assert r.xlen(stream) == 1
        prod.close()


def test_a_judges_final_stats_flush_never_hides_the_error_that_ended_it(redis_url) -> None:
    """``_flush_stats`` runs in the judge's ``finally``: a refused write there must not raise (it would
    replace the error that ended the judge); the counts stay unsent and go out with a later flush."""
    from types import SimpleNamespace

    from worldloop.common.contracts.config import load_config
    from worldloop.common.transport.control import read_stats
    from worldloop.judge.process import JudgeWorker

    cfg = load_config(None, [f"redis.url={redis_url}", "redis.namespace=flush", "metrics.enabled=false"])
    worker = JudgeWorker(cfg, proc_id="j")
    worker.scorer = SimpleNamespace(fallbacks=3)
    r = connect(redis_url)
    r.config_set("maxmemory", 1)
    worker._flush_stats(r)  # refused: no exception
    r.config_set("maxmemory", 0)
    assert read_stats(r, Keys("flush")) == {}
    worker._flush_stats(r)
    assert read_stats(r, Keys("flush")) == {"judge_fallbacks": 3}


# --------------------------------------------------------------------------- restarts without persistence


def test_a_connection_error_while_recreating_a_lost_group_is_retried(monkeypatch) -> None:
    """Redis restarted without persistence: the next call gets NOGROUP and the consumer recreates its
    group. A connection error at that moment (Redis gone again) used to escape the except handler."""
    with LocalRedis() as srv:
        cons = StreamConsumer(srv.url, "s", "g", "c", block_ms=50, reconnect_max_s=0.1)
        srv.restart()  # no persistence: the group is gone
        real = cons._link.on_nogroup
        calls = []

        def flaky() -> None:
            calls.append(1)
            if len(calls) == 1:
                raise redis.exceptions.ConnectionError("Redis went away again")
            real()

        monkeypatch.setattr(cons._link, "on_nogroup", flaky)
        assert cons.read(1, block_ms=50) == []
        assert len(calls) == 2
        StreamProducer(srv.url, "s", 10).add(b"y")
        assert [m.payload for m in cons.read(1, block_ms=50)] == [b"y"]
        cons.close()


def test_pruning_consumers_of_a_stream_that_no_longer_exists_is_a_no_op() -> None:
    with LocalRedis() as srv:
        cons = StreamConsumer(srv.url, "s", "g", "c", block_ms=50, reconnect_max_s=0.1)
        srv.restart()  # the key and its group are gone
        assert cons.prune_consumers(idle_ms=0) == []
        cons.close()
