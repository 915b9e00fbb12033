"""The Redis-stream transport between actors, judges and the learner (redis-py, sync API): the
writing half and acks (its reading half, :class:`StreamConsumer`, lives in
:mod:`worldloop.common.transport.stream_consumer` and is re-exported here). Only modules of
``worldloop.common.transport`` speak Redis streams: these two, and
:mod:`worldloop.common.transport.admission`, which counts both streams' backlogs with XRANGE.
Connections, retries and URLs are :mod:`worldloop.common.transport.redis_link`.

Every entry carries its msgpack payload in the field ``b"data"`` (plus optional
extra fields). A :class:`StreamProducer` appends with XADD; a
:class:`StreamConsumer` reads through a consumer group (XREADGROUP) and the
caller acknowledges once its work is durable.

Design decisions
----------------
* **Ack = XACK + XDEL.** A consumer acknowledges AND deletes an entry (one
  Lua script) only after the caller says the work is durable (e.g. the
  judge has XADDed the scored trajectory). So ``XLEN`` of a stream equals its
  backlog: entries not yet delivered plus entries delivered but not yet acked.
  A run-wide counter of an entry's fate is added in the same script, and only
  when that script's XACK acked the entry: a call retried after its reply was
  lost counts nothing twice.
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
  entry may have been half-processed: downstream dedups by trajectory id. An
  XADD given up unanswered because the producer was asked to stop raises
  :class:`AddOutcomeUnknown`: the entry may have gone in.
* **Poison messages.** An entry whose ``data`` field is missing, whose payload
  is larger than ``max_message_bytes`` or whose ``decode`` raises goes to the
  dead-letter stream (``worldloop.common.contracts.schemas`` ``deadletter_message``:
  reason, source stream, entry id, consumer, time, original bytes) and is
  acked+deleted in the same script, which writes nothing when the entry was no
  longer pending (one record per entry, also after a lost reply); it is never
  returned and never crashes the consumer. The dead-letter stream is trimmed to
  about ``deadletter_maxlen`` records. Entries deleted while pending (XAUTOCLAIM
  finds their id but no entry) are acked and skipped.
* **Reconnects.** Every Redis call goes through the one retry wrapper of
  :class:`worldloop.common.transport.redis_link.RedisLink` (reconnect with capped
  exponential backoff, forever unless closed or asked to stop; a wrong URL
  fails at start-up with :class:`RedisUnreachable`). A NOGROUP error (Redis
  restarted without persistence) recreates the consumer's group and the call
  continues.
* **Restarts.** With persistence (AOF, as ``LocalRedis(persist=True)``) and a
  clean shutdown, every entry whose XADD returned survives a restart, and so
  does the group with its pending list: nothing is lost. Without persistence
  the stream and the group vanish: entries not yet acked at that moment are
  lost, the group is recreated and the run continues with new entries.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import redis
from redis.exceptions import ResponseError

from worldloop.common.metrics import metric
from worldloop.common.transport.redis_link import RETRYABLE, RedisLink, RedisUnreachable, connect
from worldloop.common.transport.stream_consumer import DATA_FIELD, Message, StreamConsumer, _text

log = logging.getLogger(__name__)

__all__ = [  # connect, RedisLink and RedisUnreachable: importable from here too, beside the stream classes
    "DATA_FIELD", "DUPLICATE", "FORWARDED", "FORWARD_LUA", "LOST_RACE", "AddOutcomeUnknown", "Forwarder", "Message", "RedisLink",
    "RedisUnreachable", "StopRequested", "StreamConsumer", "StreamProducer", "connect", "stream_info",
]

_POLL_MIN_S = 0.005
_POLL_MAX_S = 0.1


class StopRequested(Exception):
    """A blocking stream call gave up because its ``should_stop`` turned true."""


class AddOutcomeUnknown(Exception):
    """:meth:`StreamProducer.add` gave up on an XADD that had gone out without its reply (the link
    broke or timed out, and the caller asked to stop): the entry may be in the stream or not. Over
    a lossy link a reply is lost after Redis ran the command, so "not pushed" would be a guess."""


class StreamProducer:
    """Appends payloads to one stream, blocking while its backlog is at ``max_backlog``."""

    def __init__(self, url: str, stream: str, max_backlog: int, *, reconnect_max_s: float = 30.0,
                 socket_timeout_s: float = 10.0, should_stop: Callable[[], bool] | None = None,
                 startup_timeout_s: float | None = None):
        if max_backlog < 1:
            raise ValueError(f"max_backlog must be >= 1, got {max_backlog}")
        self.stream = stream
        self.max_backlog = max_backlog
        self._link = RedisLink(url, stream, reconnect_max_s, socket_timeout_s, should_stop=should_stop,
                               startup_timeout_s=startup_timeout_s)
        self._m_produced = metric("worldloop_stream_produced_messages").labels(stream=stream)
        self._m_bytes = metric("worldloop_stream_produced_bytes").labels(stream=stream)
        self._m_wait = metric("worldloop_stream_backpressure_seconds").labels(stream=stream)
        self._m_blocked = metric("worldloop_stream_backpressure_blocked").labels(stream=stream)
        self._m_backlog = metric("worldloop_stream_backlog_messages").labels(stream=stream)

    def backlog(self, should_stop: Callable[[], bool] | None = None) -> int:
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

        n = self._link.call(run, should_stop)
        self._m_backlog.set(n)
        return n

    def wait_for_room(self, timeout: float | None = None, should_stop: Callable[[], bool] | None = None) -> bool:
        """Block while the backlog is at ``max_backlog``; True once there is room.

        False when ``should_stop()`` turned true first; :class:`TimeoutError` after ``timeout`` s.
        """
        should_stop = should_stop or self._link.should_stop
        if self.backlog(should_stop) < self.max_backlog:
            return True
        start = time.monotonic()
        sleep = _POLL_MIN_S
        self._m_blocked.set(1)
        try:
            while self.backlog(should_stop) >= self.max_backlog:
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
        if not self.wait_for_room(timeout):
            raise StopRequested(f"stopped while waiting for room in {self.stream}")
        try:  # the link retries a broken call until asked to stop; then the XADD's fate is unknown
            entry_id = self._link.call(lambda r: r.xadd(self.stream, entry))
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
            raise AddOutcomeUnknown(f"XADD to {self.stream} went unanswered ({type(e).__name__}: {e}); the entry "
                                    "may be in the stream") from e
        self._m_produced.inc()
        self._m_bytes.inc(len(entry[DATA_FIELD]))
        return _text(entry_id)

    def close(self) -> None:
        self._link.close()


# --------------------------------------------------------------------------- exactly-once forward

# KEYS: source, dest, seen zset; ARGV: group, entry id, payload, dedup id, window s, data field.
# The window runs on Redis's own clock (TIME), never a judge's: a judge whose clock is days ahead
# once wiped the set and let a duplicate through. replicate_commands: a write after TIME needs
# effects replication on Redis 6.2 (the only mode, and a no-op, on 7).
FORWARD_LUA = """
redis.replicate_commands()
local acked = redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
if acked == 0 then return 0 end
redis.call('XDEL', KEYS[1], ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. (now - tonumber(ARGV[5])))
if redis.call('ZADD', KEYS[3], 'NX', now, ARGV[4]) == 0 then return -1 end
redis.call('XADD', KEYS[2], '*', ARGV[6], ARGV[3])
return 1
"""
FORWARDED, LOST_RACE, DUPLICATE = 1, 0, -1


class Forwarder:
    """Exactly-once hand-over of a processed entry from one stream to the next, atomic in Redis
    (one Lua script)::

        XACK source group <id>     -- 0: another consumer already finished this entry -> LOST_RACE
        XDEL source <id>
        ZADD NX <seen_key> <Redis TIME> <dedup_id>   -- 0: this id was forwarded already -> DUPLICATE
        XADD dest * data <payload>            -- FORWARDED

    A consumer that dies before the script ran left the entry pending: another one reclaims and
    forwards it. Two consumers holding the same entry (a slow one whose entry was reclaimed) both
    run the script, but only the first XACK removes it from the pending list, so one XADD happens.
    A reply lost to a connection error is retried: the retry finds the entry acked and adds
    nothing. ``seen_key`` forgets ids older than ``dedup_window_s`` by Redis's clock (TIME in the
    script), so a judge's own clock, however wrong, moves nothing. The destination's backpressure
    (``max_backlog`` undelivered entries) is waited for before the script runs.
    """

    def __init__(self, url: str, source: str, group: str, dest: str, seen_key: str, *, max_backlog: int,
                 dedup_window_s: float, reconnect_max_s: float = 30.0, socket_timeout_s: float = 10.0,
                 should_stop: Callable[[], bool] | None = None, startup_timeout_s: float | None = None):
        self.source, self.group, self.dest, self.seen_key = source, group, dest, seen_key
        self.dedup_window_s = dedup_window_s
        self.link = RedisLink(url, dest, reconnect_max_s, socket_timeout_s, should_stop=should_stop,
                              startup_timeout_s=startup_timeout_s)
        self.producer = StreamProducer(url, dest, max_backlog, reconnect_max_s=reconnect_max_s,
                                       socket_timeout_s=socket_timeout_s, should_stop=should_stop,
                                       startup_timeout_s=startup_timeout_s)
        self._script = self.link.register_script(FORWARD_LUA)
        self._m_produced = metric("worldloop_stream_produced_messages").labels(stream=dest)
        self._m_bytes = metric("worldloop_stream_produced_bytes").labels(stream=dest)
        self._m_acked = metric("worldloop_stream_acked_messages").labels(stream=source)

    def forward(self, entry_id: str, payload: bytes, dedup_id: str, should_stop: Callable[[], bool] | None = None) -> int | None:
        """Run the script; FORWARDED, LOST_RACE or DUPLICATE, or None when abandoned on stop (the
        entry then stays pending and is reclaimed)."""
        if not self.producer.wait_for_room(should_stop=should_stop):
            return None

        def run(r: redis.Redis) -> int:
            return int(self._script(keys=[self.source, self.dest, self.seen_key],
                                    args=[self.group, entry_id, payload, dedup_id, self.dedup_window_s, DATA_FIELD],
                                    client=r))

        try:
            status = self.link.call(run, should_stop=should_stop)
        except RETRYABLE:
            return None  # asked to stop while Redis is away: still pending, reclaimed later
        if status != LOST_RACE:
            self._m_acked.inc()
        if status == FORWARDED:
            self._m_produced.inc()
            self._m_bytes.inc(len(payload))
        return status

    def close(self) -> None:
        self.producer.close()
        self.link.close()


def stream_info(r: redis.Redis, stream: str) -> dict:
    """Length, groups (pending, lag) and consumers (pending, idle ms) of one stream."""
    length = int(r.xlen(stream))
    groups = []
    if r.exists(stream):
        for g in r.xinfo_groups(stream):
            name = _text(g["name"])
            pending = int(g.get("pending") or 0)
            lag = g.get("lag")
            consumers = [
                {"name": _text(c["name"]), "pending": int(c.get("pending") or 0), "idle_ms": int(c.get("idle") or 0)}
                for c in r.xinfo_consumers(stream, name)
            ]
            groups.append({
                "name": name,
                "pending": pending,
                "lag": int(lag) if lag is not None else max(length - pending, 0),
                "consumers": consumers,
            })
    return {"stream": stream, "length": length, "groups": groups}
