"""One learner per namespace (issue 31, item 7): the learner lease with its fencing token
(common/lease.py) on a real redis-server, and a second `worldloop learner` process refused."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from procs import ROOT, Child
from worldloop.bootstrap.tiny_model import make_tiny_model
from worldloop.common.keys import Keys
from worldloop.common.lease import LearnerLease, LeaseHeld, LeaseLost
from worldloop.common.redis_link import Fenced
from worldloop.common.streams import StreamConsumer, StreamProducer, connect

HOLDER = textwrap.dedent('''
    import sys, time
    from worldloop.common.keys import Keys
    from worldloop.common.lease import LearnerLease
    LearnerLease(sys.argv[1], Keys(sys.argv[2]), 30.0, holder="the first learner").acquire()
    print("held", flush=True)
    time.sleep(600)
''')


def _hold_in_child(url: str, ns: str) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", HOLDER, url, ns], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    return child


def test_a_second_learner_is_refused_naming_the_holder_and_a_dead_ones_lease_is_taken_over(redis_url) -> None:
    keys = Keys("lease1")
    child = _hold_in_child(redis_url, keys.ns)
    try:
        with pytest.raises(LeaseHeld, match="namespace 'lease1' already has a learner") as e:
            LearnerLease(redis_url, keys, 30.0, holder="a second learner").acquire()
        assert "the first learner" in str(e.value) and f"pid {child.pid}" in str(e.value)
        assert "lease1" in str(e.value)
        child.kill()  # kill -9: nothing handed the lease back
        child.wait()
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
    from worldloop.common.redis_local import LocalRedis

    keys = Keys("lease3")
    with LocalRedis() as srv:
        a = LearnerLease(srv.url, keys, 30.0, holder="A", reconnect_max_s=0.1).acquire()
        srv.restart()  # no persistence: the lease and the owner key are gone
        assert a.renew() is True and not a.lost.is_set()
        assert connect(srv.url).hget(keys.learner_lease, "token").decode() == a.token
        a.close()


def test_a_second_learner_process_refuses_to_start(redis_url, tmp_path: Path) -> None:
    keys = Keys("lease4")
    holder = _hold_in_child(redis_url, keys.ns)
    conf = tmp_path / "learner.yaml"
    model = make_tiny_model(tmp_path / "model")  # a model the learner could start from, were the namespace free
    conf.write_text(yaml.safe_dump({"redis": {"url": redis_url, "namespace": keys.ns}, "metrics": {"enabled": False},
                                    "model": {"path": str(model)}, "run": {"run_dir": str(tmp_path / "run")}}))
    try:
        child = Child(["learner", "--config", str(conf)], tmp_path / "learner.log")
        rc = child.wait(120)
        out = child.output(None)
        assert rc == 2, out[-3000:]
        assert "already has a learner: the first learner" in out and f"pid {holder.pid}" in out
        assert not (tmp_path / "run").exists()  # it wrote nothing
    finally:
        holder.kill()
