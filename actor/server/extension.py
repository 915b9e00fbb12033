"""The vLLM worker extension of worldloop's inference servers (``vllm serve --worker-extension-cls``).

vLLM adds this class to its worker's bases; the API server calls its methods through
``collective_rpc`` (the driver in :mod:`worldloop.actor.server.app`), between engine steps:

    worldloop_setup() -> {"channel": bool, "loaded": int, "adapter": path | None}   # once, before the first request
    worldloop_staged() -> int | None      # the version fetched and waiting to be loaded
    worldloop_announced() -> int | None   # the newest version the learner announced
    worldloop_apply(version, lora_id=None) -> {"version": v, "adapter": path | None} | {"rejected": reason}
                                             | {"error": reason}

* **Log-probs.** ``worldloop_setup`` wraps the worker's sampler exactly as the in-process
  backend does (:func:`worldloop.actor.vllm_backend.wrap_sampler`), so a server reports the
  same convention: ``log_softmax(logits / T)`` of the full vocabulary at the sampled token,
  before top-p.
* **Weights.** With a weight channel in the config (``weights.pub_port`` and ``fetch_port``), a
  thread of the worker owns a :class:`~worldloop.common.transport.weights.WeightSubscriber` made by
  :func:`~worldloop.common.transport.weights.subscriber_from_config` (the actors' subscriber: CURVE keys,
  per-chunk CRC, whole-set hash, size cap) and fetches every newer announced version into memory
  (at most one set waits: a newer one replaces it). A learner that restarted from an older
  checkpoint announces a lower version than the one held: the next fetch then takes whatever it
  serves. Fetch errors follow :class:`~worldloop.common.transport.weights.retry.FetchErrors` (retried with
  backoff, counted in ``worldloop_server_weight_update_failures``); a fatal one ends the worker's
  process (:func:`exit_on_fatal`, status 75), which stops the server so that its supervisor
  restarts it. ``worldloop_apply`` loads the waiting set with the in-process backend's validated,
  all-or-nothing :func:`~worldloop.actor.vllm_backend.load_weights_in_place`; the driver calls it
  only while generation is paused and drained, and clears the engine's caches after it.
* **LoRA** (``model.lora.rank`` > 0; the server started with ``--enable-lora``). The learner
  publishes adapter-only versions (:mod:`worldloop.common.lora`), and the server serves the base
  model (never changed) with one LoRA adapter, :data:`ADAPTER_NAME`, that every generation
  request runs with (the middleware names it in each request: :mod:`.app`). ``worldloop_setup``
  writes the version-0 adapter (``B`` = ``A`` = 0: exactly the base model, as the learner's policy
  is while ``B`` = 0) and returns its folder, which the driver registers with vLLM (one LoRA id).
  ``worldloop_apply`` checks a version's tensors against the adapters ``model.lora`` gives
  (:func:`~worldloop.actor.vllm_backend.write_checked_adapter`, the in-process backend's: names
  and shapes, NaN/inf refused; a mismatch is rejected naming the tensor, and the old adapter
  stays), writes them as a peft folder and loads them *in place* under the same LoRA id
  (``LoRARequest(load_inplace=True)``: vLLM loads the new adapter before it drops the old one, so a
  load that fails keeps it); the previous version's folder is removed. Because the id never
  changes, requests in flight hold the adapter the server holds: a version loaded while they
  are frozen (``interrupt``) goes into them as full weights do, after the driver's cache reset.
  Each worker writes its own folders (a private temporary directory, removed at exit).
* **Config.** The worker reads the worldloop config from ``$WORLDLOOP_SERVE_CONFIG`` (its resolved
  form as JSON, set by ``worldloop serve``; see :func:`worldloop.actor.server.launch.server_env`).
* **Logs.** Importing this module sends the ``worldloop`` loggers to stderr (the server's log).
* **No torchvision.** Importing this module applies the in-process backend's compatibility shim
  (:func:`~worldloop.actor.vllm_backend.install_no_torchvision_compat`): vLLM imports the
  extension in each worker process before it builds the model.

Method names start with ``worldloop_``: vLLM refuses an extension whose attributes collide with
the worker's.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

from worldloop.actor.generation import WeightUpdateError
from worldloop.actor.server.launch import CONFIG_ENV
from worldloop.actor.vllm_backend import (adapter_shapes, add_checked_adapter, install_no_torchvision_compat,
                                          load_weights_in_place, reference_params, wrap_sampler, write_checked_adapter)
from worldloop.common import lora as common_lora
from worldloop.common.contracts.config import Config, config_from_dict
from worldloop.common.exposure import warn_plain_weights
from worldloop.common.metrics import metric

log = logging.getLogger("worldloop.server")

POLL_S = 0.1
FATAL_EXIT = 75  # the worker's exit status when its weight fetching stopped on a fatal error
ADAPTER_NAME = "worldloop-policy"  # the LoRA adapter every request of a LoRA server runs with


def _log_to_stderr() -> None:
    """worldloop's log lines in the server's log (vLLM configures only its own loggers)."""
    root = logging.getLogger("worldloop")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False


_log_to_stderr()
install_no_torchvision_compat()


def server_config() -> Config | None:
    """The worldloop config a server was started with (``$WORLDLOOP_SERVE_CONFIG``), None without one."""
    raw = os.environ.get(CONFIG_ENV)
    return config_from_dict(json.loads(raw)) if raw else None


def exit_on_fatal(e: BaseException) -> None:
    """End the server at once (this runs in vLLM's worker, whose engine then stops the API server):
    a server whose weight fetching died would serve old weights for ever; its supervisor restarts it."""
    from worldloop.common.transport.weights.retry import WeightFetchFailed

    log.critical("%s", WeightFetchFailed.of("server weights", e))
    logging.shutdown()
    os._exit(FATAL_EXIT)


class ServedAdapter:
    """A worker's LoRA adapter: the folder of the version it holds (see the module docstring)."""

    def __init__(self, model_dir: str, lora: Any):
        import torch

        self.lora = lora
        self.shapes = adapter_shapes(Path(model_dir), lora)
        self.root = Path(tempfile.mkdtemp(prefix="worldloop-serve-lora-"))
        atexit.register(shutil.rmtree, self.root, True)
        self._n = 0
        self.path = self._write({k: torch.zeros(s) for k, s in self.shapes.items()}, 0)  # v0: the base model

    def _write(self, tensors: dict, version: int) -> str:
        self._n += 1
        folder = self.root / f"v{int(version)}-{self._n}"
        try:
            write_checked_adapter(tensors, self.shapes, self.lora, folder)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return str(folder)

    def load(self, worker: Any, tensors: dict, version: int, lora_id: int) -> str:
        """Load ``tensors`` in place as adapter ``lora_id`` (all-or-nothing); the new folder."""
        from vllm.lora.request import LoRARequest

        folder = self._write(tensors, version)  # WeightUpdateError: nothing changed
        add_checked_adapter(worker.add_lora, LoRARequest(ADAPTER_NAME, int(lora_id), folder, load_inplace=True), version)
        old, self.path = self.path, folder
        shutil.rmtree(old, ignore_errors=True)
        return folder


class WeightSync:
    """The worker's weights: a fetching thread, the set waiting to be loaded, the loaded version."""

    def __init__(self, cfg: Config | None, model_dir: str, *, on_fatal: Callable[[BaseException], None] | None = None,
                 make_subscriber: Callable[[Config], Any] | None = None):
        self.cfg = cfg
        self.shapes, self.groups = reference_params(model_dir)
        lora = cfg.model.lora if cfg is not None else None
        self.adapter = ServedAdapter(model_dir, lora) if common_lora.enabled(lora) else None
        self.loaded = 0
        self.channel = bool(cfg is not None and cfg.weights.pub_port and cfg.weights.fetch_port)
        self._have = 0  # the newest version fetched (loaded or waiting)
        self.announced: int | None = None  # the newest version the learner announced
        self._ready: tuple[int, dict] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.on_fatal = on_fatal or exit_on_fatal  # the fetching thread's fatal error ends the server's process
        self._make_subscriber = make_subscriber
        self._thread: threading.Thread | None = None
        if self.channel:
            warn_plain_weights("inference server", cfg.weights.host, cfg.weights.curve_server_public)
            self._thread = threading.Thread(target=self._run, name="worldloop-weights", daemon=True)
            self._thread.start()
        else:
            log.warning("no weight channel in the config (weights.pub_port/fetch_port 0): this server keeps %s (v0)",
                        model_dir)

    def _run(self) -> None:
        from worldloop.common.transport.weights import subscriber_from_config
        from worldloop.common.transport.weights.retry import FetchErrors

        errors = FetchErrors("server weights", lambda reason: metric("worldloop_server_weight_update_failures")
                             .labels(reason=reason).inc())
        make = self._make_subscriber or subscriber_from_config
        sub = None  # made here, in the retried part: a subscriber belongs to one thread
        try:
            while not self._stop.is_set():
                try:
                    if sub is None:
                        sub = make(self.cfg)
                    got = self._poll(sub)
                    errors.ok()
                except Exception as e:  # FetchErrors decides: retry after a wait, or end the server
                    wait = errors.failed(e, self.announced)
                    if wait is None:
                        self.on_fatal(e)
                        return
                    self._stop.wait(wait)
                    continue
                if got is None:
                    self._stop.wait(POLL_S)
        finally:
            if sub is not None:
                sub.close()

    def _poll(self, sub: Any) -> tuple[int, dict] | None:
        """One look at the announcements, and a fetch when one is news; what was fetched."""
        announced = self.announced = sub.latest_announced()
        if announced is None or announced == self._have:
            return None
        # a lower number than ours: the learner restarted from an older checkpoint
        got = sub.fetch(min_version=self._have if announced > self._have else -1)
        if got is not None:
            with self._lock:
                self._ready, self._have = got, got[0]
        return got

    def staged(self) -> int | None:
        with self._lock:
            return None if self._ready is None else self._ready[0]

    def apply(self, worker: Any, version: int, lora_id: int | None = None) -> dict:
        """Load the waiting set if it is ``version`` (the driver paused generation before): full
        weights into ``worker.model_runner``'s model, or with LoRA the adapter ``lora_id``."""
        with self._lock:
            got = self._ready
            if got is None or got[0] != version:
                return {"error": f"v{version} is not the version waiting here ({None if got is None else got[0]})"}
            self._ready = None
        try:
            if self.adapter is not None:
                if lora_id is None:
                    return {"error": "a LoRA server's adapter is not registered (no LoRA id)"}
                self.adapter.load(worker, got[1], version, lora_id)
            else:
                load_weights_in_place(worker.model_runner, got[1], self.shapes, self.groups)
        except WeightUpdateError as e:
            return {"rejected": str(e)}
        self.loaded = version
        return {"version": version, "adapter": None if self.adapter is None else self.adapter.path}

    def close(self) -> None:
        self._stop.set()


class WorldloopWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``model_runner``, ``vllm_config``)."""

    def worldloop_setup(self) -> dict:
        sync = getattr(self, "_worldloop_sync", None)
        if sync is None:
            wrap_sampler(self.model_runner.sampler)
            sync = WeightSync(server_config(), str(self.vllm_config.model_config.model))
            self._worldloop_sync = sync
        return {"channel": sync.channel, "loaded": sync.loaded,
                "adapter": None if sync.adapter is None else sync.adapter.path}

    def worldloop_staged(self) -> int | None:
        return self._worldloop_sync.staged()

    def worldloop_announced(self) -> int | None:
        return self._worldloop_sync.announced

    def worldloop_apply(self, version: int, lora_id: int | None = None) -> dict:
        return self._worldloop_sync.apply(self, int(version), lora_id)
