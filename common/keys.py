"""Redis key names of a run (a contract: every process on every machine derives the same names).

Every key of a run is ``<namespace>:<what>``:

    <ns>:rollouts     stream  actor -> judge          (trajectory messages)
    <ns>:scored       stream  judge (or actor) -> learner
    <ns>:deadletter   stream  messages that failed to decode or validate, with the reason
    <ns>:control      hash    policy_version, max_turns, run_state, weights_host, updated_at
    <ns>:procs        hash    "<role>:<id>" -> JSON {host, pid, metrics_url, seen_at}
    <ns>:stats        hash    counter name -> int (judge failures, fallbacks, learner drops; see stats_incr)
    <ns>:judge:forwarded  zset  trajectory ids forwarded to scored (exactly-once dedup)
    <ns>:admission[:leases|:ids|:expired]  the rollout admission budget (common/admission.py)
    <ns>:learner:lease|owner|epoch  one learner per namespace, with a fencing token (common/lease.py)
    <ns>:learner:inflight  set  scored entry ids the learner is processing (a crash strikes only these)
"""

from __future__ import annotations

from dataclasses import dataclass

ROLLOUTS_GROUP = "judges"
SCORED_GROUP = "learner"


@dataclass(frozen=True)
class Keys:
    ns: str

    @property
    def rollouts(self) -> str:
        return f"{self.ns}:rollouts"

    @property
    def scored(self) -> str:
        return f"{self.ns}:scored"

    @property
    def deadletter(self) -> str:
        return f"{self.ns}:deadletter"

    @property
    def control(self) -> str:
        return f"{self.ns}:control"

    @property
    def procs(self) -> str:
        return f"{self.ns}:procs"

    @property
    def stats(self) -> str:
        return f"{self.ns}:stats"

    @property
    def admission(self) -> str:
        """Hash of the run's admission budget (``common/admission.py``): admitted, expired, refunded."""
        return f"{self.ns}:admission"

    @property
    def admission_leases(self) -> str:
        return f"{self.ns}:admission:leases"

    @property
    def admission_ids(self) -> str:
        return f"{self.ns}:admission:ids"

    @property
    def admission_expired(self) -> str:
        """Set of admitted ids whose lease ran out before they reached the stream."""
        return f"{self.ns}:admission:expired"

    @property
    def learner_lease(self) -> str:
        """Hash: the learner lease (common/lease.py): token and holder; expires unless renewed."""
        return f"{self.ns}:learner:lease"

    @property
    def learner_owner(self) -> str:
        """The fencing token of the learner that last took the lease (the fenced scripts compare it)."""
        return f"{self.ns}:learner:owner"

    @property
    def learner_epoch(self) -> str:
        """Counter: each learner lease token starts with its next value."""
        return f"{self.ns}:learner:epoch"

    @property
    def judge_forwarded(self) -> str:
        """Sorted set of trajectory ids the judges already forwarded to ``scored`` (score: time)."""
        return f"{self.ns}:judge:forwarded"

    @property
    def learner_inflight(self) -> str:
        """Set of the ``scored`` entry ids the learner is processing right now (deciding or training):
        the only ones a crash counts a delivery against (``StreamConsumer(inflight_key=...)``)."""
        return f"{self.ns}:learner:inflight"


RUN_STATES = ("running", "paused", "stopped")
