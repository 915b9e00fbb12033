"""The Redis-stream transport between actors, judges and the learner (redis-py, sync API).

Every entry carries its msgpack payload in the field ``b"data"`` (plus optional
extra fields). A :class:`StreamProducer` appends with XADD; a
:class:`StreamConsumer` reads through a consumer group (XREADGROUP) and the
caller acknowledges once its work is durable.

Design decisions
----------------
* **Ack = XACK + XDEL.** A consumer acknowledges AND deletes an entry (one
  MULTI pipeline) only after the caller says the work is durable (e.g. the
  judge has XADDed the scored trajectory). So ``XLEN`` of a stream equals its
  backlog: entries not yet delivered plus entries delivered but not yet acked.
  One consumer group per stream is assumed (rollouts -> judges, scored ->
  learner); a second group on the same stream would lose entries.
* **Backpressure.** A producer blocks while the stream's *undelivered* backlog
  (``XLEN`` minus the entries pending in consumer groups) is ``>= max_backlog``,
  polling with a small sleep (metrics ``worldloop_stream_backpressure_seconds``,
  ``..._blocked``, ``..._backlog_messages``); ``add(timeout=...)`` raises
  :class:`TimeoutError` instead of waiting forever. The limit is soft: N
  producers racing may overshoot it by at most N-1 entries. Delivered but
  unacked entries do not count: the learner holds the entries of the updates
  since its last checkpoint pending (it acks only once a checkpoint makes them
  durable), and that must not stall the producers; what it holds is bounded by
  its own batch size and checkpoint interval.
* **At-least-once delivery.** Entries a consumer read but never acked (it died,
  or hangs) are reclaimed with XAUTOCLAIM by any consumer of the group once they
  are idle longer than ``claim_idle_ms`` (a restarted consumer reclaims its own).
  An XADD retried after a lost reply may duplicate an entry, and a reclaimed
  entry may have been half-processed: downstream dedups by trajectory id.
* **Poison messages.** An entry whose ``data`` field is missing or whose
  ``decode`` raises goes to the dead-letter stream (``common.schemas``
  ``deadletter_message``: reason, source stream, entry id, consumer, time,
  original bytes) and is acked+deleted in the same MULTI; it is never returned
  and never crashes the consumer. Entries deleted while pending (XAUTOCLAIM
  finds their id but no entry) are acked and skipped.
* **Reconnects.** Every Redis call goes through one retry wrapper: on
  ConnectionError / TimeoutError / BusyLoading it reconnects with exponential
  backoff capped at ``reconnect_max_s`` (metric ``worldloop_stream_reconnects``,
  a log line), forever unless the object was closed. A NOGROUP error (Redis
  restarted without persistence) recreates the group and the call continues.
* **Restarts.** With persistence (AOF, as ``LocalRedis(persist=True)``) and a
  clean shutdown, every entry whose XADD returned survives a restart, and so
  does the group with its pending list: nothing is lost. Without persistence
  the stream and the group vanish: entries not yet acked at that moment are
  lost, the group is recreated and the run continues with new entries.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, TypeVar

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common.metrics import metric
from common.schemas import deadletter_message, packb

log = logging.getLogger(__name__)

DATA_FIELD = b"data"
_RETRYABLE = (RedisConnectionError, RedisTimeoutError)  # BusyLoadingError is a ConnectionError
_POLL_MIN_S = 0.005
_POLL_MAX_S = 0.1
_BACKOFF_START_S = 0.05
_MAX_REASON_CHARS = 1000

T = TypeVar("T")


def connect(url: str, socket_timeout_s: float = 10.0) -> redis.Redis:
    """A client for ``redis://``, ``rediss://`` (TLS) or ``unix://`` URLs, auth taken from the URL.

    ``redis://:password@host:port/db`` and ``redis://user:password@...`` (ACL) both work;
    responses stay bytes (``decode_responses=False``).
    """
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"redis url must start with redis://, rediss:// or unix://, got {url.split('@')[-1]!r}")
    return redis.Redis.from_url(
        url,
        decode_responses=False,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=min(socket_timeout_s, 5.0),
    )


def _text(x: Any) -> str:
    return x.decode(errors="replace") if isinstance(x, (bytes, bytearray)) else str(x)


class RedisLink:
    """One Redis connection with the retry-forever wrapper shared by producer and consumer."""

    def __init__(self, url: str, stream: str, reconnect_max_s: float, socket_timeout_s: float):
        self.url = url
        self.stream = stream
        self.reconnect_max_s = reconnect_max_s
        self.socket_timeout_s = socket_timeout_s
        self.closed = False
        self.r = connect(url, socket_timeout_s)
        self._reconnects = metric("worldloop_stream_reconnects").labels(stream=stream)

    def call(self, fn: Callable[[redis.Redis], T], should_stop: Callable[[], bool] | None = None) -> T:
        """Run ``fn(client)``; on a connection-type error reconnect with backoff and run it again.

        Retries until it succeeds, unless the link was closed or ``should_stop()`` turns true, in
        which case the connection error is raised.
        """
        delay = _BACKOFF_START_S
        while True:
            try:
                return fn(self.r)
            except _RETRYABLE as e:
                if self.closed or (should_stop is not None and should_stop()):
                    raise
                self._reconnects.inc()
                log.warning("redis %s (stream %s): %s; reconnecting in %.2fs", type(e).__name__, self.stream, e, delay)
                time.sleep(delay)
                delay = min(delay * 2, self.reconnect_max_s)
                self._reset()
            except ResponseError as e:
                if "NOGROUP" not in str(e) or self.closed:
                    raise
                self.on_nogroup()

    def on_nogroup(self) -> None:
        raise RuntimeError(f"stream {self.stream}: consumer group vanished")

    def _reset(self) -> None:
        try:
            self.r.connection_pool.disconnect()
        except Exception:  # a broken pool: start a new client below anyway
            pass
        self.r = connect(self.url, self.socket_timeout_s)

    def close(self) -> None:
        self.closed = True
        try:
            self.r.close()
        except Exception:  # closing a dead connection may fail; nothing to recover
            pass


class StreamProducer:
    """Appends payloads to one stream, blocking while its backlog is at ``max_backlog``."""

    def __init__(self, url: str, stream: str, max_backlog: int, *, reconnect_max_s: float = 30.0,
                 socket_timeout_s: float = 10.0):
        if max_backlog < 1:
            raise ValueError(f"max_backlog must be >= 1, got {max_backlog}")
        self.stream = stream
        self.max_backlog = max_backlog
        self._link = RedisLink(url, stream, reconnect_max_s, socket_timeout_s)
        self._m_produced = metric("worldloop_stream_produced_messages").labels(stream=stream)
        self._m_bytes = metric("worldloop_stream_produced_bytes").labels(stream=stream)
        self._m_wait = metric("worldloop_stream_backpressure_seconds").labels(stream=stream)
        self._m_blocked = metric("worldloop_stream_backpressure_blocked").labels(stream=stream)
        self._m_backlog = metric("worldloop_stream_backlog_messages").labels(stream=stream)

    def backlog(self) -> int:
        """Entries not yet delivered to any consumer (XLEN minus the groups' pending entries)."""
        def run(r: redis.Redis) -> int:
            p = r.pipeline(transaction=True)
            p.xlen(self.stream)
            p.xinfo_groups(self.stream)
            try:
                length, groups = p.execute()
            except ResponseError as e:  # no such key: nothing added yet
                if "no such key" not in str(e).lower():
                    raise
                return 0
            return max(0, int(length) - sum(int(g.get("pending") or 0) for g in groups))

        n = self._link.call(run)
        self._m_backlog.set(n)
        return n

    def wait_for_room(self, timeout: float | None = None, should_stop: Callable[[], bool] | None = None) -> bool:
        """Block while the backlog is at ``max_backlog``; True once there is room.

        False when ``should_stop()`` turned true first; :class:`TimeoutError` after ``timeout`` s.
        """
        if self.backlog() < self.max_backlog:
            return True
        start = time.monotonic()
        sleep = _POLL_MIN_S
        self._m_blocked.set(1)
        try:
            while self.backlog() >= self.max_backlog:
                if should_stop is not None and should_stop():
                    return False
                waited = time.monotonic() - start
                if timeout is not None and waited >= timeout:
                    raise TimeoutError(
                        f"stream {self.stream} stayed at its backlog limit {self.max_backlog} for {timeout}s"
                    )
                time.sleep(sleep)
                sleep = min(sleep * 2, _POLL_MAX_S)
            return True
        finally:
            self._m_blocked.set(0)
            self._m_wait.inc(time.monotonic() - start)

    def add(self, payload: bytes, fields: dict | None = None, timeout: float | None = None) -> str:
        """XADD ``payload`` (plus ``fields``) once the backlog allows; return the entry id."""
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise TypeError(f"payload must be bytes, got {type(payload).__name__}")
        entry: dict = {DATA_FIELD: bytes(payload)}
        for k, v in (fields or {}).items():
            key = k.encode() if isinstance(k, str) else k
            if key == DATA_FIELD:
                raise ValueError("extra field 'data' would overwrite the payload")
            entry[key] = v
        self.wait_for_room(timeout)
        entry_id = self._link.call(lambda r: r.xadd(self.stream, entry))
        self._m_produced.inc()
        self._m_bytes.inc(len(entry[DATA_FIELD]))
        return _text(entry_id)

    def close(self) -> None:
        self._link.close()


@dataclass
class Message:
    """One delivered entry: its id, the raw payload, the decoded value and whether it was reclaimed."""

    id: str
    payload: bytes
    value: Any
    reclaimed: bool


class StreamConsumer:
    """Reads one stream as ``consumer`` of ``group``; see the module docstring for the guarantees."""

    def __init__(self, url: str, stream: str, group: str, consumer: str, *,
                 decode: Callable[[bytes], Any] | None = None, deadletter_stream: str | None = None,
                 block_ms: int = 1000, claim_idle_ms: int = 60000, reconnect_max_s: float = 30.0,
                 socket_timeout_s: float = 10.0):
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.decode = decode
        # default dead-letter stream: "<stream>:deadletter" (callers normally pass Keys(ns).deadletter)
        self.deadletter_stream = deadletter_stream or f"{stream}:deadletter"
        self.block_ms = block_ms
        self.claim_idle_ms = claim_idle_ms
        # a blocking XREADGROUP must return before the socket times out
        self._link = RedisLink(url, stream, reconnect_max_s, max(socket_timeout_s, block_ms / 1000 + 5))
        self._link.on_nogroup = self._create_group
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
        out = self._decode_all(self._reclaim(count), reclaimed=True)
        if len(out) < count:
            fresh = self._link.call(lambda r: r.xreadgroup(
                self.group, self.consumer, {self.stream: ">"}, count=count - len(out),
                block=None if out else block))
            entries = fresh[0][1] if fresh else []
            out += self._decode_all(entries, reclaimed=False)
        return out

    def _reclaim(self, count: int) -> list[tuple[bytes, dict]]:
        """XAUTOCLAIM (JUSTID) idle entries, fetch the ones that still exist, ack the deleted ones."""
        def claim(r: redis.Redis) -> list:
            return r.xautoclaim(self.stream, self.group, self.consumer, self.claim_idle_ms,
                                start_id=self._claim_cursor, count=count, justid=True)

        # redis-py returns only the ids with JUSTID; the cursor restarts from 0-0 each scan round
        ids = self._link.call(claim)
        self._claim_cursor = "0-0" if len(ids) < count else _next_id(ids[-1])
        if not ids:
            return []

        def fetch(r: redis.Redis) -> list:
            p = r.pipeline(transaction=False)
            for i in ids:
                p.xrange(self.stream, i, i)
            return p.execute()

        found = self._link.call(fetch)
        entries = [rows[0] for rows in found if rows]
        gone = [i for i, rows in zip(ids, found) if not rows]
        if gone:
            log.info("stream %s: %d pending entries were deleted; acking them", self.stream, len(gone))
            self.ack(gone, count_metric=False)
        self._m["reclaimed"].inc(len(entries))
        return entries

    def _decode_all(self, entries: Iterable[tuple[bytes, dict]], reclaimed: bool) -> list[Message]:
        out = []
        for entry_id, fields in entries:
            eid = _text(entry_id)
            payload = (fields or {}).get(DATA_FIELD)
            if payload is None:
                self._deadletter(eid, packb({_text(k): v for k, v in (fields or {}).items()}),
                                 f"entry has no '{DATA_FIELD.decode()}' field", "missing_data")
                continue
            try:
                value = self.decode(payload) if self.decode else payload
            except Exception as e:  # any decode failure means a poison message, never a crash
                self._deadletter(eid, payload, f"decode failed: {type(e).__name__}: {e}", "decode_error")
                continue
            self._m["consumed"].inc()
            out.append(Message(id=eid, payload=payload, value=value, reclaimed=reclaimed))
        return out

    # ------------------------------------------------------------------ acking

    def ack(self, ids: Iterable[str], count_metric: bool = True) -> int:
        """XACK + XDEL the entries in one MULTI; return how many were still pending."""
        ids = list(ids)
        if not ids:
            return 0

        def run(r: redis.Redis) -> int:
            p = r.pipeline(transaction=True)
            p.xack(self.stream, self.group, *ids)
            p.xdel(self.stream, *ids)
            return int(p.execute()[0])

        n = self._link.call(run)
        if count_metric:
            self._m["acked"].inc(n)
        return n

    def deadletter(self, message: Message, reason: str) -> None:
        """Move a delivered message the caller found unusable to the dead-letter stream (and ack it)."""
        self._deadletter(message.id, message.payload, reason, "rejected")

    def _deadletter(self, entry_id: str, payload: bytes, reason: str, kind: str) -> None:
        reason = reason if len(reason) <= _MAX_REASON_CHARS else reason[:_MAX_REASON_CHARS] + "..."
        record = packb(deadletter_message(reason, self.stream, entry_id, self.consumer, payload, time.time()))

        def run(r: redis.Redis) -> None:
            p = r.pipeline(transaction=True)
            p.xadd(self.deadletter_stream, {DATA_FIELD: record})
            p.xack(self.stream, self.group, entry_id)
            p.xdel(self.stream, entry_id)
            p.execute()

        self._link.call(run)
        self._m_dead.labels(stream=self.stream, reason=kind).inc()
        log.warning("stream %s entry %s -> %s: %s", self.stream, entry_id, self.deadletter_stream, reason[:200])

    def close(self) -> None:
        self._link.close()


def _next_id(entry_id: bytes | str) -> str:
    """The smallest stream id after ``entry_id`` (XAUTOCLAIM start is inclusive)."""
    ms, seq = _text(entry_id).split("-")
    return f"{ms}-{int(seq) + 1}"
