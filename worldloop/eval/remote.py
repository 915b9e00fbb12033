"""``worldloop eval`` against an OpenAI-compatible chat endpoint (message-level episode loop).

Public API::

    ChatEndpoint(base_url, model, *, api_key, concurrency, timeout_s, max_retries, backoff_s)
        await .check()                                  # EndpointError when nothing answers at base_url
        await .complete(messages, *, max_tokens, temperature, top_p) -> Completion
        await .close()
    Completion(text, finish_reason, attempts)
    RequestFailed(reason, attempts)                     # raised by complete() once retries are spent
    EndpointError(RuntimeError)
    user_content(text, image) -> str | list[dict]       # env observation -> chat message content
    png_data_url(image) -> str                          # "data:image/png;base64,..."
    await play_episode(endpoint, env, seed, *, max_turns, max_tokens, temperature, top_p) -> dict

The conversation is the one a chat model sees in the VAGEN appendix: a system message with
``env.unwrapped.system_prompt()``, then per turn a user message with the observation text, where
the ``<image>`` placeholder becomes an ``image_url`` part holding the rendered frame as a PNG data
URL (text-mode observations are sent as plain strings), and the model's reply appended as an
assistant message, so every request carries the whole history.

Requests: at most ``concurrency`` in flight (a semaphore held only while a request is on the wire);
each attempt bounded by ``timeout_s``; 429 (``Retry-After`` honoured, capped at 30 s), 5xx, 408/409,
timeouts, connection errors and replies that are not a chat completion are retried up to
``max_retries`` times with backoff ``backoff_s * 2**attempt`` (times a random factor in [0.5, 1]);
other 4xx are not. The openai client's own retries are off. The API key is passed in by the
caller (read from an environment variable there) and scrubbed from every error text.
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import openai
from openai import AsyncOpenAI

from worldloop.envs.base import IMAGE_PLACEHOLDER  # == worldloop.common.contracts.modeling.IMAGE_PLACEHOLDER (no torch import here)
from worldloop.common.openai_retry import PermanentError, RetryableError, call_with_retries

log = logging.getLogger(__name__)

class EndpointError(RuntimeError):
    """The endpoint cannot be reached at all (refused, unknown host, no answer)."""


class RequestFailed(Exception):
    def __init__(self, reason: str, attempts: int):
        super().__init__(reason)
        self.reason, self.attempts = reason, attempts


@dataclass
class Completion:
    text: str
    finish_reason: str | None
    attempts: int


def png_data_url(image: np.ndarray) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(image, dtype=np.uint8)).convert("RGB").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def user_content(text: str, image: np.ndarray | None) -> str | list[dict]:
    """The content of a user message: text parts around one ``image_url`` part per placeholder."""
    if image is None or IMAGE_PLACEHOLDER not in text:
        return text.replace(IMAGE_PLACEHOLDER, "")
    url = png_data_url(image)
    parts: list[dict] = []
    pieces = text.split(IMAGE_PLACEHOLDER)
    for i, piece in enumerate(pieces):
        if piece:
            parts.append({"type": "text", "text": piece})
        if i < len(pieces) - 1:
            parts.append({"type": "image_url", "image_url": {"url": url}})
    return parts


class ChatEndpoint:
    """Chat completions with a concurrency limit, timeouts and retries; use inside one event loop."""

    def __init__(self, base_url: str, model: str, *, api_key: str, concurrency: int = 8, timeout_s: float = 120.0,
                 max_retries: int = 4, backoff_s: float = 1.0):
        self.base_url, self.model = base_url, model
        self.timeout_s, self.max_retries, self.backoff_s = float(timeout_s), int(max_retries), float(backoff_s)
        self._key = api_key
        self._client = AsyncOpenAI(api_key=api_key, base_url=base_url, max_retries=0, timeout=timeout_s)
        self._sem = asyncio.Semaphore(concurrency)
        self.requests = 0  # attempts sent
        self.retries = 0

    def scrub(self, text: str) -> str:
        return text.replace(self._key, "***") if self._key else text

    async def check(self) -> None:
        """Raise EndpointError unless something answers HTTP at ``base_url`` (any status is fine)."""
        try:
            await asyncio.wait_for(self._client.models.list(), timeout=min(self.timeout_s, 30.0) + 1.0)
        except openai.APIStatusError:
            return  # it answered (an endpoint without /models, a bad key: the requests will tell)
        except (openai.APIConnectionError, openai.APITimeoutError, asyncio.TimeoutError) as e:
            raise EndpointError(f"cannot reach the endpoint at {self.base_url}: "
                                f"{self.scrub(str(e) or type(e).__name__)}") from None

    async def close(self) -> None:
        await self._client.close()

    async def complete(self, messages: list[dict], *, max_tokens: int, temperature: float, top_p: float = 1.0) -> Completion:
        def on_failure(err: RetryableError | PermanentError, attempt: int, will_retry: bool) -> None:
            log.debug("request to %s failed (attempt %d): %s %s", self.base_url, attempt + 1, err.reason,
                      self.scrub(err.detail)[:300])
            self.retries += int(will_retry)

        try:
            (text, finish), attempts = await call_with_retries(
                lambda: self._attempt(messages, max_tokens, temperature, top_p),
                max_retries=self.max_retries, backoff_s=self.backoff_s, on_failure=on_failure)
        except PermanentError as e:
            raise RequestFailed(f"{e.reason}: {self.scrub(e.detail)[:200]}", e.attempts) from None
        except RetryableError as e:
            raise RequestFailed(e.reason, e.attempts) from None
        return Completion(text, finish, attempts)

    async def _attempt(self, messages: list[dict], max_tokens: int, temperature: float, top_p: float) -> tuple[str, str | None]:
        kwargs: dict[str, Any] = dict(model=self.model, messages=messages, max_tokens=int(max_tokens),
                                      temperature=float(temperature))
        if top_p < 1.0:  # some endpoints refuse temperature and top_p together; 1.0 is everyone's default
            kwargs["top_p"] = float(top_p)
        async with self._sem:
            self.requests += 1
            # endpoint errors propagate to call_with_retries, which classifies them
            resp = await asyncio.wait_for(self._client.chat.completions.create(**kwargs), timeout=self.timeout_s + 1.0)
        try:
            choice = resp.choices[0]
            text = choice.message.content
        except (AttributeError, IndexError, TypeError):
            raise RetryableError("bad_response", detail=f"not a chat completion: {str(resp)[:200]}") from None
        return (text if isinstance(text, str) else ""), getattr(choice, "finish_reason", None)


# --------------------------------------------------------------------------- episode loop


def turn_record(index: int, prompt: str, n_images: int, response: str, info: dict, reward: float, done: bool,
                truncated_response: bool) -> dict:
    """One turn of the transcript in ``episodes.jsonl`` (shared by the remote and local paths)."""
    return {
        "index": index, "prompt": prompt, "images": n_images, "response": response,
        "truncated_response": bool(truncated_response),
        "format_ok": bool(info.get("format_ok", False)), "reason": info.get("reason"),
        "actions": list(info.get("actions") or []),
        "actions_executed": int(info.get("actions_executed", 0)),
        "actions_effective": int(info.get("actions_effective", 0)),
        "env_reward": float(info.get("env_reward", 0.0)), "format_reward": float(info.get("format_reward", 0.0)),
        "reward": float(reward), "done": bool(done), "success": bool(info.get("success", False)),
        "metrics": dict(info.get("metrics") or {}),
    }


async def play_episode(endpoint: ChatEndpoint, env: Any, seed: int, *, max_turns: int, max_tokens: int,
                       temperature: float, top_p: float = 1.0) -> dict:
    """Play one episode; return the record fields it determines (task, success, metrics, turns, error)."""
    t0 = time.monotonic()
    obs, info = await asyncio.to_thread(env.reset, seed=seed)
    system = env.unwrapped.system_prompt()
    messages: list[dict] = [{"role": "system", "content": system}]
    turns: list[dict] = []
    out = {"task": info.get("task"), "success": bool(info.get("success", False)),
           "metrics": dict(info.get("metrics") or {}), "system_prompt": system, "error": None, "requests": 0,
           "end_reason": "max_turns"}
    for t in range(max_turns):
        messages.append({"role": "user", "content": user_content(obs["text"], obs.get("image"))})
        try:
            comp = await endpoint.complete(messages, max_tokens=max_tokens, temperature=temperature, top_p=top_p)
        except RequestFailed as e:
            out["requests"] += e.attempts
            out["error"] = e.reason
            out["end_reason"] = "error"
            break
        out["requests"] += comp.attempts
        prompt_text, n_img = obs["text"], int(obs.get("image") is not None)
        obs, reward, terminated, truncated, info = await asyncio.to_thread(env.step, comp.text)
        messages.append({"role": "assistant", "content": comp.text})
        done = bool(terminated or truncated)
        turns.append(turn_record(t, prompt_text, n_img, comp.text, info, reward, done, comp.finish_reason == "length"))
        out.update(success=bool(info.get("success", False)), metrics=dict(info.get("metrics") or {}))
        if done:
            out["end_reason"] = "done"
            break
    out["turns"] = turns
    out["time_s"] = round(time.monotonic() - t0, 3)
    return out
