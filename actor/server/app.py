"""The API-server side of worldloop's inference servers: an ASGI middleware (``vllm serve --middleware``).

    WorldloopMiddleware(app)     # vLLM adds it to its FastAPI app; one per server
    GET /worldloop/info -> {"ready", "error", "version", "updates", "requests", "channel", "fingerprint",
                            "model", "max_model_len", "vocab_size"}

What it adds to vLLM's own server (``/inference/v1/generate``, ``/metrics``, ``/health``, ...):

* **Start-up.** Once the app has started, a driver task calls the worker extension's
  ``worldloop_setup`` (log-prob convention, weight subscriber: :mod:`.extension`), computes the
  served model's fingerprint (:mod:`.fingerprint`), labels the engine's weights ``"0"``
  (vLLM's ``update_weight_version``), loads the version the learner announces if one does within
  ``ANNOUNCE_WAIT_S`` (a server restarted mid-run does not answer from ``model.path``'s weights),
  and only then lets generation requests through: before that ``/inference/*`` and ``/v1/*``
  answer 503, so no request is sampled with vLLM's own log-prob convention or stale weights.
* **Weights, in flight or between requests** (``actor.weight_update``). Every ``POLL_S`` the
  driver asks the workers for the version they fetched (``worldloop_staged``). When every worker
  holds the same new version it pauses generation, loads the version (``worldloop_apply``),
  clears the prefix, encoder and multimodal caches, sets the engine's weight version to it and
  resumes. ``interrupt`` (the default) pauses with vLLM's ``pause_generation(mode="keep")``:
  requests in flight are frozen, not drained, and the cache reset preempts them
  (``reset_running_requests``), so on resume each recomputes its KV (prompt and tokens so far)
  under the new weights and goes on sampling with them. ``wait`` pauses with ``mode="wait"``:
  requests in flight finish on the old weights first. vLLM tags every output token with the
  engine's weight version at the step that sampled it and returns the spans in each response
  (``choices[].weight_versions``): that is how each response says which version made each of
  its tokens (with ``wait``, a response has one span).
  A set the model rejects (names or shapes) is logged and counted, and the old weights stay.
* **LoRA** (``model.lora.rank`` > 0). The base weights are never changed: each version is an
  adapter-only set that the workers load in place as the server's one LoRA adapter
  (:data:`~.extension.ADAPTER_NAME`, :mod:`.extension`). At set-up the driver registers the
  workers' version-0 adapter (zeros: the base model) with vLLM's served models
  (``load_lora_adapter``), and after each load points that registration at the new version's
  folder (same LoRA id, ``load_inplace`` off, so requests never reload it). The middleware names
  the adapter in every generation request's JSON body (``ADAPTER_PATHS``) whose ``model`` is absent or the base
  model's name, so every response comes from the adapter of the version it is labelled with;
  pausing, cache resets, ``interrupt``/``wait`` and the version labels are those of full weights
  (an in-flight request holds the adapter's id, whose weights the load replaced).
  Fetching runs in the workers' own thread, so the learner never waits for a server, and
  generation pauses only for the load itself (plus the drain).
* **Metrics and discovery.** ``worldloop_server_*`` metrics (version, updates, pause seconds,
  failures, CPU seconds with the engine and workers: :func:`server_cpu_seconds`) join vLLM's on the
  server's ``/metrics``. With ``redis.url`` in the config the server
  heartbeats in ``{ns}:procs`` as role ``server`` with that ``/metrics`` URL
  (:class:`~worldloop.common.transport.process.ProcessScaffold`, heartbeat only), so ``worldloop sd`` hands it
  to Prometheus like every other process of the run.
* **API key.** With ``$VLLM_API_KEY`` set (``worldloop serve`` sets it from ``serve.api_key_*``),
  vLLM refuses ``/v1``, ``/inference`` requests without ``Authorization: Bearer <key>``, and this
  middleware refuses ``/worldloop/info`` the same way (401); ``/metrics`` and ``/health`` stay open.
* **Faults.** A failed set-up (a bad config, missing CURVE keys, an unreadable model) is logged and
  reported by ``/worldloop/info`` (``error``); generation requests then get 503 with the reason.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from typing import Any

from worldloop.actor.server.extension import ADAPTER_NAME, server_config
from worldloop.actor.server.launch import API_KEY_ENV
from worldloop.actor.server.fingerprint import model_fingerprint
from worldloop.common.metrics import metric, process_tree_cpu_seconds
from worldloop.common.secrets import bearer_ok

log = logging.getLogger("worldloop.server")

INFO_PATH = "/worldloop/info"
GATED_PREFIXES = ("/inference/", "/v1/")
# generation requests, which a LoRA server runs with its adapter (_with_adapter)
ADAPTER_PATHS = ("/inference/v1/generate", "/v1/completions", "/v1/chat/completions")
POLL_S = 0.25
ANNOUNCE_WAIT_S = 3.0  # a learner announces its version every second


class ServerDriver:
    """Sets the workers up, then loads every version they fetch while generation is paused."""

    def __init__(self, app: Any):
        self.engine = app.state.engine_client
        self.args = app.state.args
        self.cfg = server_config()
        self.ready = asyncio.Event()
        self.error: str | None = None
        self.version = 0
        self.updates = 0
        self.requests = 0  # generation (and other /v1) requests in flight
        self.channel = False
        self.fingerprint: dict | None = None
        self.scaffold: Any = None
        self.models = getattr(app.state, "openai_serving_models", None)
        self.lora_id: int | None = None  # with LoRA: the id of the adapter every request runs with

    def info(self) -> dict:
        mc = self.engine.model_config
        return {"ready": self.ready.is_set(), "error": self.error, "version": self.version, "updates": self.updates,
                "requests": self.requests,
                "channel": self.channel, "fingerprint": self.fingerprint, "model": str(mc.model),
                "max_model_len": int(mc.max_model_len), "vocab_size": int(mc.get_vocab_size())}

    async def run(self) -> None:
        try:
            await self._setup()
        except Exception as e:  # the server stays up to say why (``/worldloop/info``, 503s)
            self.error = f"set-up failed: {type(e).__name__}: {e}"
            log.exception("worldloop server %s", self.error)
            return
        while True:
            await asyncio.sleep(POLL_S)
            if getattr(self.engine, "errored", False):
                log.warning("the engine stopped: no more weight updates")
                return
            try:
                await self._sync_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a failed update keeps the old weights; the next poll tries again
                metric("worldloop_server_weight_update_failures").labels(reason="error").inc()
                log.exception("weight update failed: %s", e)

    async def _setup(self) -> None:
        results = await self.engine.collective_rpc("worldloop_setup")
        self.channel = all(r["channel"] for r in results)
        if results[0].get("adapter"):
            await self._register_adapter(results[0]["adapter"])
        self.fingerprint = await asyncio.to_thread(model_fingerprint, str(self.engine.model_config.model))
        await self.engine.update_weight_version("0")
        metric("worldloop_server_weights_version").set(0)
        await self._first_sync()
        self._start_heartbeat()
        self.ready.set()
        log.info("worldloop server ready: %s, weights v%d%s", self.engine.model_config.model, self.version,
                 ", following the weight channel" if self.channel else " (no weight channel)")

    async def _register_adapter(self, path: str) -> None:
        """Register the version-0 adapter (LoRA) with vLLM's served models: the engine loads it."""
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

        answer = await self.models.load_lora_adapter(LoadLoRAAdapterRequest(lora_name=ADAPTER_NAME, lora_path=path))
        if ADAPTER_NAME not in self.models.lora_requests:
            raise RuntimeError(f"vLLM did not load the version-0 LoRA adapter: {answer}")
        self.lora_id = int(self.models.lora_requests[ADAPTER_NAME].lora_int_id)
        log.info("LoRA: every request runs with the adapter %r (id %d)", ADAPTER_NAME, self.lora_id)

    def _point_adapter_at(self, path: str) -> None:
        """The registration follows the loaded version's folder (what vLLM would reload it from)."""
        import msgspec

        reg = self.models.lora_requests
        reg[ADAPTER_NAME] = msgspec.structs.replace(reg[ADAPTER_NAME], lora_path=path, load_inplace=False)

    def lora_model(self, model: Any) -> str | None:
        """The adapter's name for a request naming ``model`` (absent or the base model), else None."""
        if self.lora_id is None or not (model is None or (isinstance(model, str) and self.models.is_base_model(model))):
            return None
        return ADAPTER_NAME

    async def _first_sync(self) -> None:
        """A server (re)started while the learner runs loads the learner's current version before it
        serves (else its first answers would come from ``model.path``, versions behind): it waits
        ``ANNOUNCE_WAIT_S`` for an announcement, then up to ``weights.fetch_timeout_s`` for that version."""
        if not self.channel:
            return
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.cfg.weights.fetch_timeout_s:
            announced = await self.engine.collective_rpc("worldloop_announced")
            if any(a is None for a in announced):
                if time.monotonic() - t0 >= ANNOUNCE_WAIT_S:
                    return  # no learner announces: serve model.path's weights (v0)
            elif max(announced) <= self.version:
                return
            await self._sync_once()
            await asyncio.sleep(POLL_S)
        log.warning("the learner's version was not loaded within weights.fetch_timeout_s: serving v%d", self.version)

    async def _sync_once(self) -> None:
        staged = await self.engine.collective_rpc("worldloop_staged")
        if not staged or any(v is None for v in staged) or len(set(staged)) != 1:
            return  # nothing new, or the workers have not all fetched the same version yet
        version = int(staged[0])
        interrupt = self.cfg is not None and self.cfg.actor.weight_update == "interrupt"
        t0 = time.perf_counter()
        # interrupt: requests in flight are frozen where they are (vLLM's "keep"), not drained
        await self.engine.pause_generation(mode="keep" if interrupt else "wait", clear_cache=False)
        try:
            paused = time.perf_counter()
            results = await self.engine.collective_rpc("worldloop_apply", args=(version, self.lora_id))
            failed = [r for r in results if "version" not in r]
            if failed:
                reason = "rejected" if any("rejected" in r for r in failed) else "error"
                metric("worldloop_server_weight_update_failures").labels(reason=reason).inc()
                log.error("weights v%d not loaded (%s); keeping v%d", version, failed[0].get(reason), self.version)
                return
            # interrupt: the frozen requests are preempted too, so they recompute their KV (prompt and
            # the tokens made so far) under the new weights when generation resumes
            if not await self.engine.reset_prefix_cache(reset_running_requests=interrupt):
                log.warning("the prefix cache was not cleared after loading v%d", version)
            await self.engine.reset_encoder_cache()  # the vision tower's outputs: made by the old weights
            # not the multimodal processor cache: its entries (pixel values) do not depend on the
            # weights, and clearing it under requests the front end had already sent as hashes made
            # the engine refuse them ("P0/P1 cache drift") and the client send them again whole
            if self.lora_id is not None:
                self._point_adapter_at(results[0]["adapter"])
            await self.engine.update_weight_version(str(version))
            self.version = version
            self.updates += 1
        finally:
            await self.engine.resume_generation()
        now = time.perf_counter()
        metric("worldloop_server_weights_version").set(version)
        metric("worldloop_server_weight_updates").inc()
        metric("worldloop_server_weight_update_seconds").observe(now - t0)
        if self.scaffold is not None:
            self.scaffold.set_phase("serving", weights_version=version)
        log.info("applied weights v%d (generation paused %.2f s, %.2f s of it loading)", version, now - t0, now - paused)

    def _start_heartbeat(self) -> None:
        """Role ``server`` in ``{ns}:procs`` with this server's ``/metrics`` (when the config names a Redis)."""
        if self.cfg is None or not self.cfg.redis.url:
            return
        from worldloop.common.transport.process import ProcessScaffold

        host, port = self.args.host or "0.0.0.0", int(self.args.port)
        # vLLM serves /metrics itself: the scaffold only beats, advertising that address
        metrics = self.cfg.metrics.model_copy(update={"enabled": False, "host": host})
        cfg = self.cfg.model_copy(update={"metrics": metrics})
        scaffold = ProcessScaffold(cfg, "server", f"{socket.gethostname()}-{port}", poll_control=False,
                                   install_signals=False, migrate_keys=False,  # heartbeat only, never waits on Redis
                                   cpu_seconds=server_cpu_seconds)
        scaffold.metrics_port = port
        scaffold.set_phase("serving", weights_version=self.version)
        scaffold.start()
        self.scaffold = scaffold

    def close(self) -> None:
        if self.scaffold is not None:
            self.scaffold.close()


def server_cpu_seconds() -> float:
    """CPU seconds of this server with its engine-core and worker processes (vLLM's own
    ``process_cpu_seconds_total`` counts the API server alone, a small part of it: 67 of at least 540 s
    in a FrozenLake run). Goes into the heartbeat's ``cpu_s`` (the run's CPU, which the evaluator's share
    is of) and ``worldloop_server_cpu_seconds`` (``worldloop up``'s ``cpu.json``)."""
    total = process_tree_cpu_seconds()
    metric("worldloop_server_cpu_seconds").set(total)
    return total


async def _send_json(send: Any, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


def _authorized(scope: dict) -> bool:
    """Whether a request may read ``/worldloop/info``: always without an API key; with one
    (``$VLLM_API_KEY``, which vLLM checks on its own paths) only with ``Authorization: Bearer <key>``."""
    key = os.environ.get(API_KEY_ENV)
    return not key or bearer_ok(dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1"), key)


async def _with_adapter(driver: ServerDriver, scope: dict, receive: Any) -> tuple[dict, Any]:
    """A LoRA server: the request's JSON body with ``model`` set to the adapter's name when it names
    none or the base model (:meth:`ServerDriver.lora_model`); other bodies pass unchanged."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client went away: the app sees that at once
            async def gone() -> dict:
                return message

            return scope, gone
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    body = b"".join(chunks)
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    name = driver.lora_model(data.get("model")) if isinstance(data, dict) else None
    if name is not None:
        data["model"] = name
        body = json.dumps(data).encode()
        headers = [(k, v) for k, v in scope.get("headers") or [] if k.lower() != b"content-length"]
        scope = dict(scope, headers=[*headers, (b"content-length", str(len(body)).encode())])
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return scope, replay


class WorldloopMiddleware:
    """The ASGI middleware (see the module docstring); vLLM constructs it with the inner app."""

    def __init__(self, app: Any):
        self.app = app
        self.driver: ServerDriver | None = None
        self._task: asyncio.Task | None = None

    def _ensure_started(self, scope: dict) -> None:
        if self.driver is None and "app" in scope:
            self.driver = ServerDriver(scope["app"])
            self._task = asyncio.get_running_loop().create_task(self.driver.run(), name="worldloop-server-driver")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            async def lifespan_send(message: dict) -> None:
                if message["type"] == "lifespan.startup.complete":
                    self._ensure_started(scope)
                elif message["type"].startswith("lifespan.shutdown"):
                    self._shutdown()
                await send(message)

            await self.app(scope, receive, lifespan_send)
            return
        if scope["type"] == "http":
            self._ensure_started(scope)  # a server run without lifespan events
            path = scope.get("path", "")
            if path == INFO_PATH:
                if not _authorized(scope):
                    await _send_json(send, 401, {"error": "Unauthorized"})
                    return
                await _send_json(send, 200, self.driver.info() if self.driver else {"ready": False, "error": None})
                return
            if path.startswith(GATED_PREFIXES) and (self.driver is None or not self.driver.ready.is_set()):
                why = (self.driver and self.driver.error) or "the worldloop server is still setting up"
                await _send_json(send, 503, {"error": why})
                return
            if path.startswith(GATED_PREFIXES):
                self.driver.requests += 1
                try:
                    if self.driver.lora_id is not None and path in ADAPTER_PATHS and scope.get("method") == "POST":
                        scope, receive = await _with_adapter(self.driver, scope, receive)
                    await self.app(scope, receive, send)
                finally:
                    self.driver.requests -= 1
                return
        await self.app(scope, receive, send)

    def _shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.driver is not None:
            self.driver.close()
