"""The learner's fast paths on a GPU: Liger Kernel, the attention backend, shapes that repeat.

Public API::

    use_liger(cfg, device) -> bool          # trainer.liger resolved; ConfigError naming it when `on` cannot be
    apply_liger(model) -> bool              # Liger's RMSNorm, RoPE, SwiGLU on a Qwen2 / Qwen2.5-VL instance
    configure_attention(device)             # SDPA without cuDNN attention on CUDA (no plan per shape)
    pad_multiple(cfg, device) -> int        # trainer.pad_to_multiple resolved (auto: 128 on CUDA, 8 on CPU)
    LIGER_MIN_VERSION

Liger Kernel (``pip install 'worldloop[gpu]'``; Triton kernels, so CUDA only)
--------------------------------------------------------------------------------
``trainer.liger`` auto turns it on when the learner's device is CUDA and ``liger_kernel`` imports
at version >= 0.8.2 (earlier versions give a wrong weight gradient for the per-token loss,
``reduction="none"``, of the fused linear cross entropy: Liger-Kernel PR 1298); ``true`` fails at
start-up without either, naming the key. It patches each model *instance* (policy, critic
backbone, reference) with ``apply_liger_kernel_to_qwen2`` / ``apply_liger_kernel_to_qwen2_5_vl``:
RMSNorm, RoPE and SwiGLU. Their ``fused_linear_cross_entropy`` patch is left off, as it replaces the
model's ``forward`` and the learner never calls that (it runs the backbone and the head itself,
``worldloop.common.contracts.logprobs``); the fused linear log-prob is used there instead
(``token_logprobs(fused=True)``: log-probs without entropies, i.e. the proximal and reference
passes; Liger has no fused entropy, so the training pass, which reads the entropy, runs the
chunked path, which gives both from one head matmul per chunk).

RoPE of Qwen2.5-VL: Liger 0.8.x replaces ``apply_multimodal_rotary_pos_emb``, a function that
transformers 5 no longer has: there the M-RoPE sections are folded into cos / sin by the rotary
embedding and the attention calls the plain ``apply_rotary_pos_emb``, so that one is replaced by
Liger's plain RoPE kernel (the same call as Qwen2's).

Attention
---------
The models run PyTorch SDPA (``attn_implementation="sdpa"``, transformers' default). On an H100
PyTorch may pick its cuDNN attention backend, which builds an execution plan for every new
sequence shape (measured: 3.3 ms of CPU per call over 1,080 calls of one 3B update, issue 30).
:func:`configure_attention` turns that backend off, so SDPA takes FlashAttention-2 (no padding
mask) or the memory-efficient kernel (a padding mask), neither of which plans per shape. Micro-
batches padded to ``trainer.pad_to_multiple`` tokens (:func:`pad_multiple`) make the shapes repeat
in any case, which also keeps the caching allocator's blocks reusable.
"""

from __future__ import annotations

import logging

import torch

from worldloop.common.contracts.config import Config, ConfigError

log = logging.getLogger(__name__)

LIGER_MIN_VERSION = (0, 8, 2)
_CUDA_PAD = 128  # trainer.pad_to_multiple auto on CUDA
_CPU_PAD = 8  # ... and on CPU (the padding every micro-batch had before the key existed)


def _liger_version() -> tuple[int, ...] | None:
    """liger_kernel's version when it imports, else None."""
    try:
        import liger_kernel  # noqa: F401
        from importlib.metadata import version
    except Exception:  # ImportError, or a broken install that fails on import
        return None
    try:
        text = version("liger-kernel")
    except Exception:
        return (0,)
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def use_liger(cfg: Config, device: torch.device) -> bool:
    """Whether the learner uses Liger Kernel (module docstring); ConfigError when ``trainer.liger``
    is true on a CPU, or without a recent enough liger_kernel."""
    want = cfg.trainer.liger
    if want is False:
        return False
    found = _liger_version()
    need = ".".join(map(str, LIGER_MIN_VERSION))
    if want is True:
        if device.type != "cuda":
            raise ConfigError("trainer.liger", f"is on but the learner runs on {device.type}: Liger's kernels are "
                              "Triton GPU kernels (set trainer.liger: auto or false)")
        if found is None:
            raise ConfigError("trainer.liger", "is on but liger_kernel does not import: pip install 'worldloop[gpu]'")
        if found < LIGER_MIN_VERSION:
            raise ConfigError("trainer.liger", f"is on but liger-kernel is {'.'.join(map(str, found))}, "
                              f"older than {need} (wrong gradients of per-token log-probs before it)")
        return True
    if device.type != "cuda" or found is None:
        return False
    if found < LIGER_MIN_VERSION:
        log.warning("trainer.liger auto: liger-kernel %s is older than %s; the plain path is used",
                    ".".join(map(str, found)), need)
        return False
    return True


def apply_liger(model: torch.nn.Module) -> bool:
    """Patch ``model`` (a Qwen2 / Qwen2.5-VL LM, or its bare backbone) with Liger's RMSNorm, RoPE and
    SwiGLU; False (and a log line) for another architecture, which keeps its plain modules."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind == "qwen2":
        from liger_kernel.transformers.monkey_patch import apply_liger_kernel_to_qwen2

        apply_liger_kernel_to_qwen2(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False, model=model)
    elif kind == "qwen2_5_vl":
        from liger_kernel.transformers.monkey_patch import apply_liger_kernel_to_qwen2_5_vl
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl

        plain_rope = not hasattr(modeling_qwen2_5_vl, "apply_multimodal_rotary_pos_emb")  # transformers 5
        apply_liger_kernel_to_qwen2_5_vl(rope=not plain_rope, rms_norm=True, swiglu=True, cross_entropy=False,
                                         fused_linear_cross_entropy=False, model=model)
        if plain_rope:
            modeling_qwen2_5_vl.apply_rotary_pos_emb = liger_rotary_pos_emb
    else:
        log.warning("trainer.liger: no Liger patch for model type %r; it keeps its plain modules", kind)
        return False
    log.info("Liger Kernel: RMSNorm, RoPE and SwiGLU of the %s model patched", kind)
    return True


def configure_attention(device: torch.device) -> None:
    """On CUDA: SDPA without its cuDNN backend (module docstring). Nothing on CPU."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def pad_multiple(cfg: Config, device: torch.device) -> int:
    """Micro-batch lengths are rounded up to a multiple of this (``trainer.pad_to_multiple``)."""
    value = cfg.trainer.pad_to_multiple
    if value == "auto":
        return _CUDA_PAD if device.type == "cuda" else _CPU_PAD
    return int(value)
