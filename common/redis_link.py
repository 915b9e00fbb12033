"""The Redis connection layer under the stream transport: URLs and auth, one client per link, and
the one retry wrapper that every Redis call of worldloop's roles goes through (redis-py, sync API).

This module speaks Redis, not streams: it knows connections, errors and backoff, never a stream
entry, group or payload. :mod:`worldloop.common.streams` (the only module that speaks Redis
streams) and the roles' other Redis state (admission, counters, leases) build on it.

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
  there) and the call runs again; any other error is raised at once.
* **Start-up.** Until a first call succeeds, the retrying gives up after ``startup_timeout_s`` with
  :class:`RedisUnreachable`: a wrong ``redis.url`` must not look like a slow start.
* **Secrets.** A URL's password is never printed (:func:`redis_address` is what errors show); a
  URL without one takes ``$WORLDLOOP_REDIS_PASSWORD``, so that it is on no command line.

Public API::

    connect(url, socket_timeout_s=10.0) -> redis.Redis        redis_address(url) -> str
    RedisLink(url, stream, reconnect_max_s, socket_timeout_s, *, should_stop=None, startup_timeout_s=None)
        .call(fn, should_stop=None) -> fn(client)    .on_nogroup()    .close()
    RETRYABLE, RedisUnreachable, REDIS_PASSWORD_ENV
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, TypeVar

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from worldloop.common.metrics import metric

log = logging.getLogger(__name__)

# the errors after which a call is retried on a fresh connection (BusyLoadingError is a ConnectionError)
RETRYABLE = (RedisConnectionError, RedisTimeoutError)
_BACKOFF_START_S = 0.05

T = TypeVar("T")


# the Redis password for a URL without one: from the environment, so that it is on no process's
# command line (``ps``, /proc/PID/cmdline) and in no config file a run writes
REDIS_PASSWORD_ENV = "WORLDLOOP_REDIS_PASSWORD"


def connect(url: str, socket_timeout_s: float = 10.0) -> redis.Redis:
    """A client for ``redis://``, ``rediss://`` (TLS) or ``unix://`` URLs.

    Auth: ``redis://:password@host:port/db`` and ``redis://user:password@...`` (ACL) both work;
    a URL without a password takes ``$WORLDLOOP_REDIS_PASSWORD`` when that is set (a password
    in the URL wins). Responses stay bytes (``decode_responses=False``).
    """
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"redis url must start with redis://, rediss:// or unix://, got {url.split('@')[-1]!r}")
    return redis.Redis.from_url(
        url,
        # redis-py lets what the URL says override these keyword arguments
        password=os.environ.get(REDIS_PASSWORD_ENV) or None,
        decode_responses=False,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=min(socket_timeout_s, 5.0),
    )


class RedisUnreachable(RuntimeError):
    """Redis was never reached within the start-up wait: most likely a wrong ``redis.url``."""


def redis_address(url: str) -> str:
    """``host:port/db`` (or the socket path) of a Redis URL, never its password."""
    from urllib.parse import urlsplit

    u = urlsplit(url)
    if u.scheme == "unix":
        return u.path
    return f"{u.hostname or 'localhost'}:{u.port or 6379}{u.path or ''}"


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
        self.r = connect(url, socket_timeout_s)
        self._reconnects = metric("worldloop_stream_reconnects").labels(stream=stream)

    def call(self, fn: Callable[[redis.Redis], T], should_stop: Callable[[], bool] | None = None) -> T:
        """Run ``fn(client)``; on a connection-type error reconnect with backoff and run it again.

        Retries until it succeeds, unless the link was closed or ``should_stop()`` (the call's or
        the link's) turns true, in which case the connection error is raised, or Redis was never
        reached within ``startup_timeout_s`` (:class:`RedisUnreachable`).
        """
        delay = _BACKOFF_START_S
        first_failure: float | None = None
        while True:
            try:
                out = fn(self.r)
                self.reached = True
                return out
            except RETRYABLE as e:
                stop = should_stop or self.should_stop
                if self.closed or (stop is not None and stop()):
                    raise
                now = time.monotonic()
                first_failure = first_failure if first_failure is not None else now
                if not self.reached and self.startup_timeout_s is not None and now - first_failure >= self.startup_timeout_s:
                    raise RedisUnreachable(
                        f"cannot reach Redis at {redis_address(self.url)} for {self.startup_timeout_s:g}s "
                        f"({type(e).__name__}: {e}); check redis.url") from None
                self._reconnects.inc()
                log.warning("redis %s (stream %s): %s; reconnecting in %.2fs", type(e).__name__, self.stream, e, delay)
                time.sleep(delay)
                delay = min(delay * 2, self.reconnect_max_s)
            except ResponseError as e:
                if "NOGROUP" not in str(e) or self.closed:
                    raise
                self.on_nogroup()

    def on_nogroup(self) -> None:
        """A call got NOGROUP: a stream consumer replaces this to recreate its group; here it fails."""
        raise RuntimeError(f"stream {self.stream}: consumer group vanished")

    def close(self) -> None:
        self.closed = True
        try:
            self.r.close()
        except Exception:  # closing a dead connection may fail; nothing to recover
            pass
