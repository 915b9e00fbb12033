"""Reading a Redis stream through a consumer group: :class:`StreamConsumer` and the
:class:`Message` it delivers. Part of the stream transport of :mod:`worldloop.common.transport.streams`,
whose module docstring states the guarantees (ack = XACK + XDEL once the work is durable,
reclaims, dead letters, reconnects); :mod:`worldloop.common.transport.streams` re-exports both names.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import redis
from redis.exceptions import ResponseError

from worldloop.common.transport.lease import fence_lua
from worldloop.common.metrics import metric
from worldloop.common.transport.redis_link import RETRYABLE, RedisLink
from worldloop.common.contracts.schemas import deadletter_message, packb

log = logging.getLogger(__name__)

DATA_FIELD = b"data"
_MAX_REASON_CHARS = 1000


def _text(x: Any) -> str:
    return x.decode(errors="replace") if isinstance(x, (bytes, bytearray)) else str(x)


@dataclass
class Message:
    """One delivered entry: its id, the raw payload, the decoded value and whether it was reclaimed."""

    id: str
    payload: bytes
    value: Any
    reclaimed: bool
    # attempts at it so far (the group's delivery counter, XPENDING): 1 for a fresh entry; a reclaimed
    # one's count goes up when the caller attempts it (StreamConsumer.attempt)
    deliveries: int = 1


# KEYS: stream, stats hash, fence owner; ARGV: group, n, id_1 .. id_n, counter_1 .. counter_n ('' =
# none), fence token. Only an entry this call acks (XACK 1) adds to its counter: a call retried after
# its reply was lost finds its entries acked and counts nothing again.
ACK_LUA = fence_lua(3, "#ARGV") + """
local n = tonumber(ARGV[2])
local acked = 0
for i = 1, n do
  local id = ARGV[2 + i]
  if redis.call('XACK', KEYS[1], ARGV[1], id) == 1 then
    acked = acked + 1
    local c = ARGV[2 + n + i]
    if c ~= '' then redis.call('HINCRBY', KEYS[2], c, 1) end
  end
  redis.call('XDEL', KEYS[1], id)
end
return acked
"""

# KEYS: stream, dead-letter stream, stats hash, fence owner; ARGV: group, id, record, maxlen, counter
# ('' = none), data field, fence token. 1: moved; 0: the entry was no longer pending (a retry after
# a lost reply, or another consumer finished it): nothing written twice
DEADLETTER_LUA = fence_lua(4, 7) + """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', ARGV[6], ARGV[3])
redis.call('XDEL', KEYS[1], ARGV[2])
if ARGV[5] ~= '' then redis.call('HINCRBY', KEYS[3], ARGV[5], 1) end
return 1
"""

# KEYS: stream, in-flight set, blamed set; ARGV: group, consumer. Counts one more delivery (XCLAIM
# RETRYCOUNT) of each entry in the blamed set that is still pending for the consumer (its processing
# raised in the consumer's previous process), then empties both sets; returns how many were counted.
# One script: a crash between the count and the clearing cannot count twice.
STRIKE_LUA = """
local n = 0
for _, id in ipairs(redis.call('SMEMBERS', KEYS[3])) do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1, ARGV[2])
  if #p > 0 then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, id, 'RETRYCOUNT', p[1][4] + 1, 'JUSTID')
    n = n + 1
  end
end
redis.call('DEL', KEYS[2], KEYS[3])
return n
"""

# KEYS: in-flight set, blamed set. The entries in flight move to the blamed set (their processing
# raised): the next read_own_pending counts a delivery against each.
BLAME_LUA = """
redis.call('SUNIONSTORE', KEYS[2], KEYS[2], KEYS[1])
redis.call('DEL', KEYS[1])
return redis.call('SCARD', KEYS[2])
"""

# the head of an oversized payload that its dead-letter record keeps
_OVERSIZED_KEPT = 65536


def consumer_limits(redis_cfg: Any) -> dict[str, int]:
    """The StreamConsumer keywords a role takes from its ``redis`` config section."""
    return {"max_message_bytes": int(redis_cfg.max_message_mb) * 2**20, "deadletter_maxlen": int(redis_cfg.deadletter_maxlen)}


class StreamConsumer:
    """Reads one stream as ``consumer`` of ``group``; see the module docstring for the guarantees.

    * ``stats_key``: run-wide counters (a hash, e.g. Keys.stats) that dead letters and counted acks
      increment in the same script as the ack, once per entry acked.
    * ``max_message_bytes``: a larger payload is dead-lettered when read (kind ``too_large``, its
      first 64 KiB kept); ``deadletter_maxlen``: the dead-letter stream is trimmed to about this many
      records (XADD MAXLEN ~).
    * ``max_deliveries``: :meth:`attempt` dead-letters (kind ``poison``) a reclaimed entry already
      attempted this often instead of letting the caller work on it again (each consumer that took
      it died or gave up on it); :attr:`Message.deliveries` holds the count.
    * ``reclaim``: False for a consumer that holds its own pending entries on purpose (the learner:
      it re-reads them with :meth:`read_own_pending` when it restarts, and must not reclaim them from
      itself).
    * ``on_deadletter(payload)`` runs after each entry this consumer dead-lettered (an admission
      refund).
    * ``fence``: (owner key, token) of the learner lease (:mod:`worldloop.common.transport.lease`): acks and
      dead letters fail with ``Fenced`` once another learner took the namespace.
    * ``inflight_key``: a set naming the entries this consumer is processing right now
      (:meth:`processing` before, :meth:`processed` after). :meth:`read_own_pending` counts a
      delivery only against those (the process died while working on them); the others a dead
      process merely held come back uncounted, so a crash loop alone never makes good entries
      poison.
    """

    def __init__(self, url: str, stream: str, group: str, consumer: str, *,
                 decode: Callable[[bytes], Any] | None = None, deadletter_stream: str | None = None,
                 block_ms: int = 1000, claim_idle_ms: int = 60000, reconnect_max_s: float = 30.0,
                 socket_timeout_s: float = 10.0, should_stop: Callable[[], bool] | None = None,
                 startup_timeout_s: float | None = None, stats_key: str | None = None,
                 max_message_bytes: int | None = None, deadletter_maxlen: int = 10_000,
                 max_deliveries: int | None = None, reclaim: bool = True,
                 on_deadletter: Callable[[bytes], Any] | None = None, fence: tuple[str, str] | None = None,
                 inflight_key: str | None = None):
        self.stream = stream
        self.group = group
        self.stats_key = stats_key
        self.consumer = consumer
        self.decode = decode
        # default dead-letter stream: "<stream>:deadletter" (callers normally pass Keys(ns).deadletter)
        self.deadletter_stream = deadletter_stream or f"{stream}:deadletter"
        self.block_ms = block_ms
        self.claim_idle_ms = claim_idle_ms
        self.max_message_bytes = max_message_bytes
        self.deadletter_maxlen = deadletter_maxlen
        self.max_deliveries = max_deliveries
        self.reclaim = reclaim
        self.on_deadletter = on_deadletter
        self.inflight_key = inflight_key
        self._fence_key, self._fence_token = fence or (stream, "")
        # a blocking XREADGROUP must return before the socket times out
        self._link = RedisLink(url, stream, reconnect_max_s, max(socket_timeout_s, block_ms / 1000 + 5),
                               should_stop=should_stop, startup_timeout_s=startup_timeout_s)
        self._link.on_nogroup = self._create_group
        self._ack_script = self._link.register_script(ACK_LUA)
        self._deadletter_script = self._link.register_script(DEADLETTER_LUA)
        self._strike_script = self._link.register_script(STRIKE_LUA)
        self._blame_script = self._link.register_script(BLAME_LUA)
        # the entries whose processing raised (:meth:`blame`); same hash tag as inflight_key
        self.blamed_key = None if inflight_key is None else inflight_key + ":blamed"
        self._claim_cursor = "0-0"
        self._m = {
            "consumed": metric("worldloop_stream_consumed_messages").labels(stream=stream),
            "acked": metric("worldloop_stream_acked_messages").labels(stream=stream),
            "reclaimed": metric("worldloop_stream_reclaimed_messages").labels(stream=stream),
        }
        self._m_dead = metric("worldloop_stream_deadletter_messages")
        self._link.call(lambda r: self._create_group())

    def _create_group(self) -> None:
        try:
            self._link.r.xgroup_create(self.stream, self.group, id="0", mkstream=True)
            log.info("created consumer group %s on %s", self.group, self.stream)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    # ------------------------------------------------------------------ reading

    def read(self, count: int, block_ms: int | None = None) -> list[Message]:
        """Up to ``count`` messages: reclaimed idle ones first, then new ones (blocking ``block_ms``)."""
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        block = self.block_ms if block_ms is None else block_ms
        if block / 1000 + 1 > self._link.socket_timeout_s:
            raise ValueError(f"block_ms={block} is longer than the socket timeout allows")
        out = self._decode_all(*self._reclaim(count), reclaimed=True) if self.reclaim else []
        if len(out) < count:
            fresh = self._link.call(lambda r: r.xreadgroup(
                self.group, self.consumer, {self.stream: ">"}, count=count - len(out),
                block=None if out else block))
            entries = fresh[0][1] if fresh else []
            out += self._decode_all(entries, reclaimed=False)
        return out

    def read_own_pending(self, page: int = 256) -> list[Message]:
        """Every entry still pending for this consumer name (what a previous process of the same
        name read and never acked), decoded like :meth:`read`: undecodable ones go to the
        dead-letter stream, ones deleted while pending are acked and skipped.

        Reading them counts no delivery (XPENDING + XRANGE, never XREADGROUP, which would count
        one for each): only the entries :meth:`blame` named (their processing raised in the previous
        process) get one more (:data:`STRIKE_LUA`), so :attr:`Message.deliveries` is 1 plus the
        number of processes whose processing of the entry raised. A process killed from outside
        (kill -9, the OOM killer, a power loss, a restart loop) blames nothing: restarts alone never
        make good data poison. Without ``inflight_key`` nothing is counted."""
        if self.inflight_key is not None:
            struck = int(self._link.call(lambda r: self._strike_script(
                keys=[self.stream, self.inflight_key, self.blamed_key], args=[self.group, self.consumer], client=r)))
            if struck:
                log.warning("stream %s: %d entries were being processed when %s's previous process failed on them: "
                            "one more delivery counted against each", self.stream, struck, self.consumer)
        cursor, out = "-", []
        while True:
            rows = self._link.call(lambda r: r.xpending_range(self.stream, self.group, min=cursor, max="+", count=page,
                                                              consumername=self.consumer))
            if not rows:
                return out
            ids = [_text(row["message_id"]) for row in rows]
            cursor = _next_id(ids[-1])
            entries, counts = self._fetch_pending(ids)
            out += self._decode_all(entries, counts, reclaimed=True)

    def processing(self, ids: Iterable[str]) -> None:
        """Record (in ``inflight_key``) that this consumer works on ``ids`` now: should its processing
        raise before :meth:`processed` (:meth:`blame`), the next :meth:`read_own_pending` counts a
        delivery of each."""
        ids = list(ids)
        if ids and self.inflight_key is not None:
            self._link.call(lambda r: r.sadd(self.inflight_key, *ids))

    def blame(self) -> int:
        """The processing of the entries in flight raised (an exception of the entry's making, not of
        Redis, the disk or the memory): move them to the blamed set, so that the next process's
        :meth:`read_own_pending` counts a delivery against each; returns how many are blamed. A
        failure to reach Redis here is logged and blames nothing."""
        if self.inflight_key is None:
            return 0
        try:
            return int(self._link.call(lambda r: self._blame_script(keys=[self.inflight_key, self.blamed_key], client=r)))
        except Exception as e:  # noqa: BLE001 -- the process is failing already; the original error matters
            log.warning("stream %s: could not blame the entries in flight (%s)", self.stream, e)
            return 0

    def processed(self, ids: Iterable[str]) -> None:
        """The work on ``ids`` is over (done, or its outcome recorded): a crash from now on counts
        nothing against them."""
        ids = list(ids)
        if ids and self.inflight_key is not None:
            self._link.call(lambda r: r.srem(self.inflight_key, *ids))

    def touch(self, ids: list[str]) -> int:
        """Reset the idle time of entries this consumer still works on (XCLAIM to itself), so that a
        slow but live consumer is not reclaimed from; entries no longer pending for it are left
        alone. Returns how many were touched; 0 (logged) when Redis is away, never raises."""
        if not ids:
            return 0

        def run(r: redis.Redis) -> int:
            mine = {_text(row["message_id"]) for row in r.xpending_range(
                self.stream, self.group, min="-", max="+", count=len(ids) + 1000, consumername=self.consumer)}
            keep = [i for i in ids if i in mine]
            if keep:
                r.xclaim(self.stream, self.group, self.consumer, 0, keep, justid=True)
            return len(keep)

        try:
            return self._link.call(run, should_stop=lambda: True)  # one try: the next refresh retries
        except RETRYABLE as e:
            log.warning("stream %s: could not refresh %s's pending entries: %s", self.stream, self.consumer, e)
            return 0

    def _reclaim(self, count: int) -> tuple[list[tuple[bytes, dict]], dict[str, int]]:
        """Idle entries of any consumer of the group (XAUTOCLAIM JUSTID, which counts no delivery),
        those that still exist, and how often each was attempted so far (XPENDING's counter, which
        :meth:`attempt` moves on); deleted ones are acked."""
        def claim(r: redis.Redis) -> list:
            return r.xautoclaim(self.stream, self.group, self.consumer, self.claim_idle_ms,
                                start_id=self._claim_cursor, count=count, justid=True)

        # redis-py returns only the ids with JUSTID; the cursor restarts from 0-0 each scan round
        ids = self._link.call(claim)
        self._claim_cursor = "0-0" if len(ids) < count else _next_id(ids[-1])
        if not ids:
            return [], {}

        entries, counts = self._fetch_pending(ids)
        self._m["reclaimed"].inc(len(entries))
        return entries, counts

    def _fetch_pending(self, ids: list) -> tuple[list[tuple[bytes, dict]], dict[str, int]]:
        """The pending entries ``ids`` that still exist and each one's delivery count (XRANGE and
        XPENDING, which count nothing); those deleted while pending are acked."""
        def fetch(r: redis.Redis) -> list:
            p = r.pipeline(transaction=False)
            for i in ids:
                p.xrange(self.stream, i, i)
                p.xpending_range(self.stream, self.group, min=i, max=i, count=1)
            return p.execute()

        found = self._link.call(fetch)
        entries, counts, gone = [], {}, []
        for i, rows, pending in zip(ids, found[0::2], found[1::2]):
            if rows:
                entries.append(rows[0])
                counts[_text(i)] = int(pending[0]["times_delivered"]) if pending else 1
            else:
                gone.append(i)
        if gone:
            log.info("stream %s: %d pending entries were deleted; acking them", self.stream, len(gone))
            self.ack(gone, count_metric=False)
        return entries, counts

    def attempt(self, m: Message) -> bool:
        """Count one more attempt at a reclaimed entry before working on it (a fresh one's first
        attempt is its delivery). Past ``max_deliveries`` attempts it is dead-lettered as ``poison``
        instead (False): every consumer that took it died or gave up on it. The count is the
        group's own delivery counter (XPENDING), set with XCLAIM RETRYCOUNT, so it lives and dies
        with the pending entry; an entry merely reclaimed, and not worked on, is not counted."""
        if not m.reclaimed or self.max_deliveries is None:
            return True
        n = m.deliveries + 1
        if n > self.max_deliveries:
            self._deadletter(m.id, m.payload, f"attempted {m.deliveries} times and never acknowledged "
                             f"(redis.max_deliveries={self.max_deliveries}): every consumer that took it died or "
                             "gave up on it", "poison")
            return False
        self._link.call(lambda r: r.xclaim(self.stream, self.group, self.consumer, 0, [m.id], retrycount=n, justid=True))
        m.deliveries = n
        return True

    def _decode_all(self, entries: Iterable[tuple[bytes, dict]], deliveries: dict[str, int] | None = None, *,
                    reclaimed: bool) -> list[Message]:
        out = []
        for entry_id, fields in entries:
            eid = _text(entry_id)
            n = (deliveries or {}).get(eid, 1)
            payload = (fields or {}).get(DATA_FIELD)
            if payload is None:
                self._deadletter(eid, packb({_text(k): v for k, v in (fields or {}).items()}),
                                 f"entry has no '{DATA_FIELD.decode()}' field", "missing_data")
                continue
            if self.max_message_bytes is not None and len(payload) > self.max_message_bytes:
                self._deadletter(eid, payload, f"payload of {len(payload)} bytes is larger than the limit of "
                                 f"{self.max_message_bytes} (redis.max_message_mb); its first "
                                 f"{min(len(payload), _OVERSIZED_KEPT)} bytes are kept here", "too_large",
                                 keep=_OVERSIZED_KEPT)
                continue
            try:
                value = self.decode(payload) if self.decode else payload
            except Exception as e:  # any decode failure means a poison message, never a crash
                self._deadletter(eid, payload, f"decode failed: {type(e).__name__}: {e}", "decode_error")
                continue
            self._m["consumed"].inc()
            out.append(Message(id=eid, payload=payload, value=value, reclaimed=reclaimed, deliveries=n))
        return out

    # ------------------------------------------------------------------ acking

    def ack(self, ids: Iterable[str], count_metric: bool = True, counters: dict[str, str] | None = None) -> int:
        """XACK + XDEL the entries (one script); return how many were still pending. ``counters``
        (entry id -> counter name) adds 1 to that counter of ``stats_key`` for each entry this call
        acks, in the same script, so a fate counted at its ack counts exactly once: also when the
        consumer dies and another decides the entry again, and when a reply is lost and retried."""
        ids = list(ids)
        if not ids:
            return 0
        names = [(counters or {}).get(i, "") if self.stats_key else "" for i in ids]
        n = int(self._link.call(lambda r: self._ack_script(
            keys=[self.stream, self.stats_key or self.stream, self._fence_key],
            args=[self.group, len(ids), *ids, *names, self._fence_token], client=r)))
        if count_metric:
            self._m["acked"].inc(n)
        return n

    def deadletter(self, message: Message, reason: str, kind: str = "rejected") -> None:
        """Move a delivered message the caller found unusable to the dead-letter stream (and ack it)."""
        self._deadletter(message.id, message.payload, reason, kind)

    def deadletter_counter(self, kind: str) -> str:
        """The ``stats_key`` counter of dead letters of ``kind`` from this stream."""
        return f"deadletter_{self.stream.rsplit(':', 1)[-1]}_{kind}"

    def _deadletter(self, entry_id: str, payload: bytes, reason: str, kind: str, keep: int | None = None) -> bool:
        """Record (the payload, or its first ``keep`` bytes), ack and delete in one script, then run
        ``on_deadletter`` with the whole payload; False when the entry was no longer pending (nothing
        written: a retry after a lost reply, or another consumer finished it)."""
        reason = reason if len(reason) <= _MAX_REASON_CHARS else reason[:_MAX_REASON_CHARS] + "..."
        record = packb(deadletter_message(reason, self.stream, entry_id, self.consumer, payload[:keep], time.time()))
        counter = self.deadletter_counter(kind) if self.stats_key else ""
        moved = int(self._link.call(lambda r: self._deadletter_script(
            keys=[self.stream, self.deadletter_stream, self.stats_key or self.stream, self._fence_key],
            args=[self.group, entry_id, record, self.deadletter_maxlen, counter, DATA_FIELD, self._fence_token],
            client=r)))
        if not moved:
            return False
        self._m_dead.labels(stream=self.stream, reason=kind).inc()
        log.warning("stream %s entry %s -> %s: %s", self.stream, entry_id, self.deadletter_stream, reason[:200])
        if self.on_deadletter is not None:
            self.on_deadletter(payload)
        return True

    def prune_consumers(self, idle_ms: int) -> list[str]:
        """Delete the group's other consumers that hold nothing and were idle longer than
        ``idle_ms`` (dead processes with fresh names: a restarted judge is a new consumer), so the
        group lists only the living. One that still holds entries stays until they are reclaimed."""
        def run(r: redis.Redis) -> list[str]:
            gone = []
            try:
                consumers = r.xinfo_consumers(self.stream, self.group)
            except ResponseError as e:  # the stream is gone (Redis restarted without persistence)
                if "no such key" not in str(e).lower():
                    raise
                return gone
            for c in consumers:
                name = _text(c.get("name"))
                if name != self.consumer and int(c.get("pending") or 0) == 0 and int(c.get("idle") or 0) > idle_ms:
                    r.xgroup_delconsumer(self.stream, self.group, name)
                    gone.append(name)
            return gone

        try:
            gone = self._link.call(run, should_stop=lambda: True)
        except RETRYABLE as e:
            log.debug("stream %s: consumer pruning skipped: %s", self.stream, e)
            return []
        if gone:
            log.info("stream %s: removed %d idle consumers that held nothing: %s", self.stream, len(gone), gone)
        return gone

    def leave(self) -> bool:
        """Remove this consumer from the group if it holds no pending entry (a clean stop); entries
        it still holds keep it listed so that they can be reclaimed."""
        def run(r: redis.Redis) -> bool:
            mine = r.xpending_range(self.stream, self.group, min="-", max="+", count=1, consumername=self.consumer)
            if mine:
                return False
            r.xgroup_delconsumer(self.stream, self.group, self.consumer)
            return True

        try:
            return bool(self._link.call(run, should_stop=lambda: True))
        except (*RETRYABLE, ResponseError) as e:
            log.debug("stream %s: %s could not leave the group: %s", self.stream, self.consumer, e)
            return False

    def close(self) -> None:
        self._link.close()

def _next_id(entry_id: bytes | str) -> str:
    """The smallest stream id after ``entry_id`` (XAUTOCLAIM start is inclusive)."""
    ms, seq = _text(entry_id).split("-")
    return f"{ms}-{int(seq) + 1}"
