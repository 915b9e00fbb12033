"""One learner per namespace (issue 31, item 7): the learner lease with its fencing token
(common/transport/lease.py) on a real redis-server, and a second `worldloop learner` process refused."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from procs import Child, wait_for
from worldloop.common.contracts.keys import Keys
from worldloop.common.transport.lease import LearnerLease, LeaseHeld, LeaseLost
from worldloop.common.transport.redis_link import Fenced
from worldloop.common.transport.streams import StreamConsumer, StreamProducer, connect
from worldloop.bootstrap.tiny_model import make_tiny_model

HOLDER = textwrap.dedent('''
    import sys, time
    from worldloop.common.contracts.keys import Keys
    from worldloop.common.transport.lease import LearnerLease
    LearnerLease(sys.argv[1], Keys(sys.argv[2]), 30.0, holder="the first learner").acquire()
    print("held", flush=True)
    time.sleep(600)
''')


def _hold_in_child(url: str, ns: str, log: Path) -> Child:
    child = Child.script(HOLDER, [url, ns], log)
    wait_for(lambda: "held" in child.output(None).split(), "the holder process to take the learner lease", 120, [child])
    return child


def test_a_second_learner_is_refused_naming_the_holder_and_a_dead_ones_lease_is_taken_over(redis_url, tmp_path) -> None:
    keys = Keys("lease1")
    child = _hold_in_child(redis_url, keys.ns, tmp_path / "holder.log")
    try:
        with pytest.raises(LeaseHeld, match="namespace 'lease1' already has a learner") as e:
            LearnerLease(redis_url, keys, 30.0, holder="a second learner").acquire()
        assert "the first learner" in str(e.value) and f"pid {child.pid}" in str(e.value)
        assert "lease1" in str(e.value)
        child.kill()  # kill -9 (and reaped): nothing handed the lease back
        lease = LearnerLease(redis_url, keys, 30.0, holder="its restart").acquire()  # at once, no TTL wait
        assert lease.token.split("-")[0] == "2"  # the token's epoch grew
        assert connect(redis_url).get(keys.learner_owner).decode() == lease.token
        lease.close()
        assert not connect(redis_url).exists(keys.learner_lease)  # a clean stop hands it back
    finally:
        child.kill()


def test_a_learner_whose_lease_was_taken_over_writes_nothing_more(redis_url) -> None:
    """Learner A stalls past the TTL (its lease expires) and learner B takes the namespace: every
    write of A (acks, dead letters, the control record, its files) is refused from then on."""
    keys = Keys("lease2")
    r = connect(redis_url)
    lost = []
    a = LearnerLease(redis_url, keys, 30.0, holder="A", on_lost=lambda: lost.append(1)).acquire()
    prod = StreamProducer(redis_url, keys.scored, 10)
    for p in (b"x", b"y"):
        prod.add(p)
    cons_a = StreamConsumer(redis_url, keys.scored, "learner", "learner-0", block_ms=10, fence=a.fence,
                            deadletter_stream=keys.deadletter)
    m1, m2 = cons_a.read(2)
    r.delete(keys.learner_lease)  # A's lease ran out (A was stopped, or cut off from Redis)
    a.info["host"] = "elsewhere"  # (B must not see A's pid as a dead same-host holder)
    b = LearnerLease(redis_url, keys, 30.0, holder="B").acquire()
    with pytest.raises(Fenced, match="another learner holds this namespace now"):
        cons_a.ack([m1.id])
    with pytest.raises(Fenced, match="another learner holds this namespace now"):
        cons_a.deadletter(m2, "x")
    with pytest.raises(Fenced, match="another learner holds this namespace now"):
        a.hset(keys.control, {"policy_version": 99})
    assert r.xpending(keys.scored, "learner")["pending"] == 2 and not r.exists(keys.control)
    assert a.renew() is False and a.lost.is_set() and lost == [1]
    with pytest.raises(LeaseLost, match="another learner took namespace 'lease2'"):
        a.check()
    b.check()  # B is the owner
    a.close()
    assert r.hget(keys.learner_lease, "token").decode() == b.token  # A's close released nothing of B's
    b.close()
    cons_a.close()


def test_a_lease_that_expired_while_redis_was_away_is_taken_back_when_nobody_took_it() -> None:
    from worldloop.common.transport.redis_local import LocalRedis

    keys = Keys("lease3")
    with LocalRedis() as srv:
        a = LearnerLease(srv.url, keys, 30.0, holder="A", reconnect_max_s=0.1).acquire()
        srv.restart()  # no persistence: the lease and the owner key are gone
        assert a.renew() is True and not a.lost.is_set()
        assert connect(srv.url).hget(keys.learner_lease, "token").decode() == a.token
        a.close()


def test_a_second_learner_process_refuses_to_start(redis_url, tmp_path: Path, shared_tiny_model) -> None:
    keys = Keys("lease4")
    holder = _hold_in_child(redis_url, keys.ns, tmp_path / "holder.log")
    conf = tmp_path / "learner.yaml"
    model = shared_tiny_model()  # a model the learner could start from, were the namespace free
    conf.write_text(yaml.safe_dump({"redis": {"url": redis_url, "namespace": keys.ns}, "metrics": {"enabled": False},
                                    "model": {"path": str(model)}, "run": {"run_dir": str(tmp_path / "run")}}))
    try:
        child = Child(["learner", "--config", str(conf)], tmp_path / "learner.log")
        rc = child.wait(300)  # a liveness bound: its imports alone take minutes on a loaded 2-core machine
        out = child.output(None)
        assert rc == 2, out[-3000:]
        assert "already has a learner: the first learner" in out and f"pid {holder.pid}" in out
        assert not (tmp_path / "run").exists()  # it wrote nothing
    finally:
        holder.kill()


@pytest.mark.slow
@pytest.mark.timeout(600)  # its waits: 300 s for the learner to start, 30 for the expiry, 120 for its exit
def test_a_running_learner_whose_lease_expired_and_was_taken_stops_with_exit_3(redis_url, tmp_path: Path) -> None:
    """A real `worldloop learner` (lease_ttl_s 3) is frozen (SIGSTOP) until Redis expires its lease
    by the TTL; another learner takes the namespace; thawed, its renewal thread finds the lease
    gone and the learner stops with exit status 3 (it used to exit 0 when it had nothing to
    checkpoint), writing nothing."""
    import os
    import signal

    from procs import wait_for
    from worldloop.common.contracts.config import to_dict
    from worldloop.testing.learner import tiny_learner_config

    keys = Keys("lease5")
    r = connect(redis_url)
    model = make_tiny_model(tmp_path / "model", max_image_side=112)
    cfg = tiny_learner_config(model, redis_url, tmp_path / "run", namespace=keys.ns, lease_ttl_s=3.0)
    conf = tmp_path / "learner.yaml"
    conf.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    child = Child(["learner", "--config", str(conf)], tmp_path / "learner.log")
    b = None
    try:
        wait_for(lambda: r.hget(keys.learner_lease, "pid") == str(child.pid).encode() and r.hexists(keys.control, "policy_version"),
                 "the learner to hold the lease and publish version 0", 300, [child])
        os.kill(child.pid, signal.SIGSTOP)
        wait_for(lambda: not r.exists(keys.learner_lease), "Redis to expire the frozen learner's lease", 30)
        b = LearnerLease(redis_url, keys, 30.0, holder="B").acquire()
        os.kill(child.pid, signal.SIGCONT)
        rc = child.wait(120)
        out = child.output(None)
        assert rc == 3, out[-3000:]
        assert "learner lease of lease5 lost" in out and "stopped: the learner lease of namespace 'lease5'" in out
        assert not list((tmp_path / "run" / "checkpoints").glob("step_*"))
        assert r.hget(keys.learner_lease, "token").decode() == b.token  # B's lease untouched
    finally:
        child.kill()
        if b is not None:
            b.close()


def test_after_a_redis_restart_without_persistence_the_holder_is_not_fenced() -> None:
    """Issue 38, finding 5: Redis restarted without persistence loses the lease and the owner key.
    The fenced scripts compared the missing owner with the learner's token and failed (FENCED: the
    learner exited 3), while check() accepted it. Now both accept it and the first fenced write sets
    the owner back; a learner that takes the namespace afterwards still fences the old one."""
    from worldloop.common.transport.redis_local import LocalRedis

    keys = Keys("lease5")
    with LocalRedis() as srv:
        a = LearnerLease(srv.url, keys, 30.0, holder="A", reconnect_max_s=0.1).acquire()
        cons = StreamConsumer(srv.url, keys.scored, "learner", "learner-0", block_ms=10, fence=a.fence,
                              deadletter_stream=keys.deadletter, reconnect_max_s=0.1)
        srv.restart()  # no persistence: the lease, the owner key and the stream are gone
        r = connect(srv.url)
        assert not r.exists(keys.learner_owner) and not r.exists(keys.learner_lease)
        a.check()  # the file check accepts a missing owner...
        a.hset(keys.control, {"policy_version": 7})  # ...and so does every fenced script now
        assert r.get(keys.learner_owner).decode() == a.token  # the write re-claimed the owner key
        prod = StreamProducer(srv.url, keys.scored, 10)
        prod.add(b"x")
        prod.add(b"y")
        m1, m2 = cons.read(2)
        r.delete(keys.learner_owner)  # lost again (a second restart): the ack and dead letter re-claim it
        assert cons.ack([m1.id]) == 1
        assert r.get(keys.learner_owner).decode() == a.token
        r.delete(keys.learner_owner)
        cons.deadletter(m2, "unusable")
        assert r.xlen(keys.deadletter) == 1 and r.hget(keys.control, "policy_version") == b"7"
        assert a.renew() is True and r.hget(keys.learner_lease, "token").decode() == a.token
        # another learner that takes the namespace (A's lease ran out) fences A as before
        r.delete(keys.learner_lease)
        a.info["host"] = "elsewhere"
        b = LearnerLease(srv.url, keys, 30.0, holder="B", reconnect_max_s=0.1).acquire()
        prod.add(b"z")
        (m3,) = cons.read(1)
        with pytest.raises(Fenced, match="FENCED another learner holds this namespace now"):
            cons.ack([m3.id])
        with pytest.raises(LeaseLost, match="another learner took namespace 'lease5'"):
            a.check()
        for c in (prod, cons, b, a):
            c.close()
