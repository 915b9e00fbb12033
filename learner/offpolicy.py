"""Off-policy correction of the policy loss (``trainer.off_policy``) and the train-rollout mismatch.

Public API::

    OFF_POLICY_MODES                                   # cap, tis, seq_is_geo, mis, icepop
    log_ratios(proximal, behaviour, mask) -> [B, L]    # log(pi_prox / pi_b), 0 outside the mask
    sequence_log_ratios(log_rho, mask) -> [B]          # mean log ratio of each row's masked tokens
    offpolicy_weights(proximal, behaviour, mask, mode, *, cap, low, high, reduce=None) -> [B, L]
    mismatch_stats(proximal, behaviour, mask, versions, version, weights, *, reduce=None, gather=None) -> dict
    apply_correction(batch, trainer_cfg, version, dist) -> dict   # the trainer's per-update entry point
    export_mismatch(record)                            # the step record's "mismatch" to Prometheus

The three policies (decoupled PPO, Hilton et al. 2021): the actors sample with the behaviour policy
pi_b (log-probs ``behaviour_logprobs``, per token: a response whose tokens came from several
versions has each token's own); the learner recomputes the proximal log-probs pi_prox with the
weights it trains from (version v) before the update; pi_theta is the policy being updated. In
every mode the PPO ratio r_t = pi_theta / pi_prox is clipped at 1 +- ``clip_ratio`` as before, and
the correction is a per-token weight w_t (no gradient) on the clipped objective, formed from the
SAME ratio, proximal over behaviour, per token over the loss mask:

    rho_t = exp(clamp(log pi_prox(a_t) - log pi_b(a_t), -20, 20))
    g_i   = exp(mean over row i's masked tokens of log rho_t)      (geometric mean, per trajectory)

* ``cap`` (default): w_t = min(rho_t, C), C = ``trainer.importance_weight_cap``. The decoupled
  token cap, computed inside ``losses.policy_loss`` exactly as before (Yao et al.'s token TIS has
  this form).
* ``tis``: w_t = min(rho_t, C) / mean over the batch's loss tokens of min(rho, C): the same
  truncated token weights, self-normalised over the whole batch (all ranks; verl's
  ``rollout_is_batch_normalize``), so that truncation, which only lowers weights, does not shrink
  the average step: the weights' batch mean is exactly 1. That is its one difference from ``cap``.
* ``seq_is_geo``: w_t = min(g_i, C) on every token of trajectory i: one weight per sequence, the
  geometric mean of its token ratios (the plain product explodes with length), truncated at C.
* ``mis``: w_t = 1[L <= g_i <= H] * min(rho_t, C): whole trajectories whose geometric ratio leaves
  [L, H] = [``off_policy_low``, ``off_policy_high``] are rejected (weight 0, verl's geometric
  rejection); the kept ones get the ``cap`` weights.
* ``icepop``: w_t = 1[L <= rho_t <= H] * rho_t: single tokens whose ratio leaves [L, H] are
  rejected, the others weighted by their own ratio (IcePop's two-sided mask; H bounds it, so no
  truncation at C).

Loss tokens that no policy sampled (``vanilla_ppo``'s observation tokens) get w = 1 in every mode
but ``cap`` (whose numerics stay as they were). A rejected token keeps its place in the aggregation's normaliser (``trainer.loss_agg_mode``): it
contributes 0 to the loss, so a batch with many rejected tokens takes a smaller step (the loss mask
is not narrowed). Weights are 0 outside the mask, and NaN/inf there never reach them.

Mismatch (:func:`mismatch_stats`, every step, ``metrics.jsonl``'s ``mismatch`` and the
``worldloop_learner_mismatch_*`` gauges): over the batch's generated tokens, sampled from pi_b,
``kl`` = mean(log pi_b - log pi_prox) (k1: an unbiased estimate of KL(pi_b || pi_prox)) and
``kl_k3`` = mean(rho - 1 - log rho) (k3: never negative, lower variance); the same over the tokens
sampled with the weights being trained from (token version == v: only numerics differ there,
vLLM against the learner's kernels), ``kl_current`` / ``kl_k3_current`` (None without such
tokens); ``masked_token_fraction`` (generated tokens whose weight is 0) and
``masked_sequence_fraction`` (trajectories none of whose generated tokens kept a weight);
``ratio_p05/p50/p95`` (quantiles of rho over the generated tokens, linear interpolation).
"""

from __future__ import annotations

from typing import Callable

import torch

from worldloop.common.contracts.algorithms import OFF_POLICY_NAMES as OFF_POLICY_MODES
from worldloop.common.metrics import metric
from worldloop.learner.engine import all_reduce_sum

Reduce = Callable[[list[float]], list[float]]
Gather = Callable[[torch.Tensor], torch.Tensor]
QUANTILES = (("ratio_p05", 0.05), ("ratio_p50", 0.50), ("ratio_p95", 0.95))


def _mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor) or mask.shape != like.shape:
        raise ValueError(f"mask: expected a tensor of shape {tuple(like.shape)}, got {getattr(mask, 'shape', None)}")
    return mask != 0


def log_ratios(proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log(pi_prox / pi_b) per token, clamped to [-20, 20] as in ``policy_loss``; 0 outside the mask."""
    if behaviour.shape != proximal.shape:
        raise ValueError(f"behaviour: expected shape {tuple(proximal.shape)}, got {tuple(behaviour.shape)}")
    m = _mask(mask, proximal)
    diff = proximal.detach().float() - behaviour.detach().float()
    return torch.where(m, diff, torch.zeros((), dtype=diff.dtype)).clamp(-20.0, 20.0)


def sequence_log_ratios(log_rho: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per row: the mean of ``log_rho`` over its masked tokens (log of the geometric mean ratio;
    0 for a row with no masked token)."""
    m = _mask(mask, log_rho)
    return torch.where(m, log_rho, 0.0).sum(-1) / m.sum(-1).clamp(min=1)


def _identity(values: list[float]) -> list[float]:
    return [float(v) for v in values]


def offpolicy_weights(proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor, mode: str, *,
                      cap: float, low: float, high: float, reduce: Reduce | None = None) -> torch.Tensor:
    """The per-token weights w [B, L] of ``mode`` (module docstring; 0 outside ``mask``). ``reduce``
    sums a list of floats over ranks (``tis``'s batch mean); None = this batch is the whole batch."""
    if mode not in OFF_POLICY_MODES:
        raise ValueError(f"mode: unknown off-policy correction {mode!r}, expected one of {', '.join(OFF_POLICY_MODES)}")
    if not cap > 0 or not 0 < low < high:
        raise ValueError(f"bounds: need cap > 0 and 0 < low < high, got cap={cap!r}, low={low!r}, high={high!r}")
    m = _mask(mask, proximal)
    log_rho = log_ratios(proximal, behaviour, m)
    rho = torch.exp(log_rho)
    zero = torch.zeros((), dtype=rho.dtype)
    if mode in ("seq_is_geo", "mis"):
        geo = torch.exp(sequence_log_ratios(log_rho, m))[:, None].expand_as(rho)
        if mode == "seq_is_geo":
            w = geo.clamp(max=float(cap))
        else:
            w = torch.where((geo >= low) & (geo <= high), rho.clamp(max=float(cap)), zero)
    elif mode == "icepop":
        w = torch.where((rho >= low) & (rho <= high), rho, zero)
    else:
        w = rho.clamp(max=float(cap))
    w = torch.where(m, w, zero)
    if mode == "tis":
        total, count = (reduce or _identity)([float(w.sum()), float(m.sum())])
        mean = total / count if count > 0 else 1.0
        w = w / mean if mean > 0 else w
    return w


def _quantiles(values: torch.Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {k: None for k, _ in QUANTILES}
    q = torch.quantile(values.double(), torch.tensor([p for _, p in QUANTILES], dtype=torch.float64))
    return {k: float(v) for (k, _), v in zip(QUANTILES, q)}


def mismatch_stats(proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor, versions: torch.Tensor,
                   version: int | None, weights: torch.Tensor, *, reduce: Reduce | None = None,
                   gather: Gather | None = None) -> dict:
    """The train-rollout mismatch of a batch (module docstring). ``mask``: the generated tokens;
    ``versions`` [B, L]: the policy version that sampled each token; ``version``: the one the
    learner trains from (None: no ``*_current``); ``weights``: the off-policy weights (0 = masked).
    ``reduce`` sums floats over ranks, ``gather`` concatenates a 1-D tensor over ranks (None: one rank)."""
    reduce, gather = reduce or _identity, gather or (lambda x: x)
    m = _mask(mask, proximal)
    log_rho = log_ratios(proximal, behaviour, m)
    k3 = torch.exp(log_rho) - 1.0 - log_rho
    cur = m & (versions == version) if version is not None else torch.zeros_like(m)
    kept = m & (weights != 0)
    rows = m.any(-1)
    sums = reduce([float(m.sum()), float(-log_rho[m].sum()), float(k3[m].sum()), float(cur.sum()),
                   float(-log_rho[cur].sum()), float(k3[cur].sum()), float((m & ~kept).sum()),
                   float(rows.sum()), float((rows & ~kept.any(-1)).sum())])
    n, k1, k3s, n_cur, k1_cur, k3_cur, n_masked, n_rows, masked_rows = sums
    out = {
        "tokens": n, "kl": k1 / n if n else 0.0, "kl_k3": k3s / n if n else 0.0,
        "current_tokens": n_cur, "kl_current": k1_cur / n_cur if n_cur else None,
        "kl_k3_current": k3_cur / n_cur if n_cur else None,
        "masked_token_fraction": n_masked / n if n else 0.0,
        "masked_sequence_fraction": masked_rows / n_rows if n_rows else 0.0,
    }
    out.update(_quantiles(torch.exp(gather(log_rho[m].double()))))
    return out


def export_mismatch(record: dict | None) -> None:
    """Set the ``worldloop_learner_mismatch_*`` gauges from a step record's ``mismatch`` (a value
    that is None, e.g. no token sampled with the current weights, leaves its gauge as it was)."""
    if not record:
        return
    for tokens, k1, k3 in (("all", "kl", "kl_k3"), ("current", "kl_current", "kl_k3_current")):
        for estimator, key in (("k1", k1), ("k3", k3)):
            if record.get(key) is not None:
                metric("worldloop_learner_mismatch_kl").labels(tokens=tokens, estimator=estimator).set(record[key])
    for unit in ("token", "sequence"):
        metric("worldloop_learner_mismatch_masked_fraction").labels(unit=unit).set(record[f"masked_{unit}_fraction"])
    for key, _ in QUANTILES:
        if record.get(key) is not None:
            metric("worldloop_learner_mismatch_ratio").labels(quantile=key[len("ratio_"):]).set(record[key])


def _gather_fn(dist) -> Gather | None:
    """Concatenation of a 1-D tensor over ranks, in rank order (None on one rank)."""
    if dist.world_size == 1:
        return None

    def gather(x: torch.Tensor) -> torch.Tensor:
        counts = all_reduce_sum([float(x.numel()) if r == dist.rank else 0.0 for r in range(dist.world_size)], dist)
        start = int(sum(counts[: dist.rank]))
        buf = [0.0] * int(sum(counts))
        buf[start : start + x.numel()] = x.double().tolist()
        return torch.tensor(all_reduce_sum(buf, dist), dtype=torch.float64)

    return gather


def apply_correction(batch: dict, t, version: int | None, dist) -> dict:
    """This rank's rows of an update (``batch`` holds ``old_logprobs``, the proximal log-probs,
    ``behaviour_logprobs``, ``response_mask``, ``loss_mask`` and ``policy_version``, per token):
    with ``t.off_policy`` other than ``cap``, ``batch["is_weight"]`` (the weights of
    :func:`offpolicy_weights` over the generated loss tokens, 1 on the loss tokens no policy sampled);
    returns the batch's :func:`mismatch_stats` (the same on every rank)."""
    reduce = (lambda xs: all_reduce_sum(xs, dist)) if dist.world_size > 1 else None
    prox, beh, loss = batch["old_logprobs"], batch["behaviour_logprobs"], batch["loss_mask"] != 0
    gen = batch["response_mask"] != 0
    if t.off_policy == "cap":
        # the weights policy_loss computes itself, for the masked shares only
        weights = torch.exp(log_ratios(prox, beh, gen)).clamp(max=float(t.importance_weight_cap))
    else:
        weights = offpolicy_weights(prox, beh, gen & loss, t.off_policy, cap=t.importance_weight_cap,
                                    low=t.off_policy_low, high=t.off_policy_high, reduce=reduce)
        batch["is_weight"] = torch.where(loss & ~gen, torch.ones_like(weights), weights)
    return mismatch_stats(prox, beh, gen, batch["policy_version"], version, weights, reduce=reduce,
                          gather=_gather_fn(dist))
