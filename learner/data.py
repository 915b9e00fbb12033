"""What the learner trains on: the ``scored`` stream read exactly once, and batches as tensors.

Public API::

    Unusable(ValueError)                                   # a schema-valid but untrainable trajectory
    check_usable(traj, *, vocab_size, max_len, codec) -> SequenceLayout
    oldest_version(traj) -> int
    whole_group_fraction(group_ids, size) -> float     # share of a batch's rows whose whole group is in it
    DedupWindow(max_staleness)                             # trajectory ids already trained on
    Item(entry_id, traj, layout, oldest, nbytes)
    ScoredSource(cfg, keys, *, vocab_size, codec, version_fn, dedup, consumer_name=LEARNER_CONSUMER)
        .recover() -> int          # own pending entries of a previous (killed) learner first
        .collect(n, should_stop) -> list[Item] | None
        .held_bytes, .held_count, .ack_held() -> int, .mark_trained(items, step)
    encode_batch(items) -> bytes / decode_batch(bytes) -> (stop, list[Trajectory])   # rank 0 -> other ranks

Exactly-once with kill -9
-------------------------
Every entry the learner reads stays PENDING in the ``learner`` consumer group until a checkpoint
that contains its fate is complete on disk; then it is acked (XACK + XDEL). Its fate is one of:
trained in update s; dropped as stale; dropped as a duplicate; dead-lettered (unusable; the
dead-letter stream is itself durable, so those are acked at once). A restart loads the newest
complete checkpoint and first re-reads its own pending list (the consumer name is fixed,
``learner-0``, so XPENDING for it lists exactly what the dead process held):

* an entry trained in an update the checkpoint contains (its id is in the checkpoint's trained
  set) is a duplicate of durable work: acked at once, not trained;
* an entry trained after the checkpoint (that update died with the process) or never used is
  trained again, in the lineage that continues from the checkpoint.

Acked => in a checkpoint, so nothing acked is lost; the trained set filters the rest, so nothing
is trained twice in the surviving lineage. Producers are not stalled by what the learner holds:
the backpressure of ``worldloop.common.transport.streams`` counts undelivered entries only.

How much is held: at most ``checkpoint_every`` batches of ``train_batch_size`` entries plus the
drops decided since the last checkpoint. Drops whose fate cannot change (stale even relative to
the last checkpointed version, or duplicates of checkpointed work) are acked at once. When the
payload bytes held pass ``trainer.max_pending_mb`` the learner checkpoints early (process.py),
and at start it refuses a ``max_pending_mb`` larger than half of Redis's ``maxmemory`` (when
Redis reports one). The learner's consumer does not reclaim idle entries (all of the group's
pending entries are its own, held on purpose); a restart re-reads them. An entry read by
``redis.max_deliveries`` learner processes in a row that each died before a checkpoint held its
fate is dead-lettered as ``poison`` instead of being trained again; whatever the learner
dead-letters gives its admission budget back. Only a failure *of the entry's making* counts:
``{ns}:learner:inflight`` names the entries being decided (from their read to their fate) and
the batch being trained (from :meth:`ScoredSource.collect` to :meth:`ScoredSource.trained`,
right after the update), and when deciding or training them raises an error that is not the
machine's (Redis, the lease, host or CUDA memory, the disk: ``learner.data.entries_fault``),
the learner blames them (:meth:`ScoredSource.blame`) before it exits; the next process counts
one more delivery against the blamed entries alone. A learner killed from outside (kill -9, the
OOM killer, a power loss, a supervisor's restart loop) blames nothing, and entries a dying
learner merely held come back uncounted: restarts alone never turn good data into poison. The
price: an entry that kills the process natively (a segfault in a kernel) is never counted; the
supervisor's restart limit stops that loop, and the log names the entries in flight.

Dedup window
------------
A trajectory whose oldest token was generated at version ``o`` (:func:`oldest_version`: a turn's
``token_versions`` count token by token) is dropped as stale once the
learner's version ``v`` satisfies ``v - o > max_staleness``. A second copy of it can therefore
only be trained while ``v <= o + max_staleness``; after that the staleness rule drops it before
the dedup check. So the window keeps an id only while ``o >= v - max_staleness`` — ids of the
last ``max_staleness + 1`` versions — and is pruned after every update. The checkpoint stores
the window (id -> o).

Multi-rank
----------
Rank 0 alone reads the stream, decides, acks, and sends the chosen payloads (msgpack bytes, no
pickle) to the other ranks with a broadcast; every rank then collates its own contiguous slice.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import msgspec
import redis

from worldloop.common.contracts.config import Config, ConfigError, held_group_size
from worldloop.common.transport.control import read_stats
from worldloop.common.contracts.keys import Keys, SCORED_GROUP
from worldloop.common.transport.admission import Admission
from worldloop.common.metrics import metric
from worldloop.common.contracts.modeling import ChatCodec, SequenceLayout, build_sequence
from worldloop.common.contracts.schemas import Trajectory, decode_trajectory, packb
from worldloop.common.transport.stream_consumer import consumer_limits
from worldloop.common.transport.streams import Message, RedisLink, StreamConsumer

log = logging.getLogger(__name__)

LEARNER_CONSUMER = "learner-0"
_LOGPROB_SLACK = 1e-3  # behaviour log-probs above this are not log-probabilities


class Unusable(ValueError):
    """A trajectory that passes the schema but cannot be trained on (the reason says why)."""


def oldest_version(traj: Trajectory) -> int:
    """The version of the oldest token of ``traj``: the minimum over its turns of their tokens'
    versions (a turn's ``token_versions``, else its ``policy_version``). A response sampled across a
    weight load is as stale as its oldest token."""
    return min(min(t.token_versions or (t.policy_version,)) for t in traj.turns)


def whole_group_fraction(group_ids: list[str], size: int) -> float:
    """The share of a batch's rows whose group has all ``size`` members in the batch (1.0 for an
    empty batch): what is left of GRPO's group baselines after the batch was cut."""
    if not group_ids:
        return 1.0
    members = Counter(group_ids)
    return sum(n for n in members.values() if n >= size) / len(group_ids)


def check_usable(traj: Trajectory, *, vocab_size: int, max_len: int, codec: ChatCodec) -> SequenceLayout:
    """The trajectory's token layout, or :class:`Unusable` with the reason."""
    try:
        layout = build_sequence(traj)
    except (ValueError, KeyError, TypeError) as e:
        raise Unusable(f"cannot lay out the token sequence: {e}") from None
    ids = layout.input_ids
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.numel():
        raise Unusable(f"token id(s) {bad[:5].tolist()} outside the vocabulary [0, {vocab_size})")
    if len(layout) > max_len:
        raise Unusable(f"sequence of {len(layout)} tokens is longer than model.max_model_len={max_len}")
    lp = layout.behaviour_logprobs
    if bool((lp > _LOGPROB_SLACK).any()):
        raise Unusable(f"behaviour log-prob {float(lp.max()):.4g} > 0 is not a log-probability")
    for t, turn in enumerate(traj.turns):
        v = turn.policy_version
        if v < 0:
            raise Unusable(f"turn {t}: policy_version {v} < 0")
    if codec.is_vision:
        found = int((ids == codec.image_token_id).sum())
        try:
            need = sum(codec.image_pad_count(png) for png in layout.images)
        except ValueError as e:
            raise Unusable(f"image: {e}") from None
        if found != need:
            raise Unusable(f"{found} image tokens but the {len(layout.images)} image(s) need {need}")
    return layout


class DedupWindow:
    """Trajectory id -> oldest-turn version of what was trained (see the module docstring)."""

    def __init__(self, max_staleness: int, ids: dict[str, int] | None = None):
        self.max_staleness = int(max_staleness)
        self._ids: dict[str, int] = dict(ids or {})
        self._durable: set[str] = set(self._ids)  # ids whose update is in a checkpoint

    def __contains__(self, tid: str) -> bool:
        return tid in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def is_durable(self, tid: str) -> bool:
        return tid in self._durable

    def add(self, tid: str, oldest: int) -> None:
        self._ids[tid] = int(oldest)

    def mark_durable(self) -> None:
        self._durable = set(self._ids)

    def prune(self, version: int) -> int:
        """Forget ids the staleness rule drops anyway at ``version``; return how many."""
        floor = int(version) - self.max_staleness
        old = [k for k, o in self._ids.items() if o < floor]
        for k in old:
            del self._ids[k]
            self._durable.discard(k)
        return len(old)

    def to_dict(self) -> dict[str, int]:
        return dict(self._ids)


@dataclass
class Item:
    entry_id: str
    traj: Trajectory
    layout: SequenceLayout | None
    oldest: int
    nbytes: int

    @property
    def trajectory_id(self) -> str:
        return self.traj.trajectory_id


def redis_maxmemory(r) -> int | None:
    """Redis's ``maxmemory`` in bytes (0 = unlimited), None when CONFIG GET is not allowed.
    Connection errors propagate, so that a caller's RedisLink retries instead of skipping the check."""
    try:
        raw = r.config_get("maxmemory")
    except redis.ResponseError:  # managed Redis often forbids CONFIG (NOPERM, unknown command): nothing to check
        return None
    value = raw.get("maxmemory") or raw.get(b"maxmemory")
    return int(value) if value is not None else None


def check_pending_fits(cfg: Config, r) -> None:
    """Refuse a ``max_pending_mb`` larger than half of Redis's ``maxmemory`` (when one is set)."""
    limit = redis_maxmemory(r)
    want = cfg.trainer.max_pending_mb * 2**20
    if limit and want > limit // 2:
        raise ConfigError(
            "trainer.max_pending_mb",
            f"the learner may hold {cfg.trainer.max_pending_mb} MiB of entries pending until a checkpoint, "
            f"more than half of Redis maxmemory ({limit / 2**20:.0f} MiB); lower it or trainer.checkpoint_every",
        )


class ScoredSource:
    """Rank 0's reader of the ``scored`` stream: decides each entry's fate and holds it until acked."""

    def __init__(
        self,
        cfg: Config,
        keys: Keys,
        *,
        vocab_size: int,
        codec: ChatCodec,
        version_fn: Callable[[], int],
        checkpoint_version_fn: Callable[[], int],
        dedup: DedupWindow,
        consumer_name: str = LEARNER_CONSUMER,
        fence: tuple[str, str] | None = None,
    ):
        if cfg.redis.url is None:
            raise ConfigError("redis.url", "the learner needs a Redis URL (worldloop up passes its own)")
        self.cfg = cfg
        self.keys = keys
        self.vocab_size = vocab_size
        self.codec = codec
        self.version_fn = version_fn
        self.checkpoint_version_fn = checkpoint_version_fn
        self.dedup = dedup
        self.max_staleness = cfg.trainer.max_staleness
        # the run-wide counters (fates) are read through a Redis outage, as the stream is
        self.stats_link = RedisLink(cfg.redis.url, keys.stats, cfg.redis.reconnect_max_s, cfg.redis.socket_timeout_s,
                                    startup_timeout_s=cfg.redis.startup_timeout_s)
        self.consumer = StreamConsumer(
            cfg.redis.url, keys.scored, SCORED_GROUP, consumer_name, decode=decode_trajectory,
            deadletter_stream=keys.deadletter, block_ms=min(cfg.redis.block_ms, 1000),
            claim_idle_ms=cfg.redis.claim_idle_ms, reconnect_max_s=cfg.redis.reconnect_max_s,
            socket_timeout_s=cfg.redis.socket_timeout_s, startup_timeout_s=cfg.redis.startup_timeout_s,
            stats_key=keys.stats, **consumer_limits(cfg.redis), fence=fence,  # fence: the learner lease's
            # it holds its entries pending until a checkpoint: no reclaiming them from itself (a
            # restart re-reads them: recover); whatever it dead-letters refunds its admission
            reclaim=False, on_deadletter=lambda payload: self.admission.refund_payload(payload),
            # a crash counts a delivery only against what it was deciding or training (see recover)
            inflight_key=keys.learner_inflight)
        self.max_deliveries, self.consumer_name = cfg.redis.max_deliveries, consumer_name
        # retire trained ids, refund the ones that can never be trained (common/transport/admission.py)
        self.admission = Admission(cfg.redis.url, keys, max_staleness=cfg.trainer.max_staleness,
                                   batch_size=cfg.trainer.train_batch_size, lease_s=cfg.actor.admission_lease_s,
                                   reconnect_max_s=cfg.redis.reconnect_max_s, socket_timeout_s=cfg.redis.socket_timeout_s)
        self._buffer: list[Item] = []
        self._held: dict[str, int] = {}  # entry id -> payload bytes, fate decided, not yet acked
        self._held_drops: dict[str, str] = {}  # held entry id -> why it was dropped (counted at its ack)
        self._buffered_ids: set[str] = set()
        self._buffered_tids: set[str] = set()
        self._recovered: list[Message] = []
        self.dropped: dict[str, int] = {}
        # trainer.whole_groups (grpo) and trainer.filter_groups: members of each GRPO group are held
        # here until the whole group is in (or its missing members are known to be lost), then the
        # group goes to the buffer (whole_groups: always; filter_groups: when informative) or is dropped
        self.group_size = held_group_size(cfg)
        self.filter_groups = bool(cfg.trainer.filter_groups)
        self._groups: dict[str, list[Item]] = {}
        self._group_lost: dict[str, int] = {}
        self.groups_decided = 0
        self.groups_kept = 0
        self._m_dropped = metric("worldloop_learner_dropped_trajectories")
        self._m_held = metric("worldloop_learner_pending_entries")

    # ------------------------------------------------------------------ reading

    def recover(self, page: int = 256) -> int:
        """Take back what a previous learner process held (its pending list); return how many.
        Only the entries it was deciding or training when it died count one more delivery
        (:meth:`StreamConsumer.read_own_pending`); those it merely held do not."""
        got = self.consumer.read_own_pending(page)
        self._recovered.extend(got)
        n = len(got)
        if n:
            log.info("recovered %d entries a previous learner process left pending", n)
        return n

    def collect(self, n: int, should_stop: Callable[[], bool], *, paused: Callable[[], bool] = lambda: False,
                max_wait_s: float | None = None) -> list[Item] | None:
        """Wait until ``n`` usable trajectories are buffered and return them (FIFO).

        None when ``should_stop()`` turns true; ``[]`` when ``max_wait_s`` passed first (what was
        buffered stays buffered). While ``paused()`` nothing new is read.
        """
        start = time.monotonic()
        while len(self._buffer) < n:
            self._expire_groups()
            if should_stop():
                return None
            if max_wait_s is not None and time.monotonic() - start >= max_wait_s:
                return []
            if paused():
                time.sleep(0.2)
                continue
            if self._recovered:
                msgs, self._recovered = self._recovered[: n * 2], self._recovered[n * 2 :]
            else:
                msgs = self.consumer.read(min(max(n - len(self._buffer), 1), 256))
            ids = [m.id for m in msgs]
            self.consumer.processing(ids)  # deciding them: a crash now counts against them
            for m in msgs:
                self._decide(m)
            self.consumer.processed(ids)
        out, self._buffer = self._buffer[:n], self._buffer[n:]
        for it in out:
            self._unbuffer(it)
        self.consumer.processing([it.entry_id for it in out])  # to be trained: until trained()
        return out

    def blame(self) -> int:
        """Deciding or training the entries in flight raised, and the failure is theirs: the next
        learner process counts a delivery against each (:meth:`StreamConsumer.blame`)."""
        return self.consumer.blame()

    def trained(self, items: list[Item]) -> None:
        """The update on ``items`` went through: a crash from now on counts no delivery against them
        (rank 0 calls it right after the update, before publishing and checkpointing)."""
        self.consumer.processed([it.entry_id for it in items])

    def _decide(self, m: Message) -> None:
        if m.id in self._held or m.id in self._buffered_ids:
            return  # an entry of ours seen again (its delivery was lost with a Redis restart): decided
        traj = m.value
        tid = traj.trajectory_id
        oldest = oldest_version(traj)
        item = Item(m.id, traj, None, oldest, len(m.payload))
        version = self.version_fn()
        lag = version - oldest
        if lag > self.max_staleness:
            final = self.checkpoint_version_fn() - oldest > self.max_staleness
            self._drop([item], "stale", f"lag {lag} > max_staleness {self.max_staleness} (oldest token v{oldest}, "
                       f"learner v{version}, actor {traj.actor_id}, group {traj.group_id})", final)
            self.admission.release([tid], refund=True)
            self._lose(traj.group_id)
            return
        if tid in self.dedup or tid in self._buffered_tids:
            self._drop([item], "duplicate", f"trajectory {tid} was already trained on", self.dedup.is_durable(tid))
            # retired when it was trained; again here in case Redis forgot that (a host crash cut
            # the second of the retirement off its append-only file): a no-op otherwise
            self.admission.release([tid], refund=False)
            return
        if m.deliveries > self.max_deliveries:
            # max_deliveries learner processes failed deciding or training it (blamed): a poison
            # entry, not trained again (refunded by the hook)
            self._m_dropped.labels(reason="poison").inc()
            self.consumer.deadletter(m, f"learner: trajectory {tid} was read {m.deliveries} times: {m.deliveries - 1} "
                                     "learner processes failed deciding or training it "
                                     f"(redis.max_deliveries={self.max_deliveries})", "poison")
            self._lose(traj.group_id)
            return
        try:
            item.layout = check_usable(traj, vocab_size=self.vocab_size, max_len=self.cfg.model.max_model_len,
                                       codec=self.codec)
        except Exception as e:  # Unusable, or a check that broke on it: never a crash of the learner
            self._m_dropped.labels(reason="unusable").inc()
            self.consumer.deadletter(m, f"learner: unusable trajectory {tid}: {e}", kind="unusable")
            self._lose(traj.group_id)
            return
        self._buffered_ids.add(m.id)
        self._buffered_tids.add(tid)
        if not self.group_size:
            self._buffer.append(item)
            return
        self._groups.setdefault(traj.group_id, []).append(item)
        self._settle_group(traj.group_id)

    # ------------------------------------------------------------------ whole_groups, filter_groups

    def _lose(self, group_id: str) -> None:
        """A member of ``group_id`` will never be trained (stale, unusable): stop waiting for it."""
        if self.group_size:
            self._group_lost[group_id] = self._group_lost.get(group_id, 0) + 1
            self._settle_group(group_id)

    def _settle_group(self, group_id: str) -> None:
        """Once every member of the group is in or lost: train it (whole_groups), or with
        filter_groups only if its episodes differ in task success, else drop it as
        ``uninformative`` (acked at once: the decision cannot change) and give its admission budget
        back, so that the actors play other levels in its place."""
        members = self._groups.get(group_id, [])
        if len(members) + self._group_lost.get(group_id, 0) < self.group_size:
            return
        self._groups.pop(group_id, None)
        self._group_lost.pop(group_id, None)
        if not members:
            return
        self.groups_decided += 1
        if not self.filter_groups or len({bool(it.traj.success) for it in members}) > 1:
            self.groups_kept += 1
            self._buffer.extend(members)
            return
        for it in members:
            self._unbuffer(it)
        outcome = "solved" if members[0].traj.success else "failed"
        self._drop(members, "uninformative", f"all {len(members)} episodes of group {group_id} {outcome} "
                   f"({self.groups_kept} of {self.groups_decided} groups kept so far)", True)
        self.admission.release([it.trajectory_id for it in members], refund=True)

    def _expire_groups(self) -> None:
        """Drop as stale the incomplete groups whose oldest member passed the staleness bound (a
        member that never comes, e.g. lost with a killed actor, must not hold the rest forever)."""
        if not self._groups:
            return
        version = self.version_fn()
        for gid in [g for g, ms in self._groups.items() if version - min(it.oldest for it in ms) > self.max_staleness]:
            members = self._groups.pop(gid)
            self._group_lost.pop(gid, None)
            for it in members:
                self._unbuffer(it)
                final = self.checkpoint_version_fn() - it.oldest > self.max_staleness
                self._drop([it], "stale", f"group {gid} incomplete ({len(members)} of {self.group_size}) "
                           "past max_staleness", final)
            self.admission.release([it.trajectory_id for it in members], refund=True)

    def _unbuffer(self, it: Item) -> None:
        self._buffered_ids.discard(it.entry_id)
        self._buffered_tids.discard(it.trajectory_id)

    def _drop(self, items: list[Item], reason: str, why: str, final: bool) -> None:
        """Drop entries for one reason; their run-wide counter ``learner_dropped_<reason>`` is added in
        the same script as their ack (now when ``final``, else at the next checkpoint's ack), so each
        counts once even when a restarted learner decides the same entry again."""
        n = len(items)
        self.dropped[reason] = self.dropped.get(reason, 0) + n
        self._m_dropped.labels(reason=reason).inc(n)
        for it in items:  # one line per entry: bench/chaos.py accounts for every drop from these lines
            log.info("dropping %s trajectory %s (entry %s): %s", reason, it.trajectory_id, it.entry_id, why)
        if final:
            self.consumer.ack([it.entry_id for it in items],
                              counters={it.entry_id: f"learner_dropped_{reason}" for it in items})
        else:
            for it in items:
                self._held[it.entry_id] = it.nbytes
                self._held_drops[it.entry_id] = reason
            self._m_held.set(len(self._held))

    # ------------------------------------------------------------------ fate and acks

    def mark_trained(self, items: list[Item]) -> None:
        self.trained(items)  # (done already right after the update; a no-op then)
        for it in items:
            self.dedup.add(it.trajectory_id, it.oldest)
            self._held[it.entry_id] = it.nbytes
        self._m_held.set(len(self._held))
        self.admission.release([it.trajectory_id for it in items], refund=False)

    @property
    def held_bytes(self) -> int:
        return sum(self._held.values())

    @property
    def held_count(self) -> int:
        return len(self._held)

    def ack_held(self) -> int:
        """Ack every entry whose fate a complete checkpoint now holds (call right after one)."""
        ids = list(self._held)
        n = 0
        for start in range(0, len(ids), 512):
            chunk = ids[start : start + 512]
            n += self.consumer.ack(chunk, counters={i: f"learner_dropped_{self._held_drops[i]}"
                                                    for i in chunk if i in self._held_drops})
        self._held.clear()
        self._held_drops.clear()
        self.dedup.mark_durable()
        self._m_held.set(0)
        return n

    def fates(self) -> dict[str, dict[str, int]]:
        """Run-wide, exact and cumulative (across learner restarts) counts of what never trained:
        ``dropped`` (stale, duplicate; counted once acked) and ``dead_lettered`` (by kind, for the
        scored stream), read back from ``{ns}:stats``."""
        stats = self.stats_link.call(lambda r: read_stats(r, self.keys))
        dead_prefix = self.consumer.deadletter_counter("")
        return {
            "dropped": {k[len("learner_dropped_"):]: v for k, v in stats.items() if k.startswith("learner_dropped_")},
            "dead_lettered": {k[len(dead_prefix):]: v for k, v in stats.items() if k.startswith(dead_prefix)},
        }

    def close(self) -> None:
        self.consumer.close()
        self.admission.close()
        self.stats_link.close()


# --------------------------------------------------------------------------- batches


def encode_batch(items: list[Item], *, stop: bool = False) -> bytes:
    """The payload rank 0 broadcasts: the trajectories (msgpack maps) and a stop flag."""
    return packb(_Batch(stop=bool(stop), trajectories=[it.traj for it in items]))


class _Batch(msgspec.Struct):
    stop: bool
    trajectories: list[Trajectory]


_BATCH = msgspec.msgpack.Decoder(_Batch)


def decode_batch(data: bytes) -> tuple[bool, list[Trajectory]]:
    """Rank 0's payload, decoded into structs (rank 0 validated every trajectory already)."""
    msg = _BATCH.decode(data)
    return msg.stop, msg.trajectories


def entries_fault(e: BaseException, *also_machine: type) -> bool:
    """Whether a failure while deciding or training is the entries' (a strike against each) rather than
    the machine's: Redis, memory (host or CUDA), the disk, and ``also_machine`` (the lease) are never
    the entries' fault."""
    import torch

    from worldloop.common.transport.redis_link import Fenced, RedisUnreachable, WriteRefused

    machine = (redis.exceptions.RedisError, RedisUnreachable, WriteRefused, Fenced, MemoryError, OSError,
               torch.OutOfMemoryError, *also_machine)
    return isinstance(e, Exception) and not isinstance(e, machine)
