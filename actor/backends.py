"""``make_backend``: the generation backend named by ``cfg.actor.backend``.

    make_backend(cfg: Config, model_dir: str | None = None, *, local: bool = False) -> GenerationBackend

``"hf"`` -> :class:`worldloop.actor.hf_backend.HFBackend`; ``"vllm"`` ->
:class:`worldloop.actor.vllm_backend.VLLMBackend` (imported lazily: vLLM is an optional extra);
``"server"`` -> :class:`worldloop.actor.server.client.ServerBackend` (vLLM inference servers over
HTTP, ``actor.servers``; the actor itself needs no vLLM). ``local=True`` (the run's evaluator,
which sets the weights it evaluates itself) gives ``"hf"`` in place of ``"server"``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from worldloop.actor.generation import GenerationBackend, resolve_device

if TYPE_CHECKING:
    from worldloop.common.contracts.config import Config


def make_backend(cfg: "Config", model_dir: str | None = None, *, local: bool = False) -> GenerationBackend:
    """The backend named by ``cfg.actor.backend`` for ``model_dir`` (default ``cfg.model.path``)."""
    path = str(model_dir or cfg.model.path)
    if cfg.actor.backend == "hf" or (local and cfg.actor.backend == "server"):
        from worldloop.actor.hf_backend import HFBackend

        return HFBackend(path, device=resolve_device(cfg.actor.device), dtype=cfg.model.dtype, max_image_side=cfg.model.max_image_side,
                         lora=cfg.model.lora, decode=cfg.actor.hf_decode)
    if cfg.actor.backend == "vllm":
        try:
            from worldloop.actor.vllm_backend import VLLMBackend
        except ImportError as e:
            raise RuntimeError(f"actor.backend=vllm but the vLLM backend cannot be imported: {e}") from e
        return VLLMBackend.from_config(cfg, path)
    if cfg.actor.backend == "server":
        from worldloop.actor.server.client import ServerBackend

        return ServerBackend.from_config(cfg, path)
    raise ValueError(f"unknown actor.backend {cfg.actor.backend!r} (known: hf, vllm, server)")
