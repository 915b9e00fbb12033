"""Rollout admission (common/transport/admission.py) against a real redis-server: the (v + s + 1) * B bound,
leases that give the budget back when an actor dies, exactly-once refunds."""

from __future__ import annotations

import time

from worldloop.common.transport.admission import Admission
from worldloop.common.transport.control import write_control
from worldloop.common.contracts.keys import Keys
from worldloop.common.transport.streams import connect


def _adm(url: str, ns: str, **kw) -> Admission:
    opts = dict(max_staleness=1, batch_size=2, lease_s=60.0)
    opts.update(kw)
    return Admission(url, Keys(ns), **opts)


def test_the_budget_is_v_plus_s_plus_one_batches(redis_url: str) -> None:
    a = _adm(redis_url, "b1")  # s = 1, B = 2: (0 + 1 + 1) * 2 = 4 at version 0
    assert a.admit(["t1", "t2"], actor_version=0).admitted
    d = a.admit(["t3", "t4"], actor_version=0)
    assert d.admitted and (d.total, d.limit) == (4, 4)
    d = a.admit(["t5"], actor_version=0)
    assert not d.admitted and (d.total, d.limit) == (4, 4)
    r = connect(redis_url)
    write_control(r, Keys("b1"), policy_version=1)
    # the actor still holds v0: admitted as of its own weights
    assert not a.admit(["t5"], actor_version=0).admitted
    d = a.admit(["t5", "t6"], actor_version=1)  # (1 + 1 + 1) * 2 = 6
    assert d.admitted and (d.total, d.limit) == (6, 6)
    # a group is admitted whole only when it fits (issue 31: a group admitted while any budget was
    # left passed the bound by its size - 1, and its last members arrived stale) ...
    write_control(r, Keys("b1"), policy_version=2)  # limit 8: 2 left, 2 admitted and untrained
    assert not a.admit(["g1", "g2", "g3"], actor_version=2).admitted
    d = a.admit(["g1", "g2"], actor_version=2)
    assert d.admitted and (d.total, d.limit) == (8, 8)
    assert not a.admit(["g4"], actor_version=2).admitted  # nothing left
    # ... except while fewer than a batch are admitted and untrained: the learner waits for a batch
    # that no fitting group can complete (a member refunded, a group larger than the budget left)
    a.release(["g2"], refund=True)  # 7 admitted, v2 * B = 4 trained: 3 untrained, not starving
    assert not a.admit(["h1", "h2"], actor_version=2).admitted
    write_control(r, Keys("b1"), policy_version=3)  # limit 10; 6 trained: 1 untrained < B = 2
    d = a.admit(["h1", "h2", "h3", "h4"], actor_version=3)
    assert d.admitted and (d.total, d.limit) == (11, 10)  # passes the bound by at most its size - 1
    assert a.state()["admitted"] == 11 and a.state()["leases"] == 11  # g2 gave its lease back


def test_the_learners_bound_wins_over_the_actors_config(redis_url: str) -> None:
    a = _adm(redis_url, "b2", max_staleness=4, batch_size=8)  # the actor's own config: 40
    write_control(connect(redis_url), Keys("b2"), policy_version=0, max_staleness=0, train_batch_size=1)
    assert a.admit(["t1"], actor_version=0).admitted
    d = a.admit(["t2"], actor_version=0)
    assert not d.admitted and d.limit == 1  # synchronous: one batch of one per version


def test_an_expired_lease_gives_its_budget_back_and_a_late_arrival_counts_again(redis_url: str) -> None:
    a = _adm(redis_url, "b3", max_staleness=0, batch_size=2, lease_s=10.0)
    t = time.time()  # explicit clock: the leases' expiry is tested without sleeping
    assert a.admit(["t1", "t2"], actor_version=0, now=t).admitted
    assert not a.admit(["t3"], actor_version=0, now=t + 1).admitted
    a.renew(["t1", "t2"], now=t + 8)  # the actor renews while its episodes run: held until t + 18
    assert not a.admit(["t3"], actor_version=0, now=t + 15).admitted
    a.settle("t1")  # t1 reached the stream: its lease ends, its budget stays spent
    # t2's actor died after the renewal: nothing renews it, its lease runs out at t + 18
    d = a.admit(["t3"], actor_version=0, now=t + 19)
    assert d.admitted and d.total == 2
    st = a.state()
    assert st["expired"] == 1 and st["admitted"] == 2
    # t2 arrives after all (its actor was only paused): counted again, the bound holds
    a.settle("t2")
    assert a.state()["admitted"] == 3


def test_refunds_happen_once_and_trained_ids_refund_nothing(redis_url: str) -> None:
    a = _adm(redis_url, "b4")
    assert a.admit(["t1", "t2", "t3"], actor_version=0).admitted
    for t in ("t1", "t2", "t3"):
        a.settle(t)
    assert a.release(["t1"], refund=False) == 1  # trained: retired, budget stays spent
    assert a.release(["t1"], refund=True) == 0  # a duplicate of a trained trajectory refunds nothing
    assert a.release(["t2"], refund=True) == 1  # dead-lettered: given back
    assert a.release(["t2"], refund=True) == 0  # a restarted learner decides it again: no second refund
    st = a.state()
    assert st["admitted"] == 2 and st["refunded"] == 1
    assert a.admit(["t4"], actor_version=0).admitted  # in flight: holds a lease
    a.reset()  # a fresh learner forgets the earlier run but not the episodes in flight
    assert a.state() == {"admitted": 1, "leases": 1}
    a.settle("t4")
    assert a.release(["t4"], refund=True) == 1 and a.state()["admitted"] == 0


def test_a_settle_after_the_learner_trained_the_trajectory_counts_nothing(redis_url: str) -> None:
    """Over a slow actor link the judge and the learner score and train a trajectory before its
    actor's settle arrives: that settle must not count it again (each one leaked a slot, and the
    run stalled once the leaks filled the budget)."""
    a = _adm(redis_url, "b5", max_staleness=0, batch_size=2, lease_s=10.0)
    t = time.time()
    assert a.admit(["t1", "t2"], actor_version=0, now=t).admitted
    assert a.release(["t1"], refund=False) == 1  # trained and retired while t1's settle is on the wire
    a.settle("t1")
    assert a.state()["admitted"] == 2  # not 3
    assert a.release(["t2"], refund=True) == 1  # refunded (e.g. dead-lettered) before its settle
    a.settle("t2")
    assert a.state()["admitted"] == 1 and a.state()["leases"] == 0
    # a lease that expired, then the learner trained the late trajectory before its settle: counted
    # again once (by the retire), and the settle after it adds nothing
    assert a.admit(["t3"], actor_version=0, now=t).admitted
    assert a.admit(["t4"], actor_version=0, now=t + 11).admitted  # reaps t3 (and nothing else leased)
    assert a.state()["expired"] == 1 and a.state()["admitted"] == 2
    assert a.release(["t3"], refund=False) == 0
    assert a.state()["admitted"] == 3
    a.settle("t3")
    assert a.state()["admitted"] == 3
    # an expired one that the learner refunds: its budget went back at expiry, nothing more is
    # given back, and its settle after that counts nothing
    write_control(connect(redis_url), Keys("b5"), policy_version=5)  # limit (5 + 0 + 1) * 2 = 12
    assert a.admit(["t5"], actor_version=5, now=t + 11).admitted
    assert a.admit(["t6"], actor_version=5, now=t + 22).admitted  # reaps t4 and t5
    assert a.state()["expired"] == 3 and a.state()["admitted"] == 3
    assert a.release(["t5"], refund=True) == 0
    a.settle("t5")
    assert a.state()["admitted"] == 3 and a.state()["refunded"] == 1


def test_leases_run_on_redis_clock_not_on_a_skewed_actor_clock(redis_url: str, monkeypatch) -> None:
    """Issue 31, item 12: an actor whose machine's clock is an hour behind admits and renews
    episodes; another process's admission call reaps expired leases. On the actor's clock those
    leases expired an hour ago, and another actor took their budget while they ran. By Redis's
    clock they hold for actor.admission_lease_s."""
    import worldloop.common.transport.admission as admission_module

    skewed = _adm(redis_url, "skew", max_staleness=0, batch_size=2)
    other = _adm(redis_url, "skew", max_staleness=0, batch_size=2)
    real = time.time
    with monkeypatch.context() as m:
        m.setattr(admission_module, "time", type("Clock", (), {"time": staticmethod(lambda: real() - 3600)}),
                  raising=False)
        assert skewed.admit(["t1", "t2"], actor_version=0).admitted
        skewed.renew(["t1", "t2"])
    assert not other.admit(["t3"], actor_version=0).admitted  # the budget is still held
    st = other.state()
    assert st.get("expired", 0) == 0 and st["leases"] == 2
    (_, expiry), = connect(redis_url).zrange(Keys("skew").admission_leases, 0, 0, withscores=True)
    assert abs(expiry - (real() + 60.0)) < 30  # Redis's now (the same host here) + lease_s


def test_a_fresh_learner_counts_what_its_actors_pushed_before_it_was_up(redis_url: str) -> None:
    """Issue 31: `worldloop up` (and the chaos soak) start the actors with the learner, which is up
    a minute later. The reset of a fresh learner forgot what they had pushed by then, although it
    was trained all the same: the count stayed short by those for the whole run (every one a slot
    over the bound) and a fifth of the soak arrived stale. Now the trajectories in the streams
    count, beside the episodes in flight; what vanished (an earlier run's, lost with a Redis without
    persistence) is forgotten."""
    from worldloop.common.contracts.schemas import encode_trajectory
    from worldloop.testing.trajectories import make_trajectory

    keys = Keys("fresh")
    a = _adm(redis_url, "fresh", max_staleness=4, batch_size=4)
    assert a.admit(["r1", "r2", "s1", "gone", "fly"], actor_version=0).admitted
    r = connect(redis_url)
    for tid, stream in (("r1", keys.rollouts), ("r2", keys.rollouts), ("s1", keys.scored), ("s1", keys.scored)):
        r.xadd(stream, {b"data": encode_trajectory(make_trajectory(tid))})
    r.xadd(keys.scored, {b"data": b"\xc1 not a trajectory"})
    for tid in ("r1", "r2", "s1", "gone"):
        a.settle(tid)
    assert a.reset((keys.rollouts, keys.scored)) == 4  # fly (in flight) + r1, r2, s1 (s1 twice counts once)
    assert a.state()["admitted"] == 4
    assert a.release(["gone"], refund=True) == 0  # forgotten: nothing to give back
    assert a.release(["s1"], refund=True) == 1  # counted again: its refund gives back one slot


def test_a_resumed_learner_recounts_what_a_redis_crash_lost(redis_url: str) -> None:
    """A crash of Redis itself loses up to a second of writes (`appendfsync everysec`), admissions
    included: the count falls short of what was admitted, and every admission lost that way was a
    slot over the bound for the rest of the run (the chaos soak's host crashes: 14 % stale after).
    The learner resumed at version v recounts: v x batch trained, the episodes in flight and the
    trajectories in the streams (its own trained-but-unacked entries among them)."""
    from worldloop.common.contracts.schemas import encode_trajectory
    from worldloop.testing.trajectories import make_trajectory

    keys = Keys("resumed")
    a = _adm(redis_url, "resumed", max_staleness=1, batch_size=2)
    r = connect(redis_url)
    write_control(r, keys, policy_version=5)  # limit (5 + 1 + 1) * 2 = 14
    # 12 trajectories trained by v5 (admitted earlier), then 2 pushed and 1 in flight: 15 in truth ...
    r.hset(keys.admission, "admitted", 3)  # ... but the crash kept a count of 3
    assert a.admit(["fly"], actor_version=5).admitted
    for tid in ("p1", "p2"):
        r.xadd(keys.scored, {b"data": encode_trajectory(make_trajectory(tid))})
    # the short count admits far past the bound: 10 more slots than there are
    assert a.admit(["x1", "x2"], actor_version=5).admitted
    r.zrem(keys.admission_leases, "x1", "x2")  # (forget them: the test is about the recount)
    assert a.reset((keys.rollouts, keys.scored), version=5) == 3  # fly + p1, p2
    st = a.state()
    assert st["admitted"] == 5 * 2 + 3 and st.get("refunded", 0) == 0
    d = a.admit(["y1"], actor_version=5)  # 13 + 1 = 14: the last slot
    assert d.admitted and (d.total, d.limit) == (14, 14)
    assert not a.admit(["y2"], actor_version=5).admitted
    # a fresh learner (version 0) counts nothing trained
    assert a.reset((keys.rollouts, keys.scored)) == 4 and a.state()["admitted"] == 4  # fly, y1 + p1, p2
