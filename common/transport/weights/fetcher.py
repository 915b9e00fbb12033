"""The background thread that fetches weight versions for a process that generates: an actor, the
in-run evaluator (``worldloop evaluator``).

    WeightFetcher(subscriber, stop, have=0)   # .take() -> (version, tensors) | None, .resync(), .check()

It owns a :class:`~worldloop.common.transport.weights.subscriber.WeightSubscriber` (one subscriber
belongs to one thread) and keeps the newest complete version ready for the caller's loop to take
between generations.
"""

from __future__ import annotations

import threading
from typing import Any

from worldloop.common.metrics import metric


class WeightFetcher(threading.Thread):
    """Owns the subscriber: fetches every newer announced version in the background.

    The actor's loop takes the newest complete version with :meth:`take` between generations,
    so a fetch (large models: seconds; a vanished learner: up to ``weights.fetch_timeout_s``)
    neither stalls generation nor delays a shutdown. Errors follow
    :class:`~worldloop.common.transport.weights.retry.FetchErrors` (``errors``: channel and passing system
    errors retried with backoff, counted in ``worldloop_actor_weight_update_failures``); on a fatal
    one the thread sets ``stop`` and ends, and :meth:`check` raises it (the actor exits non-zero).
    """

    def __init__(self, subscriber: Any, stop: threading.Event, *, have: int = 0, poll_s: float = 0.05,
                 errors: Any = None):
        from worldloop.common.transport.weights.retry import FetchErrors

        super().__init__(name="actor-weights", daemon=True)
        self.subscriber = subscriber
        self.stop = stop
        self.poll_s = poll_s
        self.errors = errors or FetchErrors(
            "actor weights", lambda reason: metric("worldloop_actor_weight_update_failures").labels(reason=reason).inc())
        self._have = int(have)  # the newest version fetched (handed over or waiting in _ready)
        self._lock = threading.Lock()
        self._ready: tuple[int, dict] | None = None

    def take(self) -> tuple[int, dict] | None:
        with self._lock:
            got, self._ready = self._ready, None
        return got

    def resync(self) -> None:
        """Forget what was fetched: the next fetch takes the newest version whatever its number.

        A learner that restarts from its last checkpoint publishes version numbers again that
        this actor may already hold (with the weights of updates that were lost in the crash).
        """
        with self._lock:
            self._have, self._ready = -1, None

    def check(self) -> None:
        """Raise :class:`~worldloop.common.transport.weights.retry.WeightFetchFailed` when the thread stopped
        on a fatal error."""
        from worldloop.common.transport.weights.retry import WeightFetchFailed

        if self.errors.fatal is not None:
            raise WeightFetchFailed.of(self.errors.what, self.errors.fatal) from self.errors.fatal

    def run(self) -> None:
        announced = None
        while not self.stop.is_set():
            try:
                got = None
                announced = self.subscriber.latest_announced()
                if announced is not None and announced > self._have:
                    got = self.subscriber.fetch(min_version=self._have)
                self.errors.ok()
            except Exception as e:  # FetchErrors decides: retry after a wait, or end the process
                wait = self.errors.failed(e, announced)
                if wait is None:
                    self.stop.set()  # the actor stops; run() raises the error (a non-zero exit)
                    return
                self.stop.wait(wait)
                continue
            if got is not None:
                with self._lock:
                    self._ready = got  # a newer version replaces one not applied yet
                    self._have = got[0]
                continue
            self.stop.wait(self.poll_s)


__all__ = ["WeightFetcher"]
