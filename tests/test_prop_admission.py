"""Admission (common/transport/admission.py) as a hypothesis state machine against a Python model of its bound.

Every rule runs the real Lua script on a real redis-server and the same step on :class:`Model`,
a plain transcription of the module docstring: the budget ``(v + s + 1) * B`` with ``v`` the lower
of the learner's and the actor's version, whole groups that must fit unless fewer than a batch are
admitted and untrained, leases that expire at an explicit ``now`` (so expiry is exact), settles of
expired leases counted again, refunds at most once per id, retirements that keep the budget spent,
and a reset that keeps the leased ids and counts the trained ones. After every step the Redis state
(counters, leases, the admitted ids, the expired ids) must equal the model's, and every decision
(admitted or not, total, limit) must be the model's. The three admission leaks found by soaks
(docs/benchmarks.md) were each a step where these two disagree.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from worldloop.common.transport.admission import Admission
from worldloop.common.contracts.keys import Keys
from worldloop.common.transport.redis_local import LocalRedis

LEASE_S = 10.0
_SERVER: dict = {}
_NS = itertools.count()


class Model:
    """The admission budget as the module docstring states it, in Python."""

    def __init__(self, staleness: int, batch: int):
        self.s, self.b = staleness, batch
        self.learner_version = 0
        self.counts = {"admitted": 0, "expired": 0, "refunded": 0}
        self.leases: dict[str, float] = {}
        self.ids: set[str] = set()
        self.expired: set[str] = set()

    def _reap(self, now: float) -> None:
        for tid in [t for t, until in self.leases.items() if until <= now]:
            del self.leases[tid]
            if tid in self.ids:
                self.ids.discard(tid)
                self.counts["admitted"] -= 1
                self.counts["expired"] += 1
                self.expired.add(tid)

    def admit(self, ids: list[str], actor_version: int, now: float) -> tuple[bool, int, int]:
        self._reap(now)
        v = min(self.learner_version, actor_version)
        limit = (v + self.s + 1) * self.b
        admitted = self.counts["admitted"]
        starving = admitted < limit and admitted - self.learner_version * self.b < self.b
        if admitted + len(ids) > limit and not starving:
            return False, admitted, limit
        for tid in ids:
            if tid not in self.ids:
                self.ids.add(tid)
                self.counts["admitted"] += 1
            self.leases[tid] = now + LEASE_S
        return True, self.counts["admitted"], limit

    def renew(self, ids: list[str], now: float) -> None:
        for tid in ids:
            if tid in self.leases:
                self.leases[tid] = now + LEASE_S

    def settle(self, tid: str) -> None:
        if self.leases.pop(tid, None) is not None:
            return
        if tid in self.expired:
            self.expired.discard(tid)
            self.ids.add(tid)
            self.counts["admitted"] += 1

    def release(self, ids: list[str], refund: bool) -> int:
        n = again = 0
        for tid in ids:
            self.leases.pop(tid, None)
            if tid in self.ids:
                self.ids.discard(tid)
                n += 1
            elif tid in self.expired:  # its lease ran out: trained after all (counted again), or refunded
                self.expired.discard(tid)
                again += 0 if refund else 1
        if refund and n:
            self.counts["admitted"] -= n
            self.counts["refunded"] += n
        self.counts["admitted"] += again
        return n

    def reset(self, version: int) -> int:
        self.ids = set(self.leases)
        self.expired = set()
        self.counts = {"admitted": len(self.leases) + version * self.b, "expired": 0, "refunded": 0}
        return len(self.leases)


class AdmissionMachine(RuleBasedStateMachine):
    ids = Bundle("ids")

    @initialize(staleness=st.integers(0, 2), batch=st.integers(1, 4))
    def start(self, staleness: int, batch: int) -> None:
        self.keys = Keys(f"prop{next(_NS)}")
        self.adm = Admission(_SERVER["url"], self.keys, max_staleness=staleness, batch_size=batch, lease_s=LEASE_S)
        self.r = self.adm.link.r
        self.model = Model(staleness, batch)
        self.now = 1000.0
        self.fresh = itertools.count()

    def teardown(self) -> None:
        if hasattr(self, "adm"):
            self.adm.close()

    def _tick(self, dt: float) -> float:
        self.now += dt
        return self.now

    @rule(target=ids, n=st.integers(1, 3), lag=st.integers(0, 2), dt=st.sampled_from([0.0, 1.0, 6.0, 11.0]))
    def admit_a_group(self, n: int, lag: int, dt: float):
        group = [f"t{next(self.fresh)}" for _ in range(n)]
        now = self._tick(dt)
        actor_version = max(0, self.model.learner_version - lag)
        want = self.model.admit(group, actor_version, now)
        got = self.adm.admit(group, actor_version, now=now)
        assert (got.admitted, got.total, got.limit) == want, (group, actor_version, got, want)
        return group[0]  # one id of the group stands for it in the bundle

    @rule(tid=ids, dt=st.sampled_from([0.0, 4.0]))
    def renew(self, tid: str, dt: float) -> None:
        now = self._tick(dt)
        self.model.renew([tid], now)
        self.adm.renew([tid], now=now)

    @rule(tid=ids)
    def settle(self, tid: str) -> None:
        self.model.settle(tid)
        self.adm.settle(tid)

    @rule(tid=consumes(ids), refund=st.booleans())
    def release(self, tid: str, refund: bool) -> None:
        assert self.adm.release([tid], refund=refund) == self.model.release([tid], refund)

    @rule(tid=ids, refund=st.booleans())
    def release_again(self, tid: str, refund: bool) -> None:
        # a restarted learner deciding the same entry again, or a duplicate of a trained trajectory
        assert self.adm.release([tid, tid], refund=refund) == self.model.release([tid, tid], refund)

    @rule()
    def learner_trains_a_version(self) -> None:
        self.model.learner_version += 1
        self.r.hset(self.keys.control, "policy_version", self.model.learner_version)

    @rule()
    def learner_restarts(self) -> None:
        version = self.model.learner_version
        assert self.adm.reset((), version=version) == self.model.reset(version)

    @invariant()
    def redis_equals_the_model(self) -> None:
        if not hasattr(self, "adm"):
            return
        counts = {k.decode(): int(v) for k, v in self.r.hgetall(self.keys.admission).items()}
        # (a counter never written reads as 0)
        assert {k: v for k, v in counts.items() if v} == {k: v for k, v in self.model.counts.items() if v}
        leases = {k.decode(): float(v) for k, v in self.r.zrange(self.keys.admission_leases, 0, -1, withscores=True)}
        assert leases == pytest.approx(self.model.leases)
        assert {x.decode() for x in self.r.smembers(self.keys.admission_ids)} == self.model.ids
        assert {x.decode() for x in self.r.smembers(self.keys.admission_expired)} == self.model.expired


AdmissionMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def redis_for_the_machine():
    srv = LocalRedis().start()
    _SERVER["url"] = srv.url
    try:
        yield srv
    finally:
        srv.close()


def test_admission_follows_its_model(redis_for_the_machine) -> None:
    AdmissionMachine.TestCase("runTest").runTest()
