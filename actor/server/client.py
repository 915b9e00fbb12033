"""``actor.backend: server``: generation on vLLM inference servers, token-in/token-out over HTTP.

Public API::

    ServerBackend(urls, model_dir, *, max_image_side=224, max_model_len=4096, timeout_s=600.0,
                  retry_s=300.0, startup_timeout_s=900.0, max_lag=None, codec=None, api_key=None,
                  mixed_versions=False)
    ServerBackend.from_config(cfg, model_dir=None) -> ServerBackend
        .version: int            # the lowest weight version among the servers it routes to
        .generate(requests, *, temperature, top_p, max_new_tokens, seed=None) -> list[GenResult]
        .submit(request, *, temperature, top_p, max_new_tokens, seed=None) -> Future[GenResult]
        .servers -> list[ServerState], .close()
    ServerError(RuntimeError)    # a server answered something this client cannot use
    token_versions(spans, n_tokens) -> list[int]   # each output token's version from vLLM's spans
    parse_answer(data, request, codec, *, mixed_versions) -> GenResult | None   # one generate answer

The servers are ``worldloop serve`` processes (:mod:`worldloop.actor.server.launch`): ``vllm serve``
with worldloop's worker extension and middleware, loading every weight version from the
learner's ZeroMQ channel themselves. The actor process therefore fetches no weights for this
backend (``loads_own_weights``). How each convention of :mod:`worldloop.actor.generation` is met:

* **Token ids in, token ids out.** Each request goes to vLLM's ``/inference/v1/generate`` with the
  exact prompt ids (each image's run of ``<|image_pad|>`` collapsed to one pad, as for the
  in-process engine: :func:`~worldloop.actor.vllm_backend.collapse_image_pads`) and the images
  as PNG data URLs (``content_parts``, each with a content hash as its id, so the server's
  multimodal and prefix caches recognise an image sent again on a later turn). The response
  holds the sampled ids and their log-probs (``logprobs: 0``); nothing is retokenised or
  detokenised on the server, and the prompt ids the server ran (``return_token_ids``) must equal
  the request's, or :class:`ServerError` is raised. Sampling fields and seeds are the in-process
  backend's (:func:`~worldloop.actor.vllm_backend.sampling_kwargs`, ``request_seeds``): keyed
  sampling gives each request its key as vLLM seed. The servers' worker extension wraps vLLM's
  sampler as the in-process backend does, so the log-probs follow the same convention.
* **API key.** With one (``serve.api_key_env``/``serve.api_key_file``, the servers' key) every
  request, the ``/worldloop/info`` polls included, carries ``Authorization: Bearer <key>``.
* **Many episodes in flight.** All requests of a call are sent at once (``httpx`` on an asyncio
  loop of the backend's own thread); the servers batch them continuously.
* **Affinity.** Requests carrying the same ``session`` (the rollout engine passes the
  trajectory id) go to the same server while it is usable, so an episode's earlier turns are in
  that server's prefix (KV) cache. A new session goes to the usable server with the fewest
  requests in flight.
* **Versions.** vLLM tags each output token with the weight version that sampled it and returns
  the spans (:func:`token_versions` reads them). With ``actor.weight_update: interrupt`` (the
  default) a server loads a version while requests are in flight, so a response may span two:
  the result carries each token's version (``GenResult.token_versions``, None when there is one)
  and ``version`` = the oldest, which the turn records. With ``wait`` the middleware loads versions
  only while generation is drained, and a response whose tokens came from two versions (a server
  configured otherwise) is discarded and generated again
  (metric ``worldloop_actor_server_retries{reason="mixed_versions"}``).
* **One request at a time.** :meth:`ServerBackend.submit` sends one request and returns a future:
  the per-episode loop (:mod:`worldloop.actor.episodes`) sends each episode's turn on its own.
* **Servers behind.** Every second the backend reads each server's ``/worldloop/info`` (ready,
  version, fingerprint). A server whose version is more than ``max_lag``
  (``trainer.max_staleness``) behind the newest server's is skipped until it catches up;
  ``version`` is the lowest version among the usable servers, so rollout admission (which takes
  the lower of the learner's version and the actor's) bounds the staleness of what they sample.
* **A server that dies.** A request that fails on the transport (refused, reset, timed out) or
  with a 5xx answer marks its server down (the poll brings it back) and is sent again, as a
  whole (the context is in the request), to another usable server, or to the same one once it
  is back, for up to ``retry_s``. After that the result carries ``error`` and the rollout engine
  drops the episode (``end_reason`` ``server_error``, no turns), so the actor refunds its
  admission: nothing is pushed twice and nothing admitted is leaked.
* **Start.** The backend waits up to ``startup_timeout_s`` for a server to be ready and refuses,
  with :class:`~worldloop.common.contracts.config.ConfigError` on ``actor.servers`` naming the server and the
  reason, any server whose tokenizer or model differs from ``model_dir``'s
  (:func:`~worldloop.actor.server.fingerprint.fingerprint_mismatch`) or whose ``max_model_len`` is
  smaller than the actor's. A server that turns up later with such a difference is never used
  (logged).
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import hashlib
import logging
import random
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worldloop.actor.generation import GenRequest, GenResult, WeightUpdateError, cut_at_eos, validate_requests
from worldloop.actor.server.fingerprint import fingerprint_mismatch, model_fingerprint
from worldloop.actor.vllm_backend import collapse_image_pads, request_seeds, sampling_kwargs
from worldloop.common.contracts.config import ConfigError
from worldloop.common.metrics import metric
from worldloop.common.contracts.modeling import ChatCodec
from worldloop.common.secrets import server_api_key

if TYPE_CHECKING:
    from worldloop.common.contracts.config import Config

log = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request in the actor's log

GENERATE_PATH = "/inference/v1/generate"
INFO_PATH = "/worldloop/info"
POLL_S = 1.0
MAX_SESSIONS = 1 << 16  # affinity entries kept (oldest forgotten first)


class ServerError(RuntimeError):
    """A server answered something this client cannot use (not a transient failure)."""


def token_versions(spans: list[dict], n_tokens: int, i: int = 0) -> list[int]:
    """The weight version of each of ``n_tokens`` output tokens from vLLM's ``weight_versions``
    spans (``{"version", "start", "end"}``: tokens ``[start, end)``); ServerError unless the spans
    cover the tokens exactly, in order, with integer versions."""
    out: list[int] = []
    for s in spans:
        try:
            version, start, end = int(s["version"]), int(s["start"]), int(s["end"])
        except (KeyError, TypeError, ValueError):
            raise ServerError(f"request {i}: a weight-version span {s!r} is not {{version, start, end}} with integers") from None
        if start != len(out) or end < start:
            raise ServerError(f"request {i}: weight-version spans do not tile the output ({spans!r})")
        out += [version] * (end - start)
    if len(out) != n_tokens:
        raise ServerError(f"request {i}: weight-version spans cover {len(out)} of {n_tokens} output tokens")
    return out


@dataclass
class ServerState:
    url: str
    ready: bool = False
    up: bool = False
    version: int = 0
    refused: str | None = None  # why this server is never used
    in_flight: int = 0
    last_error: str | None = None
    vocab_size: int | None = None

    def usable(self, floor: int) -> bool:
        return self.up and self.ready and self.refused is None and self.version >= floor


def _image_part(png: bytes) -> dict:
    return {"type": "image_url", "url": "data:image/png;base64," + base64.b64encode(png).decode(),
            "uuid": hashlib.sha256(png).hexdigest()[:32]}


class ServerBackend:
    """Generation on inference servers over HTTP (see the module docstring)."""

    loads_own_weights = True  # the servers follow the weight channel; the actor fetches nothing

    def __init__(self, urls: list[str], model_dir: str | Path, *, max_image_side: int = 224, max_model_len: int = 4096,
                 timeout_s: float = 600.0, retry_s: float = 300.0, startup_timeout_s: float = 900.0,
                 max_lag: int | None = None, codec: ChatCodec | None = None, api_key: str | None = None,
                 mixed_versions: bool = False):
        if not urls:
            raise ConfigError("actor.servers", "actor.backend=server needs the URL of at least one inference server")
        import httpx

        self.codec = codec or ChatCodec(model_dir, max_image_side=max_image_side)
        self.servers = [ServerState(u.rstrip("/")) for u in urls]
        self.max_model_len = int(max_model_len)
        self.timeout_s, self.retry_s = float(timeout_s), float(retry_s)
        self.max_lag = max_lag
        self.mixed_versions = bool(mixed_versions)  # actor.weight_update=interrupt: a response may span versions
        self._api_key = api_key  # sent as "Authorization: Bearer <key>" on every request, never logged
        self._fingerprint = model_fingerprint(model_dir)
        self._sessions: OrderedDict[str, ServerState] = OrderedDict()
        self._version = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="server-backend", daemon=True)
        self._thread.start()
        self._closed = False
        try:
            self._http = self._call(self._make_client(httpx))
            self._call(self._wait_for_servers(startup_timeout_s))
        except BaseException:
            self.close()
            raise
        self._poller = asyncio.run_coroutine_threadsafe(self._poll_forever(), self._loop)

    @classmethod
    def from_config(cls, cfg: "Config", model_dir: str | None = None) -> "ServerBackend":
        a = cfg.actor
        return cls(a.servers, model_dir or cfg.model.path, max_image_side=cfg.model.max_image_side,
                   max_model_len=cfg.model.max_model_len, timeout_s=a.server_timeout_s, retry_s=a.server_retry_s,
                   startup_timeout_s=a.server_startup_timeout_s, max_lag=cfg.trainer.max_staleness,
                   api_key=server_api_key(cfg), mixed_versions=a.weight_update == "interrupt")

    # ------------------------------------------------------------------ plumbing

    async def _make_client(self, httpx: Any) -> Any:
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else None
        return httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s, connect=5.0), headers=headers,
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def version(self) -> int:
        """The lowest weight version among the servers this backend routes new sessions to."""
        floor = self._floor()
        usable = [s.version for s in self.servers if s.usable(floor)]
        if usable:
            self._version = min(usable)
        return self._version

    def _floor(self) -> int:
        """Servers more than ``max_lag`` versions behind the newest ready one are skipped."""
        versions = [s.version for s in self.servers if s.up and s.ready and s.refused is None]
        if not versions or self.max_lag is None:
            return 0
        return max(versions) - int(self.max_lag)

    # ------------------------------------------------------------------ server states

    async def _poll(self, s: ServerState) -> None:
        try:
            resp = await self._http.get(s.url + INFO_PATH, timeout=5.0)
            info = resp.json() if resp.status_code == 200 else None
        except Exception as e:  # down, restarting, not a worldloop server yet: try again at the next poll
            s.up, s.ready, s.last_error = False, False, f"{type(e).__name__}: {e}"
            return
        if not isinstance(info, dict) or "ready" not in info:
            s.up, s.ready, s.last_error = False, False, f"{INFO_PATH} answered {resp.status_code}: not a worldloop server"
            return
        s.up, s.ready = True, bool(info["ready"]) and not info.get("error")
        s.last_error = info.get("error")
        if s.ready:
            s.version = int(info["version"])
            s.vocab_size = info.get("vocab_size")
            s.refused = self._refusal(info)

    def _refusal(self, info: dict) -> str | None:
        why = fingerprint_mismatch(self._fingerprint, info.get("fingerprint") or {})
        if why is None and int(info.get("max_model_len", 0)) < self.max_model_len:
            why = (f"it serves max_model_len {info.get('max_model_len')}, less than the actor's "
                   f"model.max_model_len {self.max_model_len}")
        return why

    async def _wait_for_servers(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            await asyncio.gather(*(self._poll(s) for s in self.servers))
            refused = [s for s in self.servers if s.refused]
            if refused:
                s = refused[0]
                raise ConfigError("actor.servers", f"inference server {s.url} refused: {s.refused}")
            if any(s.ready for s in self.servers):
                log.info("inference servers: %s", ", ".join(
                    f"{s.url} ({'v%d' % s.version if s.ready else 'not ready'})" for s in self.servers))
                return
            if time.monotonic() > deadline:
                why = "; ".join(f"{s.url}: {s.last_error or 'not ready'}" for s in self.servers)
                raise ConfigError("actor.servers", f"no inference server was ready within {timeout_s:.0f} s ({why})")
            await asyncio.sleep(POLL_S)

    async def _poll_forever(self) -> None:
        said: dict[str, str | None] = {}  # the refusal last logged per server
        while True:
            await asyncio.gather(*(self._poll(s) for s in self.servers))
            for s in self.servers:
                if s.refused and said.get(s.url) != s.refused:
                    log.error("inference server %s is not used: %s", s.url, s.refused)
                said[s.url] = s.refused
            await asyncio.sleep(POLL_S)

    async def _route(self, session: str, deadline: float) -> ServerState | None:
        """The server for ``session``: its own while usable, else the least busy usable one; waits
        until one is usable or ``deadline`` (None then)."""
        while True:
            floor = self._floor()
            mine = self._sessions.get(session)
            if mine is not None and mine.usable(floor):
                self._sessions.move_to_end(session)
                return mine
            usable = [s for s in self.servers if s.usable(floor)]
            if usable:
                least = min(s.in_flight for s in usable)
                pick = random.choice([s for s in usable if s.in_flight == least])
                self._sessions[session] = pick
                self._sessions.move_to_end(session)
                while len(self._sessions) > MAX_SESSIONS:
                    self._sessions.popitem(last=False)
                return pick
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))

    # ------------------------------------------------------------------ generation

    def generate(self, requests: list[GenRequest], *, temperature: float, top_p: float, max_new_tokens: int,
                 seed: int | None = None) -> list[GenResult]:
        """Generate one response per request, all requests in flight at once."""
        if not requests:
            return []
        bodies = self._bodies(requests, temperature, top_p, max_new_tokens, seed)
        return self._call(self._generate_all(requests, bodies))

    def submit(self, request: GenRequest, *, temperature: float, top_p: float, max_new_tokens: int,
               seed: int | None = None) -> "concurrent.futures.Future[GenResult]":
        """Send one request now; the future holds its result (the per-episode loop: actor/episodes.py)."""
        body = self._bodies([request], temperature, top_p, max_new_tokens, seed)[0]
        return asyncio.run_coroutine_threadsafe(self._generate_one(0, request, body), self._loop)

    def _bodies(self, requests: list[GenRequest], temperature: float, top_p: float, max_new_tokens: int,
                seed: int | None) -> list[dict]:
        vocab = next((s.vocab_size for s in self.servers if s.vocab_size), None) or len(self.codec.tokenizer)
        validate_requests(requests, max_new_tokens, vocab)
        bodies = []
        for i, (req, req_seed) in enumerate(zip(requests, request_seeds(requests, seed))):
            if len(req.prompt_ids) >= self.max_model_len:
                raise ValueError(f"request {i}: prompt of {len(req.prompt_ids)} tokens leaves no room under "
                                 f"max_model_len {self.max_model_len}")
            bodies.append(self._body(i, req, sampling_kwargs(temperature, top_p, max_new_tokens,
                                                              self.codec.eos_token_ids, req_seed,
                                                              self.codec.prompt_only_tokens)))
        return bodies

    async def _generate_all(self, requests: list[GenRequest], bodies: list[dict]) -> list[GenResult]:
        return list(await asyncio.gather(*(self._generate_one(i, r, b) for i, (r, b) in enumerate(zip(requests, bodies)))))

    def _body(self, i: int, req: GenRequest, params: dict) -> dict:
        if self.codec.is_vision:
            try:
                ids = collapse_image_pads(req.prompt_ids, req.images, self.codec)
            except ValueError as e:
                raise ValueError(f"request {i}: {e}") from None
            parts = [_image_part(bytes(png)) for png in req.images]
        else:  # a text-only model ignores images, as the other backends do
            ids, parts = [int(t) for t in req.prompt_ids], []
        body = {"token_ids": ids, "sampling_params": params, "return_token_ids": True, "output_mode": "tokens"}
        if parts:
            body["content_parts"] = parts
        return body

    async def _generate_one(self, i: int, req: GenRequest, body: dict) -> GenResult:
        session = req.session or uuid.uuid4().hex
        deadline = time.monotonic() + self.retry_s
        while True:
            server = await self._route(session, deadline)
            if server is None:
                why = "; ".join(f"{s.url}: {s.refused or s.last_error or 'behind'}" for s in self.servers)
                log.warning("request %d: no usable inference server for %.0f s (%s); the episode is dropped",
                            i, self.retry_s, why)
                return GenResult([], [], "", False, error=f"no usable inference server within {self.retry_s:.0f} s")
            data = await self._post(server, body)
            if data is None:
                metric("worldloop_actor_server_retries").labels(reason="server_failed").inc()
                continue
            result = self._result(i, req, data)
            if result is None:
                metric("worldloop_actor_server_retries").labels(reason="mixed_versions").inc()
                continue
            return result

    async def _post(self, server: ServerState, body: dict) -> dict | None:
        """The server's JSON answer; None (server marked down) on a transport failure or a 5xx."""
        import httpx

        server.in_flight += 1
        try:
            resp = await self._http.post(server.url + GENERATE_PATH, json=body)
        except httpx.HTTPError as e:
            server.up, server.last_error = False, f"{type(e).__name__}: {e}"
            log.warning("inference server %s failed (%s); sending the request again", server.url, server.last_error)
            return None
        finally:
            server.in_flight -= 1
        if resp.status_code >= 500:
            server.up, server.last_error = False, f"HTTP {resp.status_code}: {resp.text[:200]}"
            log.warning("inference server %s failed (%s); sending the request again", server.url, server.last_error)
            return None
        if resp.status_code != 200:
            raise ServerError(f"inference server {server.url} refused a request: HTTP {resp.status_code}: {resp.text[:500]}")
        return resp.json()

    def _result(self, i: int, req: GenRequest, data: dict) -> GenResult | None:
        return parse_answer(data, req, self.codec, mixed_versions=self.mixed_versions, i=i)

    # ------------------------------------------------------------------ contract

    def update_weights(self, tensors: dict, version: int) -> None:
        raise WeightUpdateError("actor.backend=server: the inference servers load weights from the channel themselves")

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        poller = getattr(self, "_poller", None)
        if poller is not None:
            poller.cancel()
        try:
            if hasattr(self, "_http"):
                self._call(self._http.aclose())
        except Exception as e:  # best effort: the process may be exiting
            log.debug("closing the HTTP client: %s", e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)


def parse_answer(data: dict, req: GenRequest, codec: ChatCodec, *, mixed_versions: bool, i: int = 0) -> GenResult | None:
    """The request's result from a ``/inference/v1/generate`` answer; None when its tokens came from
    two versions and ``mixed_versions`` is off (the caller generates it again); ServerError when the
    answer does not fit the request."""
    choice = data["choices"][0]
    spans = choice.get("weight_versions") or []
    versions = {str(s["version"]) for s in spans}
    if len(versions) > 1 and not mixed_versions:
        log.warning("request %d: tokens from weight versions %s in one response; generating it again", i, sorted(versions))
        return None
    if not versions:
        raise ServerError(f"request {i}: the server said no weight version for its tokens (is it a worldloop serve server?)")
    if list(data.get("prompt_token_ids") or []) != [int(t) for t in req.prompt_ids]:
        raise ServerError(f"request {i}: the server ran other prompt ids than requested (image expansion mismatch)")
    ids = [int(t) for t in choice["token_ids"]]
    keep, truncated = cut_at_eos(ids, codec.eos_token_ids)
    content = (choice.get("logprobs") or {}).get("content") or []
    logprobs = [float(c["logprob"]) for c in content[: len(keep)]]
    if len(logprobs) != len(keep) or any(int(c["token_id"]) != t for c, t in zip(content, keep)):
        raise ServerError(f"request {i}: the server returned {len(logprobs)} log-probs for {len(keep)} tokens")
    per_token = token_versions(spans, len(ids), i)[: len(keep)]
    return GenResult(response_ids=keep, logprobs=logprobs, text=codec.decode(keep), truncated=truncated,
                     version=min(per_token, default=int(min(versions, key=int))),
                     token_versions=per_token if len(set(per_token)) > 1 else None)
