"""Retries for OpenAI-compatible endpoints, shared by the judge (``judge/llm.py``) and ``worldloop eval``.

Public API::

    RetryableError(reason, retry_after=None, detail="")   # worth another attempt
    PermanentError(reason, detail="")                      # another attempt would fail the same way
    classify(exc) -> RetryableError | PermanentError | None
    await call_with_retries(attempt, *, max_retries, backoff_s, on_failure=None, sleep=asyncio.sleep) -> (value, attempts)

Taxonomy (``classify``): timeouts, connection errors, 429 (its ``Retry-After`` honoured, capped at
``RETRY_AFTER_CAP_S``), 5xx, 408/409, and bodies that are not a valid response are retryable; any
other HTTP status (a bad key, an unknown model, a malformed request) is permanent; an exception
that is none of these is not ours to classify (None: the caller re-raises it).

Backoff: ``backoff_s * 2**attempt`` times a random factor in [0.5, 1], at least the server's
``Retry-After``. The openai client's own retries should be off (``max_retries=0``) so that these
are the only ones. The waits go through ``sleep`` (``asyncio.sleep``; a test passes one that
records the delays it is asked for, an explicit clock instead of a measured one).
"""

from __future__ import annotations

import asyncio
import random
from typing import TYPE_CHECKING, Any, Awaitable, Callable

if TYPE_CHECKING:  # the package is imported where an error is classified: a judge with rule scorers only never loads it
    import openai

RETRY_AFTER_CAP_S = 30.0


class RetryableError(Exception):
    def __init__(self, reason: str, retry_after: float | None = None, detail: str = ""):
        super().__init__(reason)
        self.reason, self.retry_after, self.detail = reason, retry_after, detail
        self.attempts = 0  # set by call_with_retries when it gives up


class PermanentError(Exception):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason, self.detail = reason, detail
        self.attempts = 0


def _retry_after(e: openai.APIStatusError) -> float | None:
    try:
        value = e.response.headers.get("retry-after")
        return float(value) if value is not None else None
    except (AttributeError, TypeError, ValueError):
        return None


def classify(e: BaseException) -> RetryableError | PermanentError | None:
    """The retry class of an exception raised by one request (None: not an endpoint error)."""
    if isinstance(e, (RetryableError, PermanentError)):
        return e
    # ~1.3 s of CPU on first import: loaded once, by the first error of a process that talks to an endpoint
    import openai

    if isinstance(e, (openai.APITimeoutError, asyncio.TimeoutError)):
        return RetryableError("timeout")
    if isinstance(e, openai.APIStatusError):
        code, detail = e.status_code, str(getattr(e, "message", "") or "")
        if code == 429:
            return RetryableError("http_429", _retry_after(e), detail)
        if code >= 500 or code in (408, 409):
            return RetryableError(f"http_{code}", None, detail)
        return PermanentError(f"http_{code}", detail)
    if isinstance(e, openai.APIConnectionError):
        return RetryableError("connection", detail=str(e))
    if isinstance(e, (openai.APIResponseValidationError, ValueError, TypeError)):  # e.g. a non-JSON body
        return RetryableError("bad_response", detail=f"{type(e).__name__}: {e}")
    if isinstance(e, openai.OpenAIError):
        return RetryableError("error", detail=f"{type(e).__name__}: {e}")
    return None


async def call_with_retries(
    attempt: Callable[[], Awaitable[Any]],
    *,
    max_retries: int,
    backoff_s: float,
    on_failure: Callable[[RetryableError | PermanentError, int, bool], None] | None = None,
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
) -> tuple[Any, int]:
    """``(await attempt(), attempts)``, retrying what :func:`classify` calls retryable.

    ``on_failure(error, attempt_index, will_retry)`` sees every failed attempt. When it gives up,
    the last :class:`RetryableError` or :class:`PermanentError` is raised with ``.attempts`` set;
    an exception that is not an endpoint error propagates at once.
    """
    for i in range(max_retries + 1):
        try:
            return await attempt(), i + 1
        except Exception as e:  # classified below; anything else re-raised unchanged
            err = classify(e)
            if err is None:
                raise
        retry = isinstance(err, RetryableError) and i < max_retries
        if on_failure is not None:
            on_failure(err, i, retry)
        if not retry:
            err.attempts = i + 1
            raise err from None
        delay = backoff_s * (2 ** i) * random.uniform(0.5, 1.0)
        if err.retry_after is not None:
            delay = max(delay, min(err.retry_after, RETRY_AFTER_CAP_S))
        await sleep(delay)
    raise AssertionError("unreachable")  # the loop returns or raises
