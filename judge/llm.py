"""The LLM side of the judge: one AsyncOpenAI client with a concurrency limit, timeouts, retries,
an LRU cache and failure accounting, against any OpenAI-compatible ``base_url``.

* **Concurrency.** At most ``judge.concurrency`` requests are in flight per process (a semaphore
  held only while a request is on the wire, not during backoff sleeps).
* **Timeouts.** Each attempt is bounded by ``judge.timeout_s`` (the client's own timeout, plus an
  asyncio guard one second later for a server that trickles bytes).
* **Retries.** 429, 5xx, 408/409, timeouts, connection errors, replies that are not valid
  chat-completion JSON and replies the caller cannot parse (no YES/NO, no JSON list) are retried up
  to ``judge.max_retries`` times with exponential backoff ``backoff_s * 2**attempt`` times a
  random factor in [0.5, 1] (a 429's ``Retry-After`` is honoured, capped at 30 s). Other 4xx
  (bad key, unknown model) are not retried. The openai client's own retries are off.
* **Cache.** Identical requests (model + messages) are answered from an LRU of ``judge.cache_size``
  parsed answers; a request identical to one in flight waits for it instead of being sent twice.
  Failures are not cached.
* **Outcome.** :meth:`LLMClient.ask` never raises for endpoint trouble: it returns an
  :class:`Answer` with ``ok=False`` and the reason, and the scorer substitutes the flagged fallback.
* **Wire.** Requests go through ``AsyncOpenAI.post("/chat/completions", ...)``: the client's auth,
  base_url, timeout and error types, without the typed-params transform of
  ``chat.completions.create`` (about 2.5 ms of CPU per request, measured with bench/judge.py).
* **Key.** Read from ``os.environ[judge.api_key_env]``; a dummy key is used when it is unset
  (local endpoints ignore it). It is never logged: log lines carry reasons, and any error text is
  scrubbed of the key before it is logged.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Callable

from worldloop.common.contracts.config import JudgeConfig
from worldloop.common.metrics import metric
from worldloop.common.openai_retry import PermanentError, RetryableError, call_with_retries

log = logging.getLogger(__name__)

DUMMY_KEY = "sk-no-key-set"


@dataclass(frozen=True)
class Answer:
    value: Any  # the parsed reply (ok) or None
    ok: bool
    reason: str | None = None  # why not ok: timeout, http_429, http_500, connection, bad_response, unparseable, ...
    attempts: int = 0
    cached: bool = False
    latency_s: float = 0.0  # wall time of the successful attempt

    @property
    def unparseable(self) -> bool:
        """The endpoint answered but not in the expected format (the agent's text may provoke this)."""
        return not self.ok and self.reason == "unparseable"


def api_key_from_env(cfg: JudgeConfig) -> tuple[str, bool]:
    """(key, True) from ``$judge.api_key_env``, or (a dummy key, False) when it is unset."""
    key = os.environ.get(cfg.api_key_env) or ""
    return (key, True) if key else (DUMMY_KEY, False)


class LLMClient:
    """Asynchronous judge requests; create and use it inside one running event loop."""

    def __init__(self, cfg: JudgeConfig, *, api_key: str | None = None):
        self.cfg = cfg
        key, found = (api_key, True) if api_key else api_key_from_env(cfg)
        if not found:
            log.info("judge: $%s is not set; using a dummy API key (fine for local endpoints)", cfg.api_key_env)
        self._key = key
        # imported here, not at the top: a judge with rule scorers only never loads openai (~1.3 s of CPU)
        from openai import AsyncOpenAI

        self._client = AsyncOpenAI(api_key=key, base_url=cfg.base_url, max_retries=0, timeout=cfg.timeout_s)
        self._sem = asyncio.Semaphore(cfg.concurrency)
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._pending: dict[str, asyncio.Future] = {}
        self.failures = 0  # failed attempts (for the run-wide stats hash)
        self.requests = 0  # attempts sent
        self._m_seconds = metric("worldloop_judge_request_seconds")
        self._m_fail = metric("worldloop_judge_failures")
        self._m_retries = metric("worldloop_judge_retries")
        self._m_hits = metric("worldloop_judge_cache_hits")
        self._m_inflight = metric("worldloop_judge_in_flight")

    # ------------------------------------------------------------------ public

    async def ask(self, messages: list[dict], parse: Callable[[str], Any], scorer: str = "llm") -> Answer:
        """Send ``messages`` (or answer from cache) and return the reply parsed by ``parse``.

        ``parse`` raises ValueError for a reply it cannot use; that is retried like a server error
        and ends as ``Answer(ok=False, reason="unparseable")``.
        """
        key = self._key_of(messages, scorer)
        if self.cfg.cache_size > 0 and key in self._cache:
            self._cache.move_to_end(key)
            self._m_hits.inc()
            return Answer(self._cache[key], True, attempts=0, cached=True)
        waiting = self._pending.get(key)
        if waiting is not None:
            self._m_hits.inc()
            try:
                return replace(await asyncio.shield(waiting), cached=True)
            except asyncio.CancelledError:
                if not waiting.cancelled():
                    raise  # we were cancelled ourselves
                # the first requester was cancelled: send our own request below
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending[key] = fut
        try:
            answer = await self._ask_uncached(messages, parse, scorer)
        except BaseException:
            fut.cancel()
            raise
        finally:
            self._pending.pop(key, None)
        if answer.ok and self.cfg.cache_size > 0:
            self._cache[key] = answer.value
            while len(self._cache) > self.cfg.cache_size:
                self._cache.popitem(last=False)
        fut.set_result(answer)
        return answer

    async def close(self) -> None:
        await self._client.close()

    # ------------------------------------------------------------------ internals

    def _key_of(self, messages: list[dict], scorer: str) -> str:
        blob = json.dumps([self.cfg.model, self.cfg.max_tokens, scorer, messages], sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(blob.encode("utf-8", "surrogatepass")).hexdigest()

    async def _ask_uncached(self, messages: list[dict], parse: Callable[[str], Any], scorer: str) -> Answer:
        async def once() -> tuple[Any, float]:
            text, latency = await self._request(messages, scorer)
            try:
                return parse(text), latency
            except ValueError as e:
                raise RetryableError("unparseable", detail=str(e)) from None

        try:
            (value, latency), attempts = await call_with_retries(
                once, max_retries=self.cfg.max_retries, backoff_s=self.cfg.backoff_s, on_failure=self._count_failure)
        except (RetryableError, PermanentError) as e:
            return Answer(None, False, reason=e.reason, attempts=e.attempts)
        return Answer(value, True, attempts=attempts, latency_s=latency)

    def _count_failure(self, err: RetryableError | PermanentError, attempt: int, will_retry: bool) -> None:
        self.failures += 1
        self._m_fail.labels(reason=err.reason).inc()
        if will_retry:
            self._m_retries.inc()
        log.debug("judge request failed (attempt %d): %s %s", attempt + 1, err.reason, self._scrub(err.detail)[:300])

    def _scrub(self, text: str) -> str:
        return text.replace(self._key, "***") if self._key else text

    async def _request(self, messages: list[dict], scorer: str) -> tuple[str, float]:
        """One attempt: the reply text and its latency (endpoint errors raise; see worldloop.common.openai_retry)."""
        async with self._sem:
            self.requests += 1
            self._m_inflight.inc()
            t0 = time.monotonic()
            try:
                # AsyncOpenAI.post (the client's documented generic call: same auth, base_url, timeouts
                # and error types) with the chat-completions body: chat.completions.create would add
                # ~2.5 ms of CPU per request transforming the typed params, which on a 2-core judge
                # costs a third of the throughput at 64 requests in flight (bench/judge.py)
                resp = await asyncio.wait_for(
                    self._client.post("/chat/completions", cast_to=str, body={
                        "model": self.cfg.model, "messages": messages, "temperature": 0.0,
                        "max_tokens": self.cfg.max_tokens}),
                    timeout=self.cfg.timeout_s + 1.0)
                data = json.loads(resp)  # cast_to=str: the raw body; garbage -> ValueError (retryable)
            finally:
                dt = time.monotonic() - t0
                self._m_inflight.dec()
                self._m_seconds.labels(scorer=scorer).observe(dt)
        try:
            text = data["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise RetryableError("bad_response", detail=f"not a chat completion: {str(data)[:200]}") from None
        if not isinstance(text, str):
            raise RetryableError("bad_response", detail="reply has no text content")
        return text, dt
