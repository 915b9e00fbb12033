"""Redis key names of a run (a contract: every process on every machine derives the same names).

Every key of a run is ``{<namespace>}:<what>``:

    {ns}:rollouts     stream  actor -> judge          (trajectory messages)
    {ns}:scored       stream  judge (or actor) -> learner
    {ns}:deadletter   stream  messages that failed to decode or validate, with the reason
    {ns}:control      hash    policy_version, max_turns, run_state, weights_host, updated_at
    {ns}:procs        hash    "<role>:<id>" -> JSON {host, pid, metrics_url, seen_at}
    {ns}:stats        hash    counter name -> int (judge failures, fallbacks, learner drops; see stats_incr)
    {ns}:judge:forwarded  zset  trajectory ids forwarded to scored (exactly-once dedup)
    {ns}:admission[:leases|:ids|:expired]  the rollout admission budget (common/transport/admission.py)
    {ns}:learner:lease|owner|epoch  one learner per namespace, with a fencing token (common/transport/lease.py)
    {ns}:learner:inflight  set  scored entry ids the learner is processing (a crash strikes only these)

The braces are a Redis Cluster hash tag: only ``<namespace>`` is hashed, so every key of a run
lives in one slot, on one node, and the multi-key scripts and transactions (fencing, admission,
the judge's forward) are legal on a cluster (a script whose keys span slots fails with
CROSSSLOT). One run is therefore served by one primary; several namespaces spread over the
cluster. A namespace may not contain ``{`` or ``}`` (the tag would end early).

Before issue 38 the keys were ``<namespace>:<what>`` (no braces): :meth:`Keys.legacy` maps each
current name to that old one, and :mod:`worldloop.common.transport.key_migration` renames a run's old keys
on a single Redis when a role starts (docs/operations.md "Key names").
"""

from __future__ import annotations

from dataclasses import dataclass

ROLLOUTS_GROUP = "judges"
SCORED_GROUP = "learner"


@dataclass(frozen=True)
class Keys:
    ns: str

    def __post_init__(self) -> None:
        if not self.ns or "{" in self.ns or "}" in self.ns:
            raise ValueError(f"redis.namespace must be non-empty and hold no braces (the keys' cluster hash tag "
                             f"is {{namespace}}), got {self.ns!r}")

    @property
    def tag(self) -> str:
        """``{<ns>}``: the prefix of every key; its hash tag puts all of them in one cluster slot."""
        return "{" + self.ns + "}"

    def names(self) -> dict[str, str]:
        """Every key of the run by attribute name (what :meth:`legacy` and the migration walk)."""
        return {name: getattr(self, name) for name in KEY_NAMES}

    def legacy(self) -> dict[str, str]:
        """Current key name -> the name the same key had before the hash tag (``<ns>:<what>``)."""
        return {key: self.ns + key[len(self.tag):] for key in self.names().values()}

    @property
    def rollouts(self) -> str:
        return f"{self.tag}:rollouts"

    @property
    def scored(self) -> str:
        return f"{self.tag}:scored"

    @property
    def deadletter(self) -> str:
        return f"{self.tag}:deadletter"

    @property
    def control(self) -> str:
        return f"{self.tag}:control"

    @property
    def procs(self) -> str:
        return f"{self.tag}:procs"

    @property
    def stats(self) -> str:
        return f"{self.tag}:stats"

    @property
    def admission(self) -> str:
        """Hash of the run's admission budget (``common/transport/admission.py``): admitted, expired, refunded."""
        return f"{self.tag}:admission"

    @property
    def admission_leases(self) -> str:
        return f"{self.tag}:admission:leases"

    @property
    def admission_ids(self) -> str:
        return f"{self.tag}:admission:ids"

    @property
    def admission_expired(self) -> str:
        """Set of admitted ids whose lease ran out before they reached the stream."""
        return f"{self.tag}:admission:expired"

    @property
    def learner_lease(self) -> str:
        """Hash: the learner lease (common/transport/lease.py): token and holder; expires unless renewed."""
        return f"{self.tag}:learner:lease"

    @property
    def learner_owner(self) -> str:
        """The fencing token of the learner that last took the lease (the fenced scripts compare it)."""
        return f"{self.tag}:learner:owner"

    @property
    def learner_epoch(self) -> str:
        """Counter: each learner lease token starts with its next value."""
        return f"{self.tag}:learner:epoch"

    @property
    def judge_forwarded(self) -> str:
        """Sorted set of trajectory ids the judges already forwarded to ``scored`` (score: time)."""
        return f"{self.tag}:judge:forwarded"

    @property
    def learner_inflight(self) -> str:
        """Set of the ``scored`` entry ids the learner is processing right now (deciding or training):
        the only ones a crash counts a delivery against (``StreamConsumer(inflight_key=...)``)."""
        return f"{self.tag}:learner:inflight"


KEY_NAMES = ("rollouts", "scored", "deadletter", "control", "procs", "stats", "admission", "admission_leases",
             "admission_ids", "admission_expired", "learner_lease", "learner_owner", "learner_epoch", "judge_forwarded",
             "learner_inflight")

RUN_STATES = ("running", "paused", "stopped")
