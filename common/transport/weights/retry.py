"""How a weight-fetching thread takes its errors: the actor's ``WeightFetcher`` and the inference
server's ``WeightSync`` (``actor/server/extension.py``) share :class:`FetchErrors`.

* A :class:`~worldloop.common.transport.weights.WeightsError` (a corrupt chunk, a timeout, a learner that went
  away mid-fetch) is the channel's: retried for ever, as long as the learner takes to come back.
* A system error (``zmq.ZMQError``, e.g. ``EMFILE``: too many open files; any ``OSError``) may pass:
  retried too, with the same backoff, but ``max_errors`` of them in a row are fatal.
* Any other exception (a bug) is fatal at once.

Retries wait ``retry_s`` doubling up to ``retry_max_s``; every failure counts in the caller's
metric (``reason``: ``fetch`` for a channel error, ``fetch_error`` for a system error). A fatal
error is logged with its cause and kept in :attr:`FetchErrors.fatal`; the thread then ends and its
owner stops the process with a non-zero exit, so that the supervisor restarts it. Before, both
threads caught ``WeightsError`` only: one ``ZMQError(EMFILE)`` ended the thread silently and the
actor generated on old weights until admission blocked it for ever.
"""

from __future__ import annotations

import logging
from typing import Callable

import zmq

from worldloop.common.transport.weights.codec import WeightsError

log = logging.getLogger(__name__)

SYSTEM_ERRORS = (zmq.ZMQError, OSError)


class FetchErrors:
    """The retry policy of one fetching thread (see the module docstring)."""

    def __init__(self, what: str, count: Callable[[str], None], *, retry_s: float = 1.0, retry_max_s: float = 30.0,
                 max_errors: int = 10):
        self.what = what  # names the thread in log lines ("actor weights", "server weights")
        self.count = count  # count(reason): the caller's failure metric
        self.retry_s, self.retry_max_s, self.max_errors = float(retry_s), float(retry_max_s), int(max_errors)
        self.in_a_row = 0  # failures since the last success
        self.system_in_a_row = 0  # system errors since the last success
        self.fatal: BaseException | None = None

    def ok(self) -> None:
        """A fetch (or a poll) went through: the backoff starts again."""
        self.in_a_row = self.system_in_a_row = 0

    def failed(self, e: BaseException, version: int | None) -> float | None:
        """Count ``e``; the seconds to wait before the next try, or None when it is fatal (then
        :attr:`fatal` holds it and the thread must end)."""
        self.in_a_row += 1
        wait = min(self.retry_max_s, self.retry_s * 2 ** min(self.in_a_row - 1, 30))
        if isinstance(e, WeightsError):
            self.count("fetch")
            log.warning("%s: fetching v%s failed (%s); retrying in %.1f s", self.what, version, e, wait)
            return wait
        if isinstance(e, SYSTEM_ERRORS):
            self.count("fetch_error")
            self.system_in_a_row += 1
            if self.system_in_a_row < self.max_errors:
                log.warning("%s: %s: %s (%d in a row); retrying in %.1f s", self.what, type(e).__name__, e,
                            self.system_in_a_row, wait)
                return wait
        else:
            self.count("fetch_error")
        self.fatal = e
        log.error("%s: the weight fetching thread stops on %s: %s%s; the process exits so that its supervisor "
                  "restarts it", self.what, type(e).__name__, e,
                  f" ({self.system_in_a_row} system errors in a row)" if isinstance(e, SYSTEM_ERRORS) else "",
                  exc_info=e)
        return None


class WeightFetchFailed(RuntimeError):
    """The weight fetching thread stopped on a fatal error (the message names it)."""

    @classmethod
    def of(cls, what: str, e: BaseException) -> "WeightFetchFailed":
        return cls(f"{what}: weight fetching stopped on {type(e).__name__}: {e}; exiting so that the supervisor "
                   "restarts this process (it would generate on old weights for ever)")
