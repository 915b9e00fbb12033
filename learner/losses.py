"""Losses of the learner: decoupled PPO policy loss, clipped value loss, KL estimators, masked stats.

Public API::

    masked_sum(x, mask, dim=None) / masked_mean(x, mask, dim=None)
    masked_var(x, mask, unbiased=True, return_mean=False)
    weighted_sum(x, weights, mask) -> sum of x * weights over the mask
    aggregation_weights(mask, mode) / aggregation_normaliser(mask, mode)   # trainer.loss_agg_mode
    policy_loss(logprobs, proximal_logprobs, behaviour_logprobs, advantages, mask, *,
                clip_ratio=0.2, iw_cap=2.0, token_weights=None, is_weights=None, as_tensors=False) -> (loss, stats)
    value_loss(values, old_values, returns, mask, *, value_clip=0.2, as_tensors=False) -> (loss, stats)
    stats_floats(*stats) -> list of dicts of floats     # as_tensors stats, one host sync for all
    kl_penalty(logprobs, ref_logprobs, kind="low_var_kl") -> per-token tensor

Aggregation: every loss is a token mean over the mask of the tensors it is given (one
mini-batch or micro-batch): sum over masked tokens / number of masked tokens, so long responses
weigh per token, not per sequence (VAGEN Alg. 1 line 27-28). With gradient accumulation over
micro-batches the caller scales each micro-batch loss by its share of the mini-batch's tokens if it
wants the exact mini-batch token mean. The policy loss also takes per-token weights instead
(``token_weights``): the other aggregation modes of ``trainer.loss_agg_mode``
(:func:`aggregation_weights`), where the caller divides the weighted sums of a mini-batch by
:func:`aggregation_normaliser`. A mask with no token gives loss 0 (still attached to the
graph) and stats 0. Nothing is read outside the mask: NaN/inf there changes neither the loss nor
its gradient. Stats are Python floats (one host sync per call), or 0-d tensors with ``as_tensors``.
"""

from __future__ import annotations

import torch

from worldloop.common.contracts.algorithms import KL_ALIASES, KL_ESTIMATOR_NAMES, kl_estimator_name

KL_KINDS = (*KL_ESTIMATOR_NAMES, *KL_ALIASES)  # the registry's names and their aliases


def _bool(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor) or mask.shape != like.shape:
        raise ValueError(f"mask: expected a tensor of shape {tuple(like.shape)}, got {getattr(mask, 'shape', type(mask).__name__)}")
    return (mask != 0).to(like.device)


def _same_shape(name: str, x: torch.Tensor, like: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.shape != like.shape:
        raise ValueError(f"{name}: expected a tensor of shape {tuple(like.shape)}, got {getattr(x, 'shape', type(x).__name__)}")


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    m = _bool(mask, x)
    kept = torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean of x over the masked elements (0 where nothing is masked)."""
    m = _bool(mask, x)
    count = m.sum() if dim is None else m.sum(dim)
    return masked_sum(x, m, dim) / count.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True, return_mean: bool = False):
    """Variance of the masked elements (Bessel-corrected when ``unbiased``; 0 below 2 elements)."""
    m = _bool(mask, x)
    count = m.sum()
    mean = masked_mean(x, m)
    var = masked_sum((x - mean) ** 2, m) / (count - 1 if unbiased else count).clamp(min=1)
    return (mean, var) if return_mean else var


def weighted_sum(x: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(x * weights) over the masked elements (NaN/inf outside the mask never leak in)."""
    _same_shape("weights", weights, x)
    m = _bool(mask, x)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    return torch.where(m, x * weights.to(x.device, x.dtype), zero).sum()


LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def aggregation_weights(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Per-token weights [B, L] of a loss aggregation mode (verl's ``loss_agg_mode`` names), before
    the division by the batch's normaliser (:func:`aggregation_normaliser`):

    * ``token-mean``: 1 on every masked token; normaliser = masked tokens of the batch. Every token
      weighs the same, so a long trajectory weighs more (VAGEN Alg. 1; verl's default);
    * ``seq-mean-token-mean``: 1 / (masked tokens of the row); normaliser = rows with a masked token.
      Every trajectory weighs the same whatever its length: under GRPO a failed 3-turn episode no
      longer outweighs a solved 1-turn one on the tokens they share;
    * ``seq-mean-token-sum``: 1 on every masked token; normaliser = rows (Dr. GRPO's sum over a
      sequence's tokens, averaged over sequences).
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"mode: unknown loss aggregation {mode!r}, expected one of {', '.join(LOSS_AGG_MODES)}")
    m = (mask != 0).float()
    if mode == "seq-mean-token-mean":
        return m / m.sum(-1, keepdim=True).clamp(min=1.0)
    return m


def aggregation_normaliser(mask: torch.Tensor, mode: str) -> float:
    """What the weighted sum of a batch (or mini-batch) is divided by under ``mode``."""
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"mode: unknown loss aggregation {mode!r}, expected one of {', '.join(LOSS_AGG_MODES)}")
    m = mask != 0
    return float(m.sum()) if mode == "token-mean" else float(m.any(-1).sum())


def _stats(named: dict[str, torch.Tensor]) -> dict[str, float]:
    values = torch.stack([v.detach().float().reshape(()) for v in named.values()]).tolist()
    return dict(zip(named, values))


def stats_floats(*named: dict[str, torch.Tensor]) -> list[dict[str, float]]:
    """Several dicts of 0-d tensors (``as_tensors=True`` stats) as Python floats in ONE host sync."""
    flat = [v for d in named for v in d.values()]
    if not flat:
        return [{} for _ in named]
    values = iter(torch.stack([v.detach().float().reshape(()) for v in flat]).tolist())
    return [{k: next(values) for k in d} for d in named]


def _masked_extreme(x: torch.Tensor, m: torch.Tensor, largest: bool) -> torch.Tensor:
    """Max (min) of x over the mask, 0 when the mask is empty; no host sync."""
    fill = torch.tensor(float("-inf") if largest else float("inf"), dtype=x.dtype, device=x.device)
    kept = torch.where(m, x, fill)
    extreme = kept.max() if largest else kept.min()
    return torch.where(m.any(), extreme, torch.zeros((), dtype=x.dtype, device=x.device))


def policy_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_ratio: float = 0.2,
    iw_cap: float | None = 2.0,
    token_weights: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    as_tensors: bool = False,
):
    """Decoupled PPO clip loss (the negated objective, to minimise).

    Per masked token: r = exp(logprobs - proximal_logprobs) (the PPO ratio against the proximal
    policy, recomputed by the learner before the update), w = min(exp(proximal - behaviour),
    iw_cap) (importance weight of the proximal policy against the actor's behaviour policy,
    truncated; no gradient through w; ``iw_cap=None`` = untruncated) and
    loss_i = -w * min(r * A, clip(r, 1 - clip_ratio, 1 + clip_ratio) * A); the loss is the token
    mean over ``mask``, or, with ``token_weights`` (same shape, 0 outside the mask), the weighted
    sum ``sum_i token_weights_i * loss_i`` (the caller's normalisation: see :func:`aggregation_weights`).
    Gradients flow only into ``logprobs``. ``stats["loss"]`` is the token mean either way.
    ``is_weights`` (same shape; ``trainer.off_policy`` other than ``cap``, from
    ``worldloop.learner.offpolicy.offpolicy_weights``) replaces w per token (no gradient either); the
    ``iw_*`` stats still describe exp(proximal - behaviour) before any truncation.

    stats: clip_fraction (tokens whose clipped term is the active one), approx_kl
    (mean of (r - 1) - log r, the k3 estimate of KL(proximal || new)), approx_kl_k1 (mean of
    proximal - new), ratio_mean/ratio_max/ratio_min, iw_mean/iw_max/iw_min (before truncation),
    iw_truncated_fraction (tokens with w > iw_cap), loss, tokens. ``as_tensors``: the stats as
    0-d tensors, no host sync (:func:`stats_floats` reads several dicts in one).
    """
    _check_policy_args(logprobs, proximal_logprobs, behaviour_logprobs, advantages, clip_ratio, iw_cap)
    m = _bool(mask, logprobs)
    zero = torch.zeros((), device=logprobs.device)
    lp = logprobs.float()
    prox = proximal_logprobs.detach().float()
    adv = torch.where(m, advantages.detach().float(), zero)
    log_ratio = torch.where(m, lp - prox, zero).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    log_w = torch.where(m, prox - behaviour_logprobs.detach().float(), zero).clamp(-20.0, 20.0)
    w_raw = torch.exp(log_w)
    if is_weights is not None:
        _same_shape("is_weights", is_weights, logprobs)
        w = torch.where(m, is_weights.detach().to(lp.device, torch.float32), zero)
    else:
        w = w_raw if iw_cap is None else w_raw.clamp(max=float(iw_cap))
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_ratio, 1.0 + clip_ratio)
    per_token = w * torch.maximum(unclipped, clipped)
    loss = masked_mean(per_token, m)
    weighted = loss if token_weights is None else weighted_sum(per_token, token_weights, m)
    named = _policy_stats(loss, m, clipped > unclipped, ratio, log_ratio, w_raw, iw_cap)
    return weighted, (named if as_tensors else _stats(named))


def _check_policy_args(logprobs, proximal_logprobs, behaviour_logprobs, advantages, clip_ratio, iw_cap) -> None:
    if not clip_ratio > 0:
        raise ValueError(f"clip_ratio: must be > 0, got {clip_ratio!r}")
    if iw_cap is not None and not iw_cap > 0:
        raise ValueError(f"iw_cap: must be > 0 or None, got {iw_cap!r}")
    for name, t in (("proximal_logprobs", proximal_logprobs), ("behaviour_logprobs", behaviour_logprobs), ("advantages", advantages)):
        _same_shape(name, t, logprobs)


@torch.no_grad()
def _policy_stats(loss, m, clip_active, ratio, log_ratio, w_raw, iw_cap) -> dict[str, torch.Tensor]:
    """The statistics :func:`policy_loss` documents, as 0-d tensors."""
    cap = iw_cap if iw_cap is not None else float("inf")
    return (
        {
            "loss": loss,
            "clip_fraction": masked_mean(clip_active.float(), m),
            "approx_kl": masked_mean(ratio - 1.0 - log_ratio, m),
            "approx_kl_k1": masked_mean(-log_ratio, m),
            "ratio_mean": masked_mean(ratio, m),
            "ratio_max": _masked_extreme(ratio, m, True),
            "ratio_min": _masked_extreme(ratio, m, False),
            "iw_mean": masked_mean(w_raw, m),
            "iw_max": _masked_extreme(w_raw, m, True),
            "iw_min": _masked_extreme(w_raw, m, False),
            "iw_truncated_fraction": masked_mean((w_raw > cap).float(), m),
            "tokens": m.sum(),
        }
    )


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, *,
               value_clip: float | None = 0.2, as_tensors: bool = False):
    """Clipped value loss (PPO): token mean of 0.5 * max((V - G)^2, (V_clip - G)^2).

    V_clip = old + clip(V - old, -value_clip, value_clip) with ``old_values`` the critic's values
    at advantage time; ``value_clip=None`` gives the plain 0.5 * (V - G)^2 (the factor 0.5 as in
    verl; VAGEN Alg. 1 writes (V - G)^2). Gradients flow only into ``values``.

    stats: loss, clip_fraction (tokens whose clipped error is the larger), value_mean,
    return_mean, mse (mean (V - G)^2), explained_variance (1 - Var(G - V) / Var(G)), tokens;
    ``as_tensors`` as in :func:`policy_loss`.
    """
    if value_clip is not None and not value_clip > 0:
        raise ValueError(f"value_clip: must be > 0 or None, got {value_clip!r}")
    for name, t in (("old_values", old_values), ("returns", returns)):
        _same_shape(name, t, values)
    m = _bool(mask, values)
    zero = torch.zeros((), device=values.device)
    v = torch.where(m, values.float(), zero)
    old = torch.where(m, old_values.detach().float(), zero)
    ret = torch.where(m, returns.detach().float(), zero)
    err = (v - ret) ** 2
    if value_clip is None:
        err_clipped = err
    else:
        err_clipped = (old + (v - old).clamp(-value_clip, value_clip) - ret) ** 2
    loss = masked_mean(0.5 * torch.maximum(err, err_clipped), m)
    with torch.no_grad():
        var_ret = masked_var(ret, m)
        stats = (
            {
                "loss": loss.detach(),
                "clip_fraction": masked_mean((err_clipped > err).float(), m),
                "value_mean": masked_mean(v, m),
                "return_mean": masked_mean(ret, m),
                "mse": masked_mean(err, m),
                "explained_variance": torch.where(var_ret > 0, 1.0 - masked_var(ret - v, m) / var_ret.clamp(min=1e-12), zero),
                "tokens": m.sum(),
            }
        )
    return loss, (stats if as_tensors else _stats(stats))


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' log-probs (as verl).

    kind: "kl"/"k1": logp - ref; "abs": |logp - ref|; "mse"/"k2": 0.5 * (logp - ref)^2;
    "low_var_kl"/"k3": exp(ref - logp) - (ref - logp) - 1, with ref - logp clamped to [-20, 20]
    and the result to [-10, 10]. No masking: mask the result yourself (token_rewards = -beta * kl).
    """
    _same_shape("ref_logprobs", ref_logprobs, logprobs)
    kind = kl_estimator_name(kind)  # a ValueError naming the known estimators
    diff = logprobs.float() - ref_logprobs.float()
    if kind == "kl":
        return diff
    if kind == "abs":
        return diff.abs()
    if kind == "mse":
        return 0.5 * diff * diff
    if kind == "low_var_kl":
        log_ratio = (-diff).clamp(-20.0, 20.0)
        return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"kind: KL estimator {kind!r} is registered but kl_penalty has no branch for it")
