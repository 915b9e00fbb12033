"""The Redis connection layer under the stream transport: URLs and auth, one client per link, and
the one retry wrapper that every Redis call of worldloop's roles goes through (redis-py, sync API).

This module speaks Redis, not streams: it knows connections, errors and backoff, never a stream
entry, group or payload. The stream modules (:mod:`worldloop.common.transport.streams`,
:mod:`~worldloop.common.transport.stream_consumer`) and the roles' other Redis state (admission,
counters, leases), all in ``worldloop.common.transport``, build on it.

Design decisions
----------------
* **Threads.** One link (one client, one connection pool) is safe to share between threads:
  redis-py checks a connection out of the pool for each call and drops a connection that failed
  (the next checkout opens a new one). A retry never touches the pool: disconnecting it under the
  other threads closed their sockets mid-call (``ValueError: I/O operation on closed file``), and
  those errors are no Redis errors, so nothing retried them.
* **Reconnects.** :meth:`RedisLink.call` runs a call and, on ConnectionError / TimeoutError /
  BusyLoading (:data:`RETRYABLE`), runs it again with exponential backoff from 50 ms capped at
  ``reconnect_max_s`` (metric ``worldloop_stream_reconnects``, a log line), forever unless the
  link was closed or its ``should_stop`` turned true (then the error is raised, so that a process
  asked to stop never hangs on an unreachable Redis). A NOGROUP reply (Redis restarted without
  persistence) calls the link's ``on_nogroup`` hook (a stream consumer recreates its group
  there) inside the retried block, so a connection error at that moment is retried too, and the
  call runs again; any other error is raised at once.
* **Refused writes.** A write Redis refuses for now (OOM: over ``maxmemory``; MISCONF: a failed
  background save; READONLY: a replica; NOPERM: an ACL) is waited out the same way: a log line that
  names the reason and what fixes it, metric ``worldloop_stream_refused_writes{reason}``, backoff
  capped at ``reconnect_max_s``. No role crash-loops while Redis is full. A caller that asks to stop
  gets :class:`WriteRefused`, a ConnectionError. A refused MULTI runs none of its commands, and
  Redis refuses a script (OOM, MISCONF, READONLY) at its first write, never after it wrote: neither
  leaves half of its writes behind.
* **Fenced writes.** A script that finds another learner's fencing token
  (:mod:`worldloop.common.transport.lease`) fails with ``FENCED``: :class:`Fenced` is raised, never retried.
* **Start-up.** Until a first call succeeds, the retrying gives up after ``startup_timeout_s`` with
  :class:`RedisUnreachable`: a wrong ``redis.url`` must not look like a slow start.
* **Cluster.** A ``redis+cluster://host:port`` (or ``rediss+cluster://``, TLS) URL makes a
  redis-py ``RedisCluster``: the node named seeds it and it discovers the others, follows MOVED/ASK
  and reloads a script a promoted replica does not know (NOSCRIPT). Every key of a run shares one
  hash tag (:mod:`worldloop.common.contracts.keys`), so each script and transaction runs on one node. While a
  primary fails over the cluster answers CLUSTERDOWN / TRYAGAIN, or its slots are uncovered for a
  moment: those are waited out like a connection error (:data:`RETRYABLE`).
* **Secrets.** A URL's password is never printed (:func:`redis_address` is what errors show); a
  URL without one takes ``$WORLDLOOP_REDIS_PASSWORD``, so that it is on no command line.

Public API::

    connect(url, socket_timeout_s=10.0) -> redis.Redis | redis.RedisCluster   redis_address(url) -> str
    is_cluster_url(url) -> bool                                   CLUSTER_SCHEMES
    RedisLink(url, stream, reconnect_max_s, socket_timeout_s, *, should_stop=None, startup_timeout_s=None)
        .call(fn, should_stop=None) -> fn(client)    .r    .register_script(lua)    .on_nogroup()    .close()
    refusal(response_error) -> "OOM" | "MISCONF" | "READONLY" | "NOPERM" | None
    RETRYABLE, RedisUnreachable, WriteRefused, Fenced, REDIS_PASSWORD_ENV
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from typing import Callable, TypeVar

import redis
from redis.commands.core import Script
from redis.exceptions import ClusterDownError, RedisClusterException, SlotNotCoveredError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoPermissionError, OutOfMemoryError, ReadOnlyError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from worldloop.common.exposure import warn_open_redis
from worldloop.common.metrics import metric
from worldloop.common.secrets import REDIS_PASSWORD_ENV, strip_password

log = logging.getLogger(__name__)

# the errors after which a call is retried on a fresh connection (BusyLoadingError is a ConnectionError);
# on a cluster also a failover's CLUSTERDOWN / MASTERDOWN (ClusterDownError), TRYAGAIN and a slot
# that no node serves for a moment (redis-py gives up on those after its own few retries)
RETRYABLE = (RedisConnectionError, RedisTimeoutError, ClusterDownError, TryAgainError, SlotNotCoveredError)
_BACKOFF_START_S = 0.05

T = TypeVar("T")




# the URL schemes of a Redis Cluster (redis-py RedisCluster); the rest of the URL is a redis:// one
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")


def is_cluster_url(url: str | None) -> bool:
    """True for ``redis+cluster://`` and ``rediss+cluster://`` URLs."""
    return bool(url) and url.split("://", 1)[0] in CLUSTER_SCHEMES


def _plain_url(url: str) -> str:
    """The ``redis://`` / ``rediss://`` URL a cluster URL stands for (others unchanged)."""
    scheme, sep, rest = url.partition("://")
    return f"{CLUSTER_SCHEMES.get(scheme, scheme)}{sep}{rest}"


def connect(url: str, socket_timeout_s: float = 10.0) -> "redis.Redis | redis.RedisCluster":
    """A client for ``redis://``, ``rediss://`` (TLS) or ``unix://`` URLs, or a ``RedisCluster`` for
    ``redis+cluster://host:port`` / ``rediss+cluster://`` (any one node; the client finds the rest).

    Auth: ``redis://:password@host:port/db`` and ``redis://user:password@...`` (ACL) both work;
    a URL without a password takes ``$WORLDLOOP_REDIS_PASSWORD`` when that is set (a password
    in the URL wins). Responses stay bytes (``decode_responses=False``). A cluster has only db 0.
    """
    if not url.startswith(_SCHEMES):
        raise ValueError("redis url must start with redis://, rediss://, unix://, redis+cluster:// or "
                         f"rediss+cluster://, got {strip_password(url)!r}")
    plain = _plain_url(url)
    warn_open_redis(plain, env_password=bool(os.environ.get(REDIS_PASSWORD_ENV)))
    # redis-py lets what the URL says override these keyword arguments
    kwargs = dict(password=os.environ.get(REDIS_PASSWORD_ENV) or None, decode_responses=False,
                  socket_timeout=socket_timeout_s, socket_connect_timeout=min(socket_timeout_s, 5.0))
    if not is_cluster_url(url):
        return redis.Redis.from_url(plain, **kwargs)
    from urllib.parse import urlsplit

    db = urlsplit(plain).path.strip("/")
    if db not in ("", "0"):
        raise ValueError(f"a Redis Cluster has only database 0, the url names {db!r}: drop the /{db}")
    try:  # a RedisCluster asks its seed node for the slot map at once
        return redis.RedisCluster.from_url(plain, **kwargs)
    except RedisClusterException as e:
        raise RedisConnectionError(f"cannot reach the Redis Cluster at {redis_address(url)}: {e}") from None


# the client that Script objects are registered with: only its encoder is used (every script call
# passes the link's client), so that registering a script never needs a reachable Redis
_SCRIPT_HOLDER = redis.Redis()


# what a write that Redis refuses is waiting for, by the code of Redis's error reply
_REFUSAL_HINTS = {
    "OOM": "used memory is over maxmemory: raise maxmemory or let the consumers drain the streams",
    "MISCONF": "a background save failed: see redis-server's log (disk full? folder gone?)",
    "READONLY": "this Redis is a read-only replica: point redis.url at the primary",
    "NOPERM": "the Redis user may not run this command: check its ACL",
}
_REFUSAL_CLASSES = {"OOM": OutOfMemoryError, "READONLY": ReadOnlyError, "NOPERM": NoPermissionError}


def refusal(e: ResponseError) -> str | None:
    """The code (OOM, MISCONF, READONLY, NOPERM) of an error reply by which Redis refused to write
    for now, or None for any other error. Inside a MULTI or a script the code is in the text."""
    text = str(e)
    for code in _REFUSAL_HINTS:
        cls = _REFUSAL_CLASSES.get(code)
        if (cls is not None and isinstance(e, cls)) or re.search(rf"\b{code}\b", text):
            return code
    return None


class WriteRefused(RedisConnectionError):
    """Redis refused a write (OOM, MISCONF, READONLY, NOPERM) and the caller asked to stop waiting.
    A ConnectionError, so that every path that handles "Redis unavailable" while stopping handles it."""

    def __init__(self, reason: str, text: str):
        self.reason = reason
        super().__init__(f"redis refused a write ({reason}): {text}")


class Fenced(RuntimeError):
    """A fenced write script refused this process's write: another learner took the namespace's
    lease (:mod:`worldloop.common.transport.lease`). Never retried: the process must stop writing."""


class RedisUnreachable(RuntimeError):
    """Redis was never reached within the start-up wait: most likely a wrong ``redis.url``."""


def redis_address(url: str) -> str:
    """``host:port/db`` (or the socket path) of a Redis URL, never its password."""
    from urllib.parse import urlsplit

    u = urlsplit(url)
    if u.scheme == "unix":
        return u.path
    where = f"{u.hostname or 'localhost'}:{u.port or 6379}{u.path or ''}"
    return f"cluster {where}" if is_cluster_url(url) else where


class RedisLink:
    """One Redis connection with the reconnecting retry wrapper shared by every stream primitive and
    the roles' other Redis state. ``stream`` names the key the link serves: the label of its
    reconnect metric and log lines.

    ``should_stop`` (here or per call) ends the retrying: the connection error is raised so that a
    process asked to stop never hangs on an unreachable Redis. Until the first call succeeds, the
    retrying gives up after ``startup_timeout_s`` with :class:`RedisUnreachable` (a wrong URL must
    not look like a slow start); after that it retries for as long as Redis stays away.
    """

    def __init__(self, url: str, stream: str, reconnect_max_s: float, socket_timeout_s: float, *,
                 should_stop: Callable[[], bool] | None = None, startup_timeout_s: float | None = None):
        self.url = url
        self.stream = stream
        self.reconnect_max_s = reconnect_max_s
        self.socket_timeout_s = socket_timeout_s
        self.should_stop = should_stop
        self.startup_timeout_s = startup_timeout_s
        self.reached = False
        self.closed = False
        # a cluster client needs a reachable node to be built: built at the first call, retried there
        self._client = None if is_cluster_url(url) else connect(url, socket_timeout_s)
        self._client_lock = threading.Lock()  # threads sharing the link build one client
        self._reconnects = metric("worldloop_stream_reconnects").labels(stream=stream)

    @property
    def r(self) -> "redis.Redis | redis.RedisCluster":
        """The link's client (a cluster one is built on first use: ConnectionError while no node answers)."""
        if self._client is None:
            with self._client_lock:
                if self._client is None:
                    self._client = connect(self.url, self.socket_timeout_s)
        return self._client

    def register_script(self, text: str) -> Script:
        """A Lua script to run as ``script(keys=..., args=..., client=r)`` inside :meth:`call` (EVALSHA,
        loaded again on NOSCRIPT: a restarted Redis or a promoted replica). Needs no reachable Redis."""
        return Script(_SCRIPT_HOLDER, text)

    def call(self, fn: Callable[[redis.Redis], T], should_stop: Callable[[], bool] | None = None) -> T:
        """Run ``fn(client)``; on a connection-type error or a refused write wait with backoff and
        run it again; on NOGROUP recreate the group (:meth:`on_nogroup`) and run it again.

        Retries until it succeeds, unless the link was closed or ``should_stop()`` (the call's or
        the link's) turns true, in which case the connection error (or :class:`WriteRefused`) is
        raised, or Redis was never reached within ``startup_timeout_s`` (:class:`RedisUnreachable`).
        """
        delay = _BACKOFF_START_S
        first_failure: float | None = None
        need_group = False
        while True:
            try:
                if need_group:  # inside the try: Redis gone again right now is retried like any call
                    self.on_nogroup()
                    need_group = False
                out = fn(self.r)
                self.reached = True
                return out
            except RETRYABLE as e:
                if self._stopping(should_stop):
                    raise
                now = time.monotonic()
                first_failure = first_failure if first_failure is not None else now
                if not self.reached and self.startup_timeout_s is not None and now - first_failure >= self.startup_timeout_s:
                    raise RedisUnreachable(
                        f"cannot reach Redis at {redis_address(self.url)} for {self.startup_timeout_s:g}s "
                        f"({type(e).__name__}: {e}); check redis.url") from None
                self._reconnects.inc()
                log.warning("redis %s (stream %s): %s; reconnecting in %.2fs", type(e).__name__, self.stream, e, delay)
            except ResponseError as e:
                if str(e).startswith("FENCED") or " FENCED " in str(e):
                    raise Fenced(str(e)) from None
                reason = refusal(e)
                if reason is None:
                    if "NOGROUP" not in str(e) or self.closed:
                        raise
                    need_group = True
                    continue
                self.reached = True
                if self._stopping(should_stop):
                    raise WriteRefused(reason, str(e)) from e
                metric("worldloop_stream_refused_writes").labels(stream=self.stream, reason=reason).inc()
                log.warning("redis refused a write (%s) on %s: %s; %s; retrying in %.2fs", reason, self.stream,
                            str(e)[:200], _REFUSAL_HINTS[reason], delay)
            time.sleep(delay)
            delay = min(delay * 2, self.reconnect_max_s)

    def _stopping(self, should_stop: Callable[[], bool] | None) -> bool:
        stop = should_stop or self.should_stop
        return self.closed or (stop is not None and stop())

    def on_nogroup(self) -> None:
        """A call got NOGROUP: a stream consumer replaces this to recreate its group; here it fails."""
        raise RuntimeError(f"stream {self.stream}: consumer group vanished")

    def close(self) -> None:
        self.closed = True
        if self._client is None:
            return
        try:
            self._client.close()
        except Exception:  # closing a dead connection may fail; nothing to recover
            pass
