"""The learner's fast paths on a GPU: Liger Kernel, the attention backend, shapes that repeat.

Public API::

    use_liger(cfg, device) -> bool          # trainer.liger resolved; ConfigError naming it when `on` cannot be
    apply_liger(model) -> bool              # Liger's RMSNorm, RoPE, SwiGLU on a Qwen2 / Qwen2.5-VL instance
    configure_attention(device)             # SDPA without cuDNN attention on CUDA (no plan per shape)
    pad_multiple(cfg, device) -> int        # trainer.pad_to_multiple resolved (auto: 128 on CUDA, 8 on CPU)
    checkpointing_mode(trainer_cfg) -> "full" | "selective" | "none"   # trainer.activation_checkpointing resolved
    apply_checkpointing(model, mode) -> int  # recompute in the backward: every layer, or each layer's attention
    kernel_report(cfg, device, liger) -> str   # the start-up line: which fused kernels are on, why any is off
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

Activation checkpointing (``trainer.activation_checkpointing``)
---------------------------------------------------------------
``full``: transformers' gradient checkpointing, every decoder layer recomputed in the backward
(one more forward of the whole backbone per training pass; a layer keeps only its input).
``selective``: only each text decoder layer's self-attention block (its q, k, v, the attention
output and the o_proj input) is recomputed; the MLP and norms keep their activations, so the
recompute costs the attention projections and the attention itself, about a third of a layer's
FLOPs at Qwen2.5's shapes, and saves 5 x d x h bytes per token and layer (learner/memory.py).
``none``: nothing recomputed. Unset, ``trainer.gradient_checkpointing`` picks full or none.

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


def checkpointing_mode(t) -> str:
    """``trainer.activation_checkpointing`` resolved against ``trainer.gradient_checkpointing``."""
    mode = getattr(t, "activation_checkpointing", None)
    if mode is None:
        return "full" if t.gradient_checkpointing else "none"
    return mode


def _checkpointed(forward):
    def run(*args, **kwargs):
        if torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)

    return run


def apply_checkpointing(model: torch.nn.Module, mode: str) -> int:
    """Activation checkpointing on a Hugging Face model (policy or bare backbone); returns the
    number of blocks recomputed: ``full`` every decoder layer (transformers' own), ``selective``
    the ``self_attn`` of every text decoder layer (not the vision tower's), ``none`` nothing."""
    if mode == "none":
        return 0
    if mode == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return int(model.config.get_text_config().num_hidden_layers)
    if mode != "selective":
        raise ValueError(f"activation checkpointing must be full, selective or none, got {mode!r}")
    n = 0
    for name, module in model.named_modules():
        if name.endswith(".self_attn") and "visual" not in name:
            module.forward = _checkpointed(module.forward)
            n += 1
    return n


def kernel_report(cfg: Config, device: torch.device, liger: bool) -> str:
    """One start-up line: the attention kernel and Liger's fused kernels, each on or off and why."""
    want, found = cfg.trainer.liger, _liger_version()
    if liger:
        head = ("fused linear log-prob in every pass (entropy_coef 0: no full logits)" if not cfg.trainer.entropy_coef
                else "fused linear log-prob in the proximal/reference passes; training asks for the entropy "
                     f"(entropy_coef {cfg.trainer.entropy_coef}), which Liger has no fused kernel for: chunked head there")
        kernels = f"Liger {'.'.join(map(str, found or ()))} on: RMSNorm, RoPE, SwiGLU, {head}"
    elif want is False:
        kernels = "Liger off: trainer.liger is false; chunked LM head (common/contracts/logprobs.py)"
    elif device.type != "cuda":
        kernels = f"Liger off: the learner runs on {device.type} (Triton kernels need CUDA); chunked LM head"
    elif found is None:
        kernels = "Liger off: liger_kernel does not import (pip install 'worldloop[gpu]'); chunked LM head"
    else:
        kernels = (f"Liger off: liger-kernel {'.'.join(map(str, found))} is older than "
                   f"{'.'.join(map(str, LIGER_MIN_VERSION))}; chunked LM head")
    attn = "sdpa without cuDNN" if device.type == "cuda" else "sdpa"
    if cfg.trainer.packing:  # learner/varlen.py
        varlen = ("torch varlen_attn (flash) in bf16/fp16, per-trajectory sdpa in fp32" if device.type == "cuda"
                  else "per-trajectory causal sdpa")
        attn, layout = f"varlen: {varlen}", "packed rows"
    else:
        layout = "padded rows"
    return (f"kernels: {kernels}; attention {attn}, {layout}; activation checkpointing "
            f"{checkpointing_mode(cfg.trainer)}")


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
