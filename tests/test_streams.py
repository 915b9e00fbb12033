"""The Redis-stream transport against a real redis-server (fixture on a free port).

Consumers that get SIGKILLed run as subprocesses of a small script; every wait
is a poll on state with a generous deadline, never a timed assertion.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import msgpack
import pytest
import redis
from prometheus_client import REGISTRY

from worldloop.common.transport.redis_local import LocalRedis, find_redis_server
from worldloop.common.contracts.schemas import decode_deadletter, decode_trajectory, encode_trajectory, packb, unpackb
from worldloop.common.transport.streams import StreamConsumer, StreamProducer, connect
from worldloop.testing.trajectories import make_trajectory
from procs import exit_code, wait_for

ROOT = Path(__file__).resolve().parent.parent


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


# --------------------------------------------------------------------------- group with a killed consumer

WORKER = textwrap.dedent('''
    import sys, time
    from worldloop.common.transport.streams import StreamConsumer
    from worldloop.common.contracts.schemas import unpackb
    import redis
    url, stream, name, hang_after, total = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    r = redis.Redis.from_url(url)
    c = StreamConsumer(url, stream, "g", name, decode=unpackb, block_ms=200, claim_idle_ms=1500)
    done = 0
    while r.scard("processed") < total:
        msgs = c.read(10)
        if hang_after and done >= hang_after and msgs:
            r.set("hanging:" + name, len(msgs))
            time.sleep(3600)  # holds its batch pending until SIGKILLed
        for m in msgs:
            # the "durable work": record the id, then ack
            r.hincrby("process_count", str(m.value["i"]), 1)
            r.sadd("processed", m.value["i"])
            if m.reclaimed:
                r.incr("reclaimed:" + name)
        c.ack([m.id for m in msgs])
        done += len(msgs)
    r.set("finished:" + name, done)
''')


def _spawn(script: Path, url: str, stream: str, name: str, hang_after: int, total: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with open(script.parent / f"{name}.log", "wb") as log:
        return subprocess.Popen([sys.executable, str(script), url, stream, name, str(hang_after), str(total)],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def test_two_consumers_one_killed_nothing_lost_nothing_twice(redis_url: str, tmp_path: Path) -> None:
    total, stream = 1000, "t:rollouts"
    r = redis.Redis.from_url(redis_url)
    prod = StreamProducer(redis_url, stream, max_backlog=total)
    for i in range(total):
        prod.add(packb({"i": i}))
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    victim = _spawn(script, redis_url, stream, "victim", hang_after=50, total=total)
    survivor = None
    def progress() -> str:
        return (f"processed {r.scard('processed')} of {total}, pending {r.xpending(stream, 'g')['pending']}, "
                f"keys {sorted(k.decode() for k in r.keys('*:*'))}")

    try:
        wait_for(lambda: victim.poll() is not None or r.get("hanging:victim") is not None,
                 "the victim to hang with pending entries", 120, extra=progress)
        assert victim.poll() is None, (tmp_path / "victim.log").read_text(errors="replace")[-4000:]
        held = int(r.get("hanging:victim"))
        pending = {c["name"]: c["pending"] for c in r.xpending(stream, "g")["consumers"]}
        assert pending.get(b"victim") == held > 0
        # the survivor starts only now, so nobody can reclaim the victim's batch before the check above
        survivor = _spawn(script, redis_url, stream, "survivor", hang_after=0, total=total)
        victim.send_signal(signal.SIGKILL)
        assert exit_code(victim, 60, "the SIGKILLed victim", tmp_path / "victim.log") == -signal.SIGKILL
        rc = exit_code(survivor, 240, f"the survivor to process all {total} messages ({progress()})",
                       tmp_path / "survivor.log")
        assert rc == 0, (tmp_path / "survivor.log").read_text(errors="replace")[-4000:]
    finally:
        for p in (victim, survivor):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    counts = {int(k): int(v) for k, v in r.hgetall("process_count").items()}
    assert set(counts) == set(range(total)), "a message was lost"
    assert set(counts.values()) == {1}, "a message was processed twice"
    assert int(r.get("reclaimed:survivor")) == held  # exactly the victim's batch was reclaimed
    assert r.xlen(stream) == 0  # ack deletes: nothing left, nothing pending
    assert r.xpending(stream, "g")["pending"] == 0


# --------------------------------------------------------------------------- dead letters


def test_poison_messages_go_to_deadletter_and_good_ones_flow(redis_url: str) -> None:
    stream, dead = "t:rollouts", "t:deadletter"
    r = connect(redis_url)
    consumer = StreamConsumer(redis_url, stream, "judges", "j1", decode=decode_trajectory, deadletter_stream=dead)
    # the counters belong to this process, which other tests share: what this test adds is the change
    dead_before = {k: sample("worldloop_stream_deadletter_messages_total", stream=stream, reason=k)
                   for k in ("decode_error", "missing_data")}
    good1 = encode_trajectory(make_trajectory("good-1"))
    not_msgpack = b"\xc1\xc1 definitely not msgpack"
    wrong_schema = msgpack.packb({"schema": "other/1", "x": 1})
    good2 = encode_trajectory(make_trajectory("good-2"))
    for payload in (good1, not_msgpack, wrong_schema, good2):
        r.xadd(stream, {b"data": payload})
    no_data_id = r.xadd(stream, {b"other": b"field"}).decode()

    got = consumer.read(10)
    assert [m.value.trajectory_id for m in got] == ["good-1", "good-2"]
    assert all(not m.reclaimed for m in got)
    consumer.ack([m.id for m in got])

    letters = [decode_deadletter(f[b"data"]) for _, f in r.xrange(dead)]
    assert [d.payload for d in letters[:2]] == [not_msgpack, wrong_schema]
    assert "not valid msgpack" in letters[0].reason
    assert "schema" in letters[1].reason and "other/1" in letters[1].reason
    assert "no 'data' field" in letters[2].reason and letters[2].source_id == no_data_id
    assert unpackb(letters[2].payload) == {"other": b"field"}
    assert {d.source_stream for d in letters} == {stream} and {d.consumer for d in letters} == {"j1"}
    assert r.xlen(stream) == 0 and r.xpending(stream, "judges")["pending"] == 0
    dead_added = {k: sample("worldloop_stream_deadletter_messages_total", stream=stream, reason=k) - v
                  for k, v in dead_before.items()}
    assert dead_added == {"decode_error": 2, "missing_data": 1}  # not msgpack + wrong schema; the entry with no data

    # a caller that finds a message unusable later dead-letters it explicitly
    r.xadd(stream, {b"data": good1})
    (msg,) = consumer.read(1)
    consumer.deadletter(msg, "learner: policy version from the future")
    last = decode_deadletter(r.xrevrange(dead, count=1)[0][1][b"data"])
    assert last.reason == "learner: policy version from the future" and last.payload == good1
    assert r.xlen(stream) == 0
    consumer.close()


def test_entry_deleted_while_pending_is_skipped(redis_url: str) -> None:
    stream = "t:s"
    r = connect(redis_url)
    a = StreamConsumer(redis_url, stream, "g", "a", claim_idle_ms=0, block_ms=100)
    ids = [r.xadd(stream, {b"data": b"%d" % i}).decode() for i in range(3)]
    assert len(a.read(3)) == 3  # now pending on "a"
    r.xdel(stream, ids[1])
    b = StreamConsumer(redis_url, stream, "g", "b", claim_idle_ms=0, block_ms=100)
    got = b.read(3)
    assert [m.payload for m in got] == [b"0", b"2"] and all(m.reclaimed for m in got)
    b.ack([m.id for m in got])
    assert r.xpending(stream, "g")["pending"] == 0


# --------------------------------------------------------------------------- backpressure


def test_producer_blocks_at_backlog_and_resumes_when_drained(redis_url: str) -> None:
    stream, limit, n = "t:bp", 5, 8
    prod = StreamProducer(redis_url, stream, max_backlog=limit)
    cons = StreamConsumer(redis_url, stream, "g", "c", block_ms=100)
    added: list[int] = []

    def produce() -> None:
        for i in range(n):
            prod.add(b"%d" % i)
            added.append(i)

    blocked_s_before = sample("worldloop_stream_backpressure_seconds_total", stream=stream)
    t = threading.Thread(target=produce, daemon=True)
    t.start()
    blocked = lambda: sample("worldloop_stream_backpressure_blocked", stream=stream) == 1.0  # noqa: E731
    wait_for(blocked, "the producer to block at the backlog limit", 120, extra=lambda: f"added {added}")
    assert added == list(range(limit)) and t.is_alive()
    assert connect(redis_url).xlen(stream) == limit
    with pytest.raises(TimeoutError, match="stayed at its backlog limit 5"):  # a second producer with a timeout gives up, adding nothing
        StreamProducer(redis_url, stream, max_backlog=limit).add(b"late", timeout=0.05)

    first = cons.read(3)  # delivered entries no longer count: the producer resumes
    wait_for(lambda: not t.is_alive(), "the producer to add the rest once 3 entries were delivered", 120,
             extra=lambda: f"added {added}, stream length {connect(redis_url).xlen(stream)}")
    assert connect(redis_url).xlen(stream) == n  # the 3 delivered entries are still there, pending
    cons.ack([m.id for m in first])
    assert not t.is_alive() and added == list(range(n))
    rest = cons.read(10)
    assert [m.payload for m in first + rest] == [b"%d" % i for i in range(n)]
    assert sample("worldloop_stream_backpressure_blocked", stream=stream) == 0.0
    assert sample("worldloop_stream_backpressure_seconds_total", stream=stream) > blocked_s_before


# --------------------------------------------------------------------------- restarts


@pytest.mark.parametrize("persist", [True, False], ids=["aof", "no-persistence"])
def test_redis_restart_mid_stream(persist: bool) -> None:
    """With AOF every added entry survives; without, the group is recreated (NOGROUP) and new entries flow."""
    stream, half = "t:restart", 100
    with LocalRedis(persist=persist) as srv:
        prod = StreamProducer(srv.url, stream, max_backlog=1000, reconnect_max_s=0.2)
        cons = StreamConsumer(srv.url, stream, "g", "c", block_ms=200, reconnect_max_s=0.2)
        got: list[int] = []
        stop = threading.Event()

        def consume() -> None:
            while not stop.is_set():
                msgs = cons.read(20)
                got.extend(int(m.payload) for m in msgs)
                cons.ack([m.id for m in msgs])

        t = threading.Thread(target=consume, daemon=True)
        t.start()
        before = sample("worldloop_stream_reconnects_total", stream=stream)
        for i in range(half):
            prod.add(b"%d" % i)
        if not persist:  # entries still in Redis at the restart would be lost: let the consumer drain first
            wait_for(lambda: len(set(got)) == half, "the consumer to take the first half", 120,
                     extra=lambda: f"consumed {len(set(got))} of {half}")
        srv.restart()
        for i in range(half, 2 * half):
            prod.add(b"%d" % i)
        wait_for(lambda: set(got) >= set(range(2 * half)), "every entry after the restart", 120,
                 extra=lambda: f"missing {sorted(set(range(2 * half)) - set(got))[:20]}")
        stop.set()
        wait_for(lambda: not t.is_alive(), "the consumer thread to stop", 60)
        assert set(got) == set(range(2 * half))
        assert sample("worldloop_stream_reconnects_total", stream=stream) > before
        prod.close()
        cons.close()


# --------------------------------------------------------------------------- URLs and auth


def test_password_and_acl_urls() -> None:
    with LocalRedis(password="s3cret") as srv:
        with pytest.raises(redis.AuthenticationError, match="(?i)authenticat"):
            connect(f"redis://127.0.0.1:{srv.port}/0").ping()
        with pytest.raises(redis.AuthenticationError, match="invalid username-password pair"):
            connect(f"redis://:wrong@127.0.0.1:{srv.port}/0").ping()
        acl_url = f"redis://default:s3cret@127.0.0.1:{srv.port}/0"
        assert connect(acl_url).ping()
        prod = StreamProducer(srv.url, "t:auth", max_backlog=10)
        cons = StreamConsumer(acl_url, "t:auth", "g", "c", block_ms=100)
        prod.add(b"hello", fields={"kind": "greeting"})
        (m,) = cons.read(5)
        assert m.payload == b"hello"
        assert cons.ack([m.id]) == 1


def test_password_from_the_environment_for_a_url_without_one(monkeypatch) -> None:
    with LocalRedis(password="s3cret") as srv:
        plain = f"redis://127.0.0.1:{srv.port}/0"
        monkeypatch.setenv("WORLDLOOP_REDIS_PASSWORD", "s3cret")
        assert connect(plain).ping()
        prod = StreamProducer(plain, "t:envauth", max_backlog=10)  # through the reconnecting link too
        prod.add(b"hi")
        assert [m.payload for m in StreamConsumer(plain, "t:envauth", "g", "c", block_ms=100).read(1)] == [b"hi"]
        with pytest.raises(redis.AuthenticationError, match="invalid username-password pair"):  # a password in the URL wins over the environment
            connect(f"redis://:wrong@127.0.0.1:{srv.port}/0").ping()
        monkeypatch.setenv("WORLDLOOP_REDIS_PASSWORD", "")  # empty: no password
        with pytest.raises(redis.AuthenticationError, match="(?i)authenticat"):
            connect(plain).ping()


def test_unix_socket_url(tmp_path: Path) -> None:
    sock = tmp_path / "redis.sock"
    proc = subprocess.Popen([find_redis_server(), "--port", "0", "--unixsocket", str(sock), "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    try:
        wait_for(sock.exists, "redis-server to create its unix socket", 60, extra=lambda: f"exit code {proc.poll()}")
        url = f"unix://{sock}?db=0"
        wait_for(lambda: _pings(url), "redis on the unix socket to answer PING", 60)
        StreamProducer(url, "t:unix", max_backlog=10).add(b"x")
        assert [m.payload for m in StreamConsumer(url, "t:unix", "g", "c", block_ms=100).read(1)] == [b"x"]
    finally:
        proc.terminate()
        proc.wait(10)


def _pings(url: str) -> bool:
    try:
        return bool(connect(url).ping())
    except redis.ConnectionError:
        return False


def test_rediss_url_uses_tls_and_bad_scheme_is_rejected() -> None:
    client = connect("rediss://:pw@example.invalid:6380/0")  # no I/O until the first command
    kwargs = client.connection_pool.connection_kwargs
    assert client.connection_pool.connection_class is redis.SSLConnection
    assert kwargs["password"] == "pw" and kwargs["port"] == 6380
    with pytest.raises(ValueError, match="redis://"):
        connect("http://127.0.0.1:6379")


def test_bad_arguments_are_refused(redis_url: str) -> None:
    with pytest.raises(ValueError, match="max_backlog must be >= 1, got 0"):
        StreamProducer(redis_url, "t:x", max_backlog=0)
    prod = StreamProducer(redis_url, "t:x", max_backlog=10)
    with pytest.raises(TypeError, match="payload must be bytes, got str"):
        prod.add("text, not bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="data"):
        prod.add(b"x", fields={"data": b"y"})
    assert connect(redis_url).xlen("t:x") == 0


def test_local_redis_with_a_relative_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # redis-server changes into --dir before opening --logfile: a relative path must not break it
    monkeypatch.chdir(tmp_path)
    srv = LocalRedis(data_dir="runs/x/redis").start()
    try:
        assert connect(srv.url).ping()
        assert (tmp_path / "runs" / "x" / "redis" / "redis.log").exists()
    finally:
        srv.close()
