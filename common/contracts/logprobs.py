"""Per-token log-probs and entropies of a causal LM without full-vocabulary logits.

Public API::

    MODEL_KEYS; model_inputs(batch, device, dtype, owner=None) -> the model's keyword inputs of a collated batch
        # owner: the module called, whose image features a batch's vision_cache may hold (learner/vision.py)
    Segments; segments_of(lengths) -> Segments   # a packed row's trajectory bounds (learner/varlen.py)
    token_logprobs(model, batch, temperature=1.0, chunk_size=512, return_entropy=False, only=None, fused=False,
                   positions=None, masked_ids=None) -> (logprobs [B, L], entropy [B, L] | None)
    linear_logprobs(hidden, head, targets, temperature=1.0, chunk_size=512, return_entropy=False, fused=False,
                    masked_ids=None) -> (logprobs [N], entropy [N] | None)   # hidden [N, H] -> head -> log-softmax
    full_linear_logprobs(hidden, head, targets, temperature=1.0, masked_ids=None) -> (logprobs [N], entropy [N])
        # the whole [N, V] logits at once: the reference the chunked path must equal (tests, bench)
    mask_logits(logits, masked_ids) -> logits with MASKED_LOGIT at those token ids

``masked_ids``: token ids no response may hold (``ChatCodec.prompt_only_ids``): the actors' backends
never sample them (their logits are -inf there), so the log-probs and entropies here are those of
the same masked distribution. A masked logit is :data:`MASKED_LOGIT` (-1e30), not -inf: its exp is
exactly 0 in fp32 and bf16 as -inf's is, so every log-prob is the same, but ``0 * log 0`` in the
entropy and its gradient stays 0 where ``0 * -inf`` is NaN.

Why chunks
----------
A policy's log-prob of token i is ``log_softmax(head(h_{i-1}) / T)[token_i]``. Computed for a whole
micro-batch at once, the fp32 logits are N x V (Qwen's V = 151,936: 0.6 MB per token, 5 GB for 8k
tokens), and autograd keeps several such tensors (logits, log-softmax, softmax) for the backward.
:class:`ChunkedLinearLogprob` instead runs the head on ``chunk_size`` tokens at a time:

* forward, without a graph: per chunk the logits, their log-sum-exp, the log-prob at the target and
  the entropy; only the [N] results leave the chunk. It saves ``hidden``, the head's weight and
  the targets, nothing of size V;
* backward: per chunk the logits again (one more head matmul), then the gradient by hand,
  ``d logp_t / d z = onehot(t) - p`` and ``d H / d z = -p * (log p + H)`` (z = logits / T, H the
  entropy), scaled by the incoming per-token gradients, divided by T, and pushed through the head:
  ``grad_hidden[chunk] = g @ W``, ``grad_W += g^T @ hidden[chunk]``. At most two [chunk, V] fp32
  tensors are alive at a time.

So memory beyond ``hidden`` is O(chunk_size x V) in both passes, whatever N; the cost is a second
head matmul in the backward (the head is one layer of the model; on loss tokens only, see ``only``).

Fallbacks and the fused kernel
------------------------------
* A head whose parameters DeepSpeed ZeRO-3 partitions (``ds_id`` on the parameter) must be
  *called* so that ZeRO-3's hooks gather its weight: there each chunk runs ``head(hidden_chunk)``
  under ``torch.utils.checkpoint`` (the chunk's logits are recomputed in the backward), the same
  memory bound with autograd's larger constant.
* ``fused=True`` (``trainer.liger`` on a GPU, learner/kernels.py) computes log-probs with Liger
  Kernel's fused linear cross entropy (``reduction="none"`` gives -log p per token; its backward
  folds the per-token gradient in since liger-kernel 0.8.2). Liger has no fused entropy, so a call
  that asks for entropies takes the chunked path above (one pass gives both), and so does a
  ZeRO-3-partitioned head.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

MODEL_KEYS = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids", "position_ids")
MASKED_LOGIT = -1e30  # a masked token's logit (module docstring)


def mask_logits(logits: torch.Tensor, masked_ids: torch.Tensor | None, inplace: bool = False) -> torch.Tensor:
    """``logits`` [..., V] with :data:`MASKED_LOGIT` at the token ids ``masked_ids`` (a long tensor on
    their device; None: unchanged), before any log-softmax: the one place the learner masks."""
    if masked_ids is None or masked_ids.numel() == 0:
        return logits
    return logits.index_fill_(-1, masked_ids, MASKED_LOGIT) if inplace else logits.index_fill(-1, masked_ids, MASKED_LOGIT)


def _ids(masked_ids, device) -> torch.Tensor | None:
    return None if not masked_ids else torch.as_tensor(list(masked_ids), dtype=torch.long, device=device)


@dataclass(frozen=True)
class Segments:
    """A packed row's trajectories: ``bounds`` (host ints: 0, each end), ``max_len`` and the same
    boundaries as an int32 tensor (``cu``), moved to the compute device by :meth:`on`."""

    bounds: tuple[int, ...]
    max_len: int
    cu: torch.Tensor

    def on(self, device: torch.device) -> "Segments":
        if self.cu.device == torch.device(device):
            return self
        return Segments(self.bounds, self.max_len, self.cu.to(device, non_blocking=True))


def segments_of(lengths) -> Segments:
    """The :class:`Segments` of a packed row whose trajectories (and padding tail) have ``lengths``
    tokens, in order (host ints, all > 0)."""
    lengths = [int(n) for n in lengths]
    if not lengths or min(lengths) <= 0:
        raise ValueError(f"a packed row needs segments of at least one token, got lengths {lengths[:8]}")
    bounds = (0, *itertools.accumulate(lengths))
    return Segments(bounds, max(lengths), torch.tensor(bounds, dtype=torch.int32))


def model_inputs(batch: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
                 owner: torch.nn.Module | None = None) -> dict[str, torch.Tensor]:
    """The model's keyword inputs of a collated batch on ``device`` (pixel values in ``dtype``). A
    packed batch (``position_ids`` restarting at each sequence, learner/microbatch.py) goes without
    its attention mask and with its ``segments`` as ``worldloop_segments`` (learner/varlen.py).
    With a ``vision_cache`` in the batch (learner/vision.py) that holds ``owner``'s image features,
    the images go as those features (``mm_encoder_outputs``) instead of ``pixel_values``."""
    keys = [k for k in MODEL_KEYS if k in batch and not (k == "attention_mask" and "position_ids" in batch)]
    non_blocking = torch.device(device).type == "cuda"
    cache = batch.get("vision_cache") if owner is not None else None
    feats = cache.features(owner, batch) if cache is not None else None
    if feats is not None:
        keys.remove("pixel_values")
    kwargs = {k: _to(batch[k], device, non_blocking) for k in keys}
    if feats is not None:
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        kwargs["mm_encoder_outputs"] = {"image": BaseModelOutputWithPooling(pooler_output=feats)}
    if "segments" in batch:  # a packed row's trajectory boundaries, for the varlen attention
        kwargs["worldloop_segments"] = batch["segments"].on(device)
    if "pixel_values" in kwargs:
        kwargs["pixel_values"] = kwargs["pixel_values"].to(dtype)
    return kwargs


def _to(x: torch.Tensor, device: torch.device, non_blocking: bool) -> torch.Tensor:
    """``x`` on ``device``; from the CPU to CUDA through pinned memory without waiting for the copy."""
    if non_blocking and x.device.type == "cpu":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


# --------------------------------------------------------------------------- the chunked function


def _chunk_logp(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float,
                masked: torch.Tensor | None = None):
    """fp32 log-softmax of one chunk's logits / T and its softmax: two [chunk, V] tensors, the logits
    reused in place (``torch.logsumexp`` would allocate a third, its exp, for the sum)."""
    logp = mask_logits(F.linear(hidden, weight, bias).float(), masked, inplace=True)
    if temperature != 1.0:
        logp.div_(temperature)
    logp.sub_(logp.amax(dim=-1, keepdim=True))
    p = logp.exp()
    total = p.sum(dim=-1, keepdim=True)
    logp.sub_(total.log())
    return logp, p.div_(total)


class ChunkedLinearLogprob(torch.autograd.Function):
    """(logprobs [N], entropy [N]) of ``log_softmax((hidden @ W^T + b) / T)`` at ``targets``,
    ``chunk`` rows at a time in both passes (module docstring). Entropy is 0 unless ``entropy``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, chunk: int, entropy: bool, masked=None):
        n = hidden.shape[0]
        lp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        for s in range(0, n, chunk):
            logp, p = _chunk_logp(hidden[s : s + chunk], weight, bias, temperature, masked)
            lp[s : s + chunk] = logp.gather(-1, targets[s : s + chunk, None]).squeeze(-1)
            if entropy:
                ent[s : s + chunk] = -p.mul_(logp).sum(-1)  # in place: no third [chunk, V] tensor
            del logp, p
        ctx.save_for_backward(hidden, weight, bias, targets, ent)
        ctx.temperature, ctx.chunk, ctx.entropy = float(temperature), int(chunk), bool(entropy)
        ctx.masked = masked
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, targets, ent = ctx.saved_tensors
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros_like(weight) if want_w else None
        grad_b = torch.zeros_like(bias) if want_b and bias is not None else None
        g_lp = g_lp if g_lp is not None else torch.zeros_like(ent)
        g_ent = g_ent if ctx.entropy and g_ent is not None else None
        for s in range(0, hidden.shape[0], ctx.chunk):
            sl = slice(s, s + ctx.chunk)
            g = _chunk_grad_logits(hidden[sl], weight, bias, targets[sl], ent[sl], g_lp[sl],
                                   g_ent[sl] if g_ent is not None else None, ctx.temperature, ctx.masked)
            if grad_h is not None:
                grad_h[sl] = (g @ weight).to(hidden.dtype)
            if grad_w is not None:
                grad_w.addmm_(g.t(), hidden[sl].to(weight.dtype))
            if grad_b is not None:
                grad_b += g.sum(0).to(bias.dtype)
            del g  # before the next chunk's logits: one chunk's tensors alive at a time
        return grad_h, grad_w, grad_b, None, None, None, None, None


def _chunk_grad_logits(hidden, weight, bias, targets, ent, g_lp, g_ent, temperature: float, masked=None) -> torch.Tensor:
    """d loss / d logits of one chunk, in the weight's dtype: ``g_lp * (onehot - p) / T`` plus
    ``g_ent * (-p * (log p + H)) / T``, built in place in the recomputed log-softmax and softmax."""
    logp, p = _chunk_logp(hidden, weight, bias, temperature, masked)
    gl = g_lp[:, None]
    if g_ent is not None:
        grad_z = p.mul_(logp.add_(ent[:, None]).mul_(-g_ent[:, None]).sub_(gl))
    else:
        grad_z = p.mul_(-gl)
    del logp
    grad_z.scatter_add_(-1, targets[:, None], gl)
    if temperature != 1.0:
        grad_z.div_(temperature)
    return grad_z.to(weight.dtype)


# --------------------------------------------------------------------------- dispatch


def _partitioned(head: torch.nn.Module) -> bool:
    """True when DeepSpeed ZeRO-3 partitions the head's parameters (they must be gathered by a call)."""
    return any(hasattr(p, "ds_id") for p in head.parameters())


def _stats_of_call(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: bool,
                   masked: torch.Tensor | None = None):
    logp = torch.log_softmax(mask_logits(head(hidden).float(), masked) / temperature, dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1) if entropy else torch.zeros_like(lp)
    return lp, ent


def _checkpointed_calls(head, hidden, targets, temperature: float, chunk: int, entropy: bool, masked=None):
    """The ZeRO-3 path: ``head(chunk)`` under activation checkpointing, chunk by chunk."""
    grad = torch.is_grad_enabled() and hidden.requires_grad
    lps, ents = [], []
    for s in range(0, hidden.shape[0], chunk):
        args = (head, hidden[s : s + chunk], targets[s : s + chunk], temperature, entropy, masked)
        lp, ent = (torch.utils.checkpoint.checkpoint(_stats_of_call, *args, use_reentrant=False) if grad
                   else _stats_of_call(*args))
        lps.append(lp)
        ents.append(ent)
    return torch.cat(lps), torch.cat(ents)


def _liger_logprobs(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, temperature: float,
                    masked: torch.Tensor | None = None) -> torch.Tensor:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    scaled = hidden / temperature if temperature != 1.0 else hidden  # (h / T) W^T = (h W^T) / T
    bias = getattr(head, "bias", None)
    if masked is not None:  # the mask as a bias: the fused kernel never shows us its logits
        zeros = torch.zeros(head.weight.shape[0], dtype=head.weight.dtype, device=head.weight.device)
        bias = mask_logits(zeros if bias is None else bias, masked)
    nll = liger_fused_linear_cross_entropy(scaled, head.weight, targets, bias=bias, reduction="none")
    return -nll.float()


def linear_logprobs(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, temperature: float = 1.0,
                    chunk_size: int = 512, return_entropy: bool = False, fused: bool = False, masked_ids=None):
    """Log-probs (fp32, [N]) at ``targets`` [N] of ``log_softmax(head(hidden) / temperature)`` for
    ``hidden`` [N, H], and the entropies [N] when ``return_entropy`` (else None), never holding more
    than ``chunk_size`` rows of logits (module docstring for the paths); ``masked_ids``: token ids
    whose logits are masked first (module docstring)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if hidden.shape[0] == 0:
        zeros = hidden.new_zeros(0, dtype=torch.float32)
        return zeros, (zeros.clone() if return_entropy else None)
    masked = _ids(masked_ids, hidden.device)
    if _partitioned(head):
        lp, ent = _checkpointed_calls(head, hidden, targets, float(temperature), chunk_size, return_entropy, masked)
        return lp, (ent if return_entropy else None)
    if fused and not return_entropy:
        return _liger_logprobs(hidden, head, targets, float(temperature), masked), None
    lp, ent = ChunkedLinearLogprob.apply(hidden, head.weight, getattr(head, "bias", None), targets, float(temperature),
                                         int(chunk_size), bool(return_entropy), masked)
    return lp, (ent if return_entropy else None)


def full_linear_logprobs(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor,
                         temperature: float = 1.0, masked_ids=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The unchunked computation: the whole [N, V] fp32 logits, log-softmax and entropy at once."""
    logits = mask_logits(head(hidden).float(), _ids(masked_ids, hidden.device))
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


# --------------------------------------------------------------------------- a model's token log-probs


def _hidden_states(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Last hidden states [B, L, H] of the backbone (no logits materialised)."""
    inner = getattr(model, "module", model)  # a DeepSpeed engine wraps the model
    device = next(inner.parameters()).device
    dtype = next(inner.parameters()).dtype
    out = inner.model(**model_inputs(batch, device, dtype, owner=inner.model), use_cache=False)
    return out.last_hidden_state


def token_logprobs(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    temperature: float = 1.0,
    chunk_size: int = 512,
    return_entropy: bool = False,
    only: torch.Tensor | None = None,
    fused: bool = False,
    positions: tuple[torch.Tensor, torch.Tensor] | None = None,
    masked_ids=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-position log p(token_i | tokens < i) under ``logits / temperature`` (position 0 -> 0).

    The backbone runs once; the LM head + fp32 log-softmax run through :func:`linear_logprobs`,
    ``chunk_size`` positions at a time in the forward and the backward, so full-vocabulary logits
    are never held for the batch. ``entropy[b, i]`` is the entropy of the distribution that
    produced token i (0 at position 0); None unless ``return_entropy``. ``only`` ([B, L], nonzero
    where wanted, e.g. the loss mask): the LM head runs on those positions alone and every other
    position comes out 0. The learner wants the generated tokens only, a tenth of a multi-turn
    episode's tokens, and the head and log-softmax over the vocabulary are the larger part of a
    small model's forward. ``fused``: Liger's fused linear cross entropy for the log-probs when no
    entropy is asked for (a GPU with liger-kernel). ``masked_ids``: token ids no response may hold
    (``ChatCodec.prompt_only_ids``), masked out of every distribution as the actors mask them.
    Values at padded positions are meaningless; mask them with the batch's masks. ``positions``:
    ``(rows, cols)`` of ``only[:, 1:]``'s nonzero entries, computed ahead on the host
    (learner/microbatch.py), so that no device ``nonzero`` waits for the GPU.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    ids = batch["input_ids"]
    if only is not None and only.shape != ids.shape:
        raise ValueError(f"only: expected shape {tuple(ids.shape)}, got {tuple(only.shape)}")
    hidden = _hidden_states(model, batch)
    head = getattr(model, "module", model).get_output_embeddings()
    ids = ids.to(hidden.device)
    bsz, length = ids.shape
    if only is None:  # every position: the hidden states as they are (a view, no copy)
        flat_h, flat_t = hidden[:, :-1].reshape(-1, hidden.shape[-1]), ids[:, 1:].reshape(-1)
    else:  # position i is predicted by the hidden state at i - 1
        if positions is None:  # on only's device: the host for a CPU mask
            positions = (only[:, 1:] != 0).nonzero(as_tuple=True)
        rows, cols = (x.to(hidden.device, non_blocking=True) for x in positions)
        flat_h, flat_t = hidden[rows, cols], ids[rows, cols + 1]
    lp, ent = linear_logprobs(flat_h, head, flat_t, temperature, chunk_size, return_entropy, fused, masked_ids)

    def place(values: torch.Tensor) -> torch.Tensor:
        if only is None:
            return F.pad(values.reshape(bsz, length - 1), (1, 0))
        zeros = hidden.new_zeros(bsz, length, dtype=torch.float32)
        if values.numel() == 0:  # nothing chosen: zeros that are still part of the graph
            return zeros + 0.0 * hidden.sum() if torch.is_grad_enabled() and hidden.requires_grad else zeros
        return zeros.index_put((rows, cols + 1), values)

    return place(lp), (place(ent) if return_entropy else None)
