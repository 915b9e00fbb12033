"""Varlen attention for packed micro-batches: each trajectory of a packed row attends only to itself,
at the cost of its own length squared, with no [T, T] mask.

Public API::

    ATTENTION = "worldloop_varlen"        # the name registered with transformers' attention interfaces
    use_varlen(model) -> None             # the model's attention implementation set to ATTENTION
    varlen_attention(module, q, k, v, attention_mask, ...)   # the registered attention function

Why
---
A packed row (``trainer.packing``, learner/microbatch.py) holds several trajectories end to end,
position ids restarting at each. Under transformers' SDPA that becomes a dense block-diagonal
[T, T] mask: attention costs the square of the row's length, and a mask keeps SDPA off its
flash kernels (measured on an H100: packed at 0.69x padded tokens/s, docs/benchmarks.md "Learner").
Here the learner's models run :data:`ATTENTION` instead, and a packed micro-batch carries its
trajectories' boundaries (``segments``: 0, the end of each trajectory, then of the padding tail),
which ``model_inputs`` (common/contracts/logprobs.py) hands to every layer as the keyword
``worldloop_segments`` (a ``Segments``). Then:

- **CUDA, bf16/fp16:** ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention's varlen kernel,
  causal, grouped KV heads without a copy) over the whole row in one call. If that kernel fails
  (a GPU or build without it; out of memory is re-raised), a warning says so once and the process
  goes on with the path below. Not yet run on a GPU (no GPU was lent when it was written).
- **Otherwise (CPU, fp32):** one causal SDPA call per trajectory on its own slice, so each call
  takes SDPA's unmasked causal kernel (grouped KV heads read in place); the outputs are
  concatenated.

Without segments (a padded micro-batch, or the vision tower's attention, whose module is not
causal) the function is transformers' SDPA, and the mask function builds SDPA's mask; with none
to build (no padding mask) it builds nothing, which is what lets a packed row go mask-free. The
boundaries are host integers, computed once per micro-batch on the CPU: no device sync per layer.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from worldloop.common.contracts.logprobs import Segments

ATTENTION = "worldloop_varlen"
_FLASH_FAILED: list[str] = []  # why torch's varlen kernel failed once in this process (then never tried again)
log = logging.getLogger(__name__)


def _sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def _flash_varlen(query, key, value, seg: Segments, scaling):
    """Query [1, Hq, T, D], key/value [1, Hkv, T, D] -> [1, T, Hq, D] by torch's varlen kernel."""
    from torch.nn.attention.varlen import varlen_attn

    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
    cu = seg.on(q.device).cu
    out = varlen_attn(q, k, v, cu, cu, seg.max_len, seg.max_len, scale=scaling, window_size=(-1, 0),
                      enable_gqa=q.shape[1] != k.shape[1])
    return out[None]


def _per_segment(query, key, value, seg: Segments, scaling):
    """The same by one causal SDPA call per trajectory: [1, T, Hq, D]."""
    gqa = query.shape[1] != key.shape[1]  # grouped KV heads read in place, not repeated
    outs = [F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True,
                                           scale=scaling, enable_gqa=gqa)
            for a, b in zip(seg.bounds, seg.bounds[1:])]
    return torch.cat(outs, dim=2).transpose(1, 2)


def _flash_ok(query: torch.Tensor) -> bool:
    """Whether torch's varlen kernel applies: CUDA, half precision."""
    return query.device.type == "cuda" and query.dtype in (torch.bfloat16, torch.float16)


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, worldloop_segments: Segments | None = None, **kwargs):
    """transformers' attention-function signature; (output [B, T, H, D], None)."""
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if worldloop_segments is None or not causal:
        return _sdpa()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                       is_causal=is_causal, **kwargs)
    if query.shape[0] != 1 or attention_mask is not None:
        raise ValueError("worldloop_segments needs one packed row and no attention mask")
    if dropout and module.training:
        raise ValueError("varlen attention has no dropout (the learner trains with attention dropout 0)")
    if query.shape[2] != worldloop_segments.bounds[-1]:
        raise ValueError(f"segments cover {worldloop_segments.bounds[-1]} tokens, the row has {query.shape[2]}")
    if _flash_ok(query) and not _FLASH_FAILED:
        try:
            return _flash_varlen(query, key, value, worldloop_segments, scaling), None
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # no kernel for this GPU, build or layout: the path below is exact too
            _FLASH_FAILED.append(repr(e))
            log.warning("torch varlen_attn failed (%r): packed rows use one SDPA call per trajectory from now on", e)
    return _per_segment(query, key, value, worldloop_segments, scaling), None


def _mask(*args, attention_mask: torch.Tensor | None = None, **kwargs):
    """No mask when there is no padding mask (a packed row, or rows with no padding: the attention
    then applies causality itself); otherwise SDPA's."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, varlen_attention)
    AttentionMaskInterface.register(ATTENTION, _mask)


def use_varlen(model: torch.nn.Module) -> None:
    """``model`` (and its sub-models: the vision tower falls through to SDPA) on :data:`ATTENTION`."""
    _register()
    model.set_attn_implementation(ATTENTION)


__all__ = ["ATTENTION", "use_varlen", "varlen_attention"]
