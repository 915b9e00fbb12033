"""Advantage estimators of the learner: pure functions on right-padded [B, L] tensors.

Public API::

    masked_gae(*, values, response_mask, turn_end_mask, turn_rewards, token_rewards=None,
               gamma=1.0, lam=1.0) -> (advantages, returns)
    bilevel_gae(*, values, response_mask, turn_end_mask, turn_rewards, token_rewards=None,
                gamma_turn=0.95, lam_turn=1.0, gamma_token=1.0, lam_token=1.0,
                kl_routing="own_turn") -> (adv, ret)
    turn_ppo(*, values, response_mask, turn_end_mask, turn_rewards, token_rewards=None,
             gamma_turn=0.95, lam_turn=1.0) -> (adv, ret)
    grpo(*, response_mask, turn_end_mask, turn_rewards, group_ids, token_rewards=None,
         values=None, eps=1e-6, norm_by_std=True) -> (adv, ret)
    gigpo(*, response_mask, turn_end_mask, turn_rewards, group_ids, anchors, token_rewards=None,
          values=None, eps=1e-6, norm_by_std=True, step_gamma=0.95, step_weight=1.0) -> (adv, ret)
    step_group_sizes(group_ids, anchors) -> list[list[int]]   # GiGPO step-group size of every turn
    grounding_turn_advantages(scores, keys, coef=1.0) -> list[list[float | None]]
    vanilla_ppo(*, values, response_mask, attention_mask, turn_end_mask, turn_rewards,
                token_rewards=None, gamma=1.0, lam=1.0) -> (adv, ret)
    compute_advantages(estimator, **kwargs) -> (adv, ret)     # dispatcher, see its docstring
    advantage_kwargs(trainer_cfg) -> dict                      # discounts, kl_routing, norm_by_std, step_*
    loss_mask_for(estimator, response_mask, attention_mask) -> mask for the policy/value losses
    whiten(x, mask, shift_mean=True) -> x whitened over the masked elements

Inputs (all [B, L], one row per trajectory, right padding; masks may be bool or 0/1 numbers):

- ``values``: critic values, ``values[b, i]`` = V(prefix before token i), the value of the
  state in which token i is generated (the same alignment as ``worldloop.common.contracts.modeling.token_logprobs``).
- ``response_mask``: 1 on generated tokens (``SequenceLayout.response_mask``).
- ``turn_end_mask``: 1 at the last generated token of each turn; must lie inside
  ``response_mask`` and the last generated token of a row must be a turn end.
- ``turn_rewards``: turn t's reward r_t at its end token, 0 on the other generated tokens (a
  nonzero there raises ValueError); read only at turn ends.
- ``token_rewards``: per-token terms such as -beta*KL; read only on the estimator's mask.

Every output is float32 on the inputs' device and exactly 0 outside the estimator's loss mask
(``response_mask``; for ``vanilla_ppo`` the wider mask of :func:`loss_mask_for`). Nothing is
read at padded positions: NaN or garbage there changes nothing. Bad input (shapes, masks) raises
ValueError naming the argument. The loops are over the packed sequence length (generated tokens
only) or over turns, never over the batch; see ``bench/advantages.py`` for the speed.

Estimators, exactly as implemented (VAGEN, arXiv 2510.16907: Alg. 1, Sec. 5.2 + Alg. 2, Sec. 4
baselines; Argos Eq. 10 for GRPO):

- ``masked_gae`` (VAGEN-Base, Alg. 1): token-level GAE over the generated tokens of a row in
  order, skipping observation tokens. r_i = token_rewards_i, plus R = sum_t r_t at the row's
  last generated token. delta_i = r_i + gamma*V_j - V_i with j the next generated token (V = 0
  after the last one), A_i = delta_i + gamma*lam*A_j, returns G_i = A_i + V_i.
- ``bilevel_gae`` (VAGEN-Full, Alg. 2): turn level over the turns of a row with V_t = V at turn
  t's end token: delta_t = r_t + gamma_turn*V_{t+1} - V_t (V_T = 0),
  A_t = delta_t + gamma_turn*lam_turn*A_{t+1}. Token level inside each turn: at the turn's last
  token A = token_rewards_last + A_t; for the other tokens delta_i = token_rewards_i +
  gamma_token*V_{i+1} - V_i, A_i = delta_i + gamma_token*lam_token*A_{i+1} (i+1 is the next
  token of the same turn). G_i = A_i + V_i. Turns are found from ``turn_end_mask`` only, so a
  turn with reward exactly 0 is still a turn. Alg. 2 line 17-18 writes the last token's value
  as delta = r_KL + gamma_token*V(tau<=a_t) - V(tau<(t,J-1)) plus A_t; with both values read at
  the turn end token (the alignment above) that bootstrap term is (gamma_token - 1)*V_end, which
  is 0 for the default gamma_token = 1; we leave it out for every gamma_token so that a
  one-turn trajectory gives exactly ``masked_gae``.
  Where the turn-end token's own token_rewards term k_end (its -beta*KL) enters is
  ``kl_routing``: ``"own_turn"`` (default) as above, A_end = k_end + A_t, so it stays on its own
  turn; ``"turn_reward"`` (VAGEN's reference code, verl core_algos.py
  compute_bi_level_gae_advantage_return: the token reward at the end token, r_t - beta*KL_end, is
  the turn-level reward) uses r_t + k_end as the turn reward in delta_t and sets A_end = A_t, so
  k_end also reaches the earlier turns, discounted by (gamma_turn*lam_turn)^k. The two agree
  when k_end = 0 (e.g. beta = 0).
- ``turn_ppo`` (Turn-PPO w/ mask): the turn is one action. r'_t = r_t + sum of token_rewards
  over the turn's tokens, V_t = V at the turn's FIRST generated token (the value of the state
  the turn acts in), delta_t = r'_t + gamma_turn*V_{t+1} - V_t (V_T = 0), A_t = delta_t +
  gamma_turn*lam_turn*A_{t+1}; every token of turn t gets A_t and the return G_t = A_t + V_t.
- ``grpo`` (GRPO w/ mask, no critic): score R_b = sum_t r_t + sum of token_rewards over the
  response (pass token_rewards=None for outcome only); A_b = (R_b - mean_g) / (std_g + eps)
  over the rows of b's group g (std with Bessel's correction, as torch.std), broadcast to b's
  generated tokens. A group of size 1 has no baseline: its advantage is 0 (the row carries no
  policy-gradient signal), as is every row of a group whose scores are all equal. ``returns``
  is R_b broadcast (there is no critic to train). ``norm_by_std=False``: A_b = R_b - mean_g.
- ``gigpo`` (GiGPO, Feng et al. 2025, arXiv 2505.10978, no critic): the episode advantage A_E of
  ``grpo`` (same score, group, std option and group-of-one rule) plus a step advantage per turn.
  Step return R_t = sum_{k>=t} step_gamma^(k-t) r_k over the row's turn rewards (token_rewards
  enter the episode score only). Turns of the same group whose ``anchors`` (one hashable per turn:
  the environment state before the turn) are equal form a step group s (across rows and turn
  indices); A_S = R_t - mean_s (divided by std_s + eps with ``norm_by_std``; a step group of one
  gets 0). Every generated token of turn t gets A = A_E + step_weight * A_S; ``returns`` is R_t on
  the turn's tokens. Differences from verl-agent's ``core_gigpo.py``: one row is a whole
  trajectory (there: a turn), the episode baseline is over the group's trajectories (there:
  over its turns, ``compute_mean_std_cross_steps``), and an episode group of one gets 0 (there:
  its raw score).
- ``vanilla_ppo`` (Vanilla-PPO, no observation masking): ``masked_gae`` run over every token
  from the row's first generated token to its last attended token, observation tokens
  included as if they were actions (their values and token_rewards are read), R at the last
  generated token. Its loss mask is that wider mask: use :func:`loss_mask_for`.
"""

from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch

from worldloop.common.contracts.algorithms import ESTIMATOR_NAMES, estimator_spec
from worldloop.learner.losses import masked_var

# the names and what each estimator needs live in one registry (common/contracts/algorithms.py)
ESTIMATORS = ESTIMATOR_NAMES
# bilevel_gae: where the turn-end token's token_rewards (-beta*KL) go (TrainerConfig.bilevel_kl_routing)
KL_ROUTINGS = ("own_turn", "turn_reward")


# --------------------------------------------------------------------------- input handling


def _mask(x: Any, name: str, shape: torch.Size | None, device: torch.device | None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2 or (shape is not None and x.shape != shape):
        raise ValueError(f"{name}: expected shape {tuple(shape) if shape is not None else '[B, L]'}, got {tuple(x.shape)}")
    return (x != 0).to(device) if device is not None else x != 0


def _floats(x: Any, name: str, shape: torch.Size, device: torch.device) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.shape != shape:
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(x.shape)}")
    if not (x.is_floating_point() or x.dtype in (torch.int32, torch.int64, torch.bool)):
        raise ValueError(f"{name}: expected a real tensor, got dtype {x.dtype}")
    return x.to(device=device, dtype=torch.float32)


def _discount(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{name}: must be a number in [0, 1], got {value!r}")
    return float(value)


def _last_index(mask: torch.Tensor) -> torch.Tensor:
    """[B] index of the last True of each row (L-1 for an empty row; callers ignore those)."""
    length = mask.shape[1]
    return (length - 1) - mask.flip(1).to(torch.uint8).argmax(1)


class _Batch:
    """Validated, float32 views of the shared inputs; nothing is read where it must not be."""

    def __init__(self, response_mask, turn_end_mask, turn_rewards, token_rewards=None, values=None):
        self.response = _mask(response_mask, "response_mask", None, None)
        self.shape, self.device = self.response.shape, self.response.device
        self.end = _mask(turn_end_mask, "turn_end_mask", self.shape, self.device)
        rewards = _floats(turn_rewards, "turn_rewards", self.shape, self.device)
        tok = (
            torch.zeros(self.shape, device=self.device)
            if token_rewards is None
            else _floats(token_rewards, "token_rewards", self.shape, self.device)
        )
        self.values = None if values is None else _floats(values, "values", self.shape, self.device)
        self.last = _last_index(self.response)
        has_response = self.response.any(1)
        # one host sync for all checks
        outside, open_end, stray = torch.stack(
            [
                (self.end & ~self.response).any(),
                (has_response & ~self.end.gather(1, self.last[:, None]).squeeze(1)).any(),
                (self.response & ~self.end & (rewards != 0)).any(),
            ]
        ).tolist()
        if outside:
            raise ValueError("turn_end_mask: has a 1 outside response_mask (a turn ends at a generated token)")
        if open_end:
            raise ValueError("turn_end_mask: a row's last generated token is not a turn end (every turn must be closed)")
        if stray:
            raise ValueError("turn_rewards: nonzero on a generated token that is not a turn end (put r_t at its end token)")
        self.turn_rewards = torch.where(self.end, rewards, 0.0)  # r_t at ends, 0 elsewhere
        self.token_rewards_raw = tok  # read only through a mask
        self.total = self.turn_rewards.sum(1)  # sum_t r_t per row

    def token_rewards(self, mask: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, self.token_rewards_raw, 0.0)


class _Packing:
    """Left-packs the positions a [B, L] bool mask selects into [B, N], keeping row order."""

    def __init__(self, mask: torch.Tensor):
        self.mask = mask
        self.rows = mask.shape[0]
        counts = mask.sum(1)
        self.n = int(counts.max()) if mask.numel() else 0
        rank = mask.long().cumsum(1) - 1
        self.index = torch.where(mask, rank, self.n)  # unselected positions go to a dump column
        self.valid = torch.arange(self.n, device=mask.device) < counts[:, None]

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(self.rows, self.n + 1, dtype=x.dtype, device=x.device)
        out.scatter_(1, self.index, torch.where(self.mask, x, torch.zeros((), dtype=x.dtype, device=x.device)))
        return out[:, : self.n]

    def unpack(self, y: torch.Tensor) -> torch.Tensor:
        """Back to [B, L]; exactly 0 at unselected positions."""
        y = torch.cat([y, y.new_zeros(self.rows, 1)], dim=1)
        return y.gather(1, self.index)


def _next(x: torch.Tensor) -> torch.Tensor:
    """x shifted left by one along dim 1, 0 after the last column."""
    return torch.cat([x[:, 1:], x.new_zeros(x.shape[0], 1)], dim=1)


def _reverse_scan(x: torch.Tensor, coef: torch.Tensor | float) -> torch.Tensor:
    """A[:, k] = x[:, k] + coef[:, k] * A[:, k + 1] with A[:, N] = 0 (one op per column)."""
    rows, n = x.shape
    out = torch.zeros(n + 1, rows, dtype=x.dtype, device=x.device)
    xt = x.t().contiguous()
    if isinstance(coef, torch.Tensor):
        ct = coef.to(x.dtype).t().contiguous()
        for k in range(n - 1, -1, -1):
            torch.addcmul(xt[k], ct[k], out[k + 1], out=out[k])
    else:
        for k in range(n - 1, -1, -1):
            torch.add(xt[k], out[k + 1], alpha=coef, out=out[k])
    return out[:n].t()


def _token_gae(mask: torch.Tensor, values: torch.Tensor, rewards: torch.Tensor, gamma: float, lam: float):
    """GAE over the masked positions of each row as one chain (unmasked positions skipped)."""
    p = _Packing(mask)
    v, r = p.pack(values), p.pack(rewards)
    delta = r + gamma * _next(v) - v  # the packed tail is 0, so V after the last token is 0
    adv = _reverse_scan(delta, gamma * lam)
    return p.unpack(adv), p.unpack(adv + v)


def _with_total_at_last(b: _Batch, mask: torch.Tensor) -> torch.Tensor:
    """token_rewards on ``mask`` plus the row's total turn reward at its last generated token."""
    r = b.token_rewards(mask)
    return r.scatter_add(1, b.last[:, None], b.total[:, None])  # total is 0 for an empty row


# --------------------------------------------------------------------------- estimators


def masked_gae(*, values, response_mask, turn_end_mask, turn_rewards, token_rewards=None, gamma: float = 1.0, lam: float = 1.0):
    """Token-level GAE over generated tokens only (VAGEN Alg. 1); see the module docstring."""
    gamma, lam = _discount(gamma, "gamma"), _discount(lam, "lam")
    b = _Batch(response_mask, turn_end_mask, turn_rewards, token_rewards, values)
    return _token_gae(b.response, b.values, _with_total_at_last(b, b.response), gamma, lam)


def _turn_gae(values_t: torch.Tensor, rewards_t: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
    """GAE over packed turns [B, T] (0 past a row's last turn, so V_T = 0 there)."""
    return _reverse_scan(rewards_t + gamma * _next(values_t) - values_t, gamma * lam)


def bilevel_gae(
    *,
    values,
    response_mask,
    turn_end_mask,
    turn_rewards,
    token_rewards=None,
    gamma_turn: float = 0.95,
    lam_turn: float = 1.0,
    gamma_token: float = 1.0,
    lam_token: float = 1.0,
    kl_routing: str = "own_turn",
):
    """Bi-Level GAE (VAGEN Sec. 5.2, Alg. 2): turn-level GAE, then token-level GAE in each turn.

    ``kl_routing``: where the turn-end token's token_rewards term goes, ``"own_turn"`` (into that
    token's advantage only) or ``"turn_reward"`` (into the turn-level reward, as VAGEN's code);
    see the module docstring.
    """
    gamma_turn, lam_turn = _discount(gamma_turn, "gamma_turn"), _discount(lam_turn, "lam_turn")
    gamma_token, lam_token = _discount(gamma_token, "gamma_token"), _discount(lam_token, "lam_token")
    if kl_routing not in KL_ROUTINGS:
        raise ValueError(f"kl_routing: expected one of {', '.join(KL_ROUTINGS)}, got {kl_routing!r}")
    b = _Batch(response_mask, turn_end_mask, turn_rewards, token_rewards, values)
    to_turn = kl_routing == "turn_reward"
    turns = _Packing(b.end)
    r_turn = b.turn_rewards + b.token_rewards(b.end) if to_turn else b.turn_rewards
    adv_turn = _turn_gae(turns.pack(b.values), turns.pack(r_turn), gamma_turn, lam_turn)
    tok = _Packing(b.response)
    v, r = tok.pack(b.values), tok.pack(b.token_rewards(b.response))
    end = tok.pack(b.end.float()) > 0
    seed = tok.pack(turns.unpack(adv_turn))  # A_t at turn t's last token, 0 elsewhere
    delta = r + gamma_token * _next(v) - v
    x = torch.where(end, seed if to_turn else r + seed, delta)
    coef = torch.where(end, 0.0, gamma_token * lam_token)  # a turn's chain stops at its end token
    adv = _reverse_scan(x, coef)
    return tok.unpack(adv), tok.unpack(adv + v)


def turn_ppo(*, values, response_mask, turn_end_mask, turn_rewards, token_rewards=None, gamma_turn: float = 0.95, lam_turn: float = 1.0):
    """Turn-level PPO: one advantage per turn, shared by all its tokens; see the module docstring."""
    gamma_turn, lam_turn = _discount(gamma_turn, "gamma_turn"), _discount(lam_turn, "lam_turn")
    b = _Batch(response_mask, turn_end_mask, turn_rewards, token_rewards, values)
    tok = _Packing(b.response)
    end = tok.pack(b.end.long())
    turn_of = end.cumsum(1) - end  # turn index of each packed token
    n_turns = int(b.end.sum(1).max()) if b.end.numel() else 0
    rows = b.shape[0]
    if n_turns == 0:
        zero = torch.zeros(b.shape, device=b.device)
        return zero, zero.clone()
    slot = torch.where(tok.valid, turn_of, n_turns)  # invalid tail -> dump column
    first = tok.valid & (torch.cat([torch.ones_like(end[:, :1]), end[:, :-1]], dim=1) > 0)
    v_tok = tok.pack(b.values)
    r_tok = tok.pack(b.token_rewards(b.response) + b.turn_rewards)  # r_t sits on the end token
    v_turn = torch.zeros(rows, n_turns + 1, device=b.device).scatter_add_(1, slot, torch.where(first, v_tok, 0.0))
    r_turn = torch.zeros(rows, n_turns + 1, device=b.device).scatter_add_(1, slot, r_tok)
    adv_turn = _turn_gae(v_turn[:, :n_turns], r_turn[:, :n_turns], gamma_turn, lam_turn)
    ret_turn = adv_turn + v_turn[:, :n_turns]
    pad = torch.zeros(rows, 1, device=b.device)
    adv = torch.cat([adv_turn, pad], 1).gather(1, slot)
    ret = torch.cat([ret_turn, pad], 1).gather(1, slot)
    return tok.unpack(adv), tok.unpack(ret)


def _group_index(group_ids: Any, rows: int, device: torch.device) -> torch.Tensor:
    if isinstance(group_ids, torch.Tensor):
        if group_ids.dim() != 1 or group_ids.numel() != rows:
            raise ValueError(f"group_ids: expected {rows} ids (one per row), got shape {tuple(group_ids.shape)}")
        return torch.unique(group_ids.to(device), return_inverse=True)[1]
    if isinstance(group_ids, (str, bytes)) or not isinstance(group_ids, Sequence):
        raise ValueError(f"group_ids: expected a [B] tensor or a sequence of ids, got {type(group_ids).__name__}")
    if len(group_ids) != rows:
        raise ValueError(f"group_ids: expected {rows} ids (one per row), got {len(group_ids)}")
    seen: dict[Any, int] = {}
    index = [seen.setdefault(g, len(seen)) for g in group_ids]
    return torch.tensor(index, dtype=torch.long, device=device)


def _group_normalise(score: torch.Tensor, gid: torch.Tensor, eps: float, norm_by_std: bool) -> torch.Tensor:
    """(score - mean_g) [/ (std_g + eps)] over the entries of each group g = gid (Bessel std); 0 for a
    group of one and for a group whose scores are all equal."""
    n = score.shape[0]
    groups = int(gid.max()) + 1 if n else 0
    count = torch.zeros(groups, device=score.device).index_add_(0, gid, torch.ones(n, device=score.device))
    mean = torch.zeros(groups, device=score.device).index_add_(0, gid, score) / count
    dev = score - mean[gid]  # exactly 0 for a group of one
    if not norm_by_std:
        return dev
    var = torch.zeros(groups, device=score.device).index_add_(0, gid, dev * dev) / (count - 1).clamp(min=1)
    return dev / (var.sqrt()[gid] + eps)


def grpo(*, response_mask, turn_end_mask, turn_rewards, group_ids, token_rewards=None, values=None, eps: float = 1e-6,
         norm_by_std: bool = True):
    """Group-normalised trajectory score (Argos Eq. 10), on generated tokens; ``values`` unused.

    A group of size 1 gets advantage 0 (no baseline to compare with), as does a group whose
    scores are all equal; see the module docstring. ``norm_by_std=False`` leaves the division by
    the group's std out, A_b = R_b - mean_g (verl's ``norm_adv_by_std_in_grpo=False``, "Dr. GRPO"):
    a group whose scores differ only by small shaping terms then gets a small advantage instead of
    one scaled up to unit std.
    """
    b = _Batch(response_mask, turn_end_mask, turn_rewards, token_rewards)
    gid = _group_index(group_ids, b.shape[0], b.device)
    score = b.total + b.token_rewards(b.response).sum(1)
    adv = _group_normalise(score, gid, eps, norm_by_std)
    zero = torch.zeros((), device=b.device)
    return torch.where(b.response, adv[:, None], zero), torch.where(b.response, score[:, None], zero)


def _step_groups(group_ids: Any, anchors: Any, counts: list[int]) -> tuple[list[int], list[int]]:
    """Step-group index and size of every turn, rows in order and turns in order (flattened)."""
    if isinstance(anchors, (str, bytes)) or not isinstance(anchors, Sequence) or len(anchors) != len(counts):
        raise ValueError(f"anchors: expected one sequence per row ({len(counts)} rows), got {type(anchors).__name__}")
    groups = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    index: dict[Any, int] = {}
    flat: list[int] = []
    for b, (row, n) in enumerate(zip(anchors, counts)):
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence) or len(row) != n:
            raise ValueError(f"anchors[{b}]: expected {n} anchors (one per turn), got {row!r:.80}")
        try:
            flat += [index.setdefault((groups[b], a), len(index)) for a in row]
        except TypeError:
            raise ValueError(f"anchors[{b}]: anchors must be hashable") from None
    sizes = [0] * len(index)
    for i in flat:
        sizes[i] += 1
    return flat, [sizes[i] for i in flat]


def step_group_sizes(group_ids: Any, anchors: Sequence[Sequence[Any]]) -> list[list[int]]:
    """The size of every turn's GiGPO step group (turns of one group with equal anchors), per row."""
    counts = [len(row) for row in anchors] if isinstance(anchors, Sequence) else []
    if len(group_ids) != len(counts):
        raise ValueError(f"group_ids: expected {len(counts)} ids (one per row), got {len(group_ids)}")
    _, sizes = _step_groups(group_ids, anchors, counts)
    out, k = [], 0
    for n in counts:
        out.append(sizes[k : k + n])
        k += n
    return out


def gigpo(*, response_mask, turn_end_mask, turn_rewards, group_ids, anchors, token_rewards=None, values=None,
          eps: float = 1e-6, norm_by_std: bool = True, step_gamma: float = 0.95, step_weight: float = 1.0):
    """GiGPO: the episode advantage of :func:`grpo` plus ``step_weight`` x the step advantage of each
    turn against the turns of its group that started from the same state (``anchors[b][t]``); see
    the module docstring. ``values`` unused."""
    step_gamma = _discount(step_gamma, "step_gamma")
    if isinstance(step_weight, bool) or not isinstance(step_weight, (int, float)) or not 0 <= float(step_weight) < float("inf"):
        raise ValueError(f"step_weight: must be a finite number >= 0, got {step_weight!r}")
    b = _Batch(response_mask, turn_end_mask, turn_rewards, token_rewards)
    gid = _group_index(group_ids, b.shape[0], b.device)
    episode = _group_normalise(b.total + b.token_rewards(b.response).sum(1), gid, eps, norm_by_std)
    turns = _Packing(b.end)
    ret_turn = _reverse_scan(turns.pack(b.turn_rewards), step_gamma)  # 0 past a row's last turn
    flat, _ = _step_groups(group_ids, anchors, b.end.sum(1).tolist())
    step = torch.zeros_like(ret_turn)
    if flat:
        sgid = torch.tensor(flat, dtype=torch.long, device=b.device)
        step[turns.valid] = _group_normalise(ret_turn[turns.valid], sgid, eps, norm_by_std)
    adv_turn = episode[:, None] + float(step_weight) * step
    tok = _Packing(b.response)
    end = tok.pack(b.end.long())
    slot = torch.where(tok.valid, end.cumsum(1) - end, turns.n)  # turn index of each packed token
    pad = torch.zeros(b.shape[0], 1, device=b.device)
    adv = torch.cat([adv_turn, pad], 1).gather(1, slot)
    ret = torch.cat([ret_turn, pad], 1).gather(1, slot)
    return tok.unpack(adv), tok.unpack(ret)


def grounding_turn_advantages(scores: Sequence[Sequence[float | None]], keys: Sequence[Sequence[Any]],
                              coef: float = 1.0) -> list[list[float | None]]:
    """The observation advantage of every turn: ``coef * (g - mean of g over the turns with the same
    key)``, where g = ``scores[b][t]`` (the turn's grounding score; None: the turn takes no part and
    gets None) and ``keys[b][t]`` its baseline (hashable: its GRPO group, or its GiGPO step group).
    A turn alone with its key gets 0."""
    if len(scores) != len(keys) or any(len(s) != len(k) for s, k in zip(scores, keys)):
        raise ValueError("scores, keys: expected the same number of rows and of turns per row")
    total: dict[Any, list[float]] = {}
    for row_s, row_k in zip(scores, keys):
        for g, k in zip(row_s, row_k):
            if g is not None:
                acc = total.setdefault(k, [0.0, 0.0])
                acc[0] += float(g)
                acc[1] += 1.0
    return [[None if g is None else coef * (float(g) - total[k][0] / total[k][1]) for g, k in zip(row_s, row_k)]
            for row_s, row_k in zip(scores, keys)]


def _vanilla_mask(response: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """Every attended token from the row's first generated token on."""
    return attention & (response.long().cumsum(1) > 0)


def vanilla_ppo(*, values, response_mask, attention_mask, turn_end_mask, turn_rewards, token_rewards=None, gamma: float = 1.0, lam: float = 1.0):
    """Vanilla-PPO baseline: token GAE without observation masking; loss mask = loss_mask_for()."""
    gamma, lam = _discount(gamma, "gamma"), _discount(lam, "lam")
    b = _Batch(response_mask, turn_end_mask, turn_rewards, token_rewards, values)
    attention = _mask(attention_mask, "attention_mask", b.shape, b.device)
    if (b.response & ~attention).any():
        raise ValueError("attention_mask: is 0 on a generated token")
    wide = _vanilla_mask(b.response, attention)
    return _token_gae(wide, b.values, _with_total_at_last(b, wide), gamma, lam)


# --------------------------------------------------------------------------- helpers


def loss_mask_for(estimator: str, response_mask: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The mask the policy and value losses use with ``estimator`` (dtype of response_mask).

    ``response_mask`` for every estimator but ``vanilla_ppo``, whose mask also covers the
    observation tokens after the first response (every attended token from the first generated
    token on); that one needs ``attention_mask``.
    """
    if not estimator_spec(estimator).loss_on_observations:
        return response_mask
    if attention_mask is None:
        raise ValueError("loss_mask_for('vanilla_ppo', ...): attention_mask is required")
    response = _mask(response_mask, "response_mask", None, None)
    attention = _mask(attention_mask, "attention_mask", response.shape, response.device)
    return _vanilla_mask(response, attention).to(response_mask.dtype)


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked elements of the whole tensor; 0 outside.

    var is the unbiased (Bessel) variance, 0 when fewer than 2 elements are masked. With
    ``shift_mean=False`` the mean is added back (scale only). Reads nothing outside the mask.
    Over the global batch: call it once on the full batch, before splitting into mini-batches.
    """
    if not isinstance(mask, torch.Tensor) or mask.shape != x.shape:
        raise ValueError(f"mask: expected a tensor of shape {tuple(x.shape)}, got {getattr(mask, 'shape', type(mask).__name__)}")
    m = (mask != 0).to(x.device)
    xs = torch.where(m, x.float(), 0.0)
    mean, var = masked_var(xs, m, unbiased=True, return_mean=True)
    out = (xs - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(m, out, 0.0)


_FUNCTIONS = {
    "masked_gae": masked_gae,
    "bilevel_gae": bilevel_gae,
    "turn_ppo": turn_ppo,
    "grpo": grpo,
    "gigpo": gigpo,
    "vanilla_ppo": vanilla_ppo,
}
# discount keywords the dispatcher accepts for any estimator and drops where unused
_DISCOUNTS = ("gamma", "lam", "gamma_turn", "lam_turn", "gamma_token", "lam_token")


def _check_estimator(estimator: str) -> None:
    estimator_spec(estimator)  # a ValueError naming the known estimators
    if estimator not in _FUNCTIONS:
        raise ValueError(f"estimator: {estimator!r} is registered but has no implementation in learner/advantages.py")


def compute_advantages(estimator: str, **kwargs):
    """Run ``estimator`` (a ``TrainerConfig.estimator`` value) on keyword tensors.

    Accepts every estimator's keywords at once so that a caller can pass the same set for any
    estimator: the discount keywords (``gamma, lam, gamma_turn, lam_turn, gamma_token,
    lam_token``, e.g. from :func:`advantage_kwargs`), ``values`` (not read by grpo, gigpo),
    ``group_ids``, ``eps`` and ``norm_by_std`` (grpo, gigpo), ``anchors``, ``step_gamma`` and
    ``step_weight`` (gigpo only), ``attention_mask`` (vanilla_ppo only), ``kl_routing`` (bilevel_gae
    only) are dropped where the estimator does not use them. Any other unknown keyword is a TypeError.
    """
    _check_estimator(estimator)
    fn = _FUNCTIONS[estimator]
    accepted = set(inspect.signature(fn).parameters)
    known = set().union(*(inspect.signature(f).parameters for f in _FUNCTIONS.values()))
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise TypeError(f"compute_advantages: unknown keyword(s) {', '.join(unknown)}")
    return fn(**{k: v for k, v in kwargs.items() if k in accepted})


def advantage_kwargs(trainer_cfg: Any) -> dict[str, Any]:
    """The discount keywords of ``worldloop.common.contracts.config.TrainerConfig`` for :func:`compute_advantages`,
    plus ``kl_routing`` from ``bilevel_kl_routing``, ``norm_by_std`` from ``grpo_norm_by_std`` and
    ``step_gamma`` / ``step_weight`` from ``gigpo_gamma`` / ``gigpo_step_weight``.

    masked_gae/vanilla_ppo use gamma, lam; bilevel_gae the four turn/token ones and kl_routing;
    turn_ppo gamma_turn, lam_turn (its discount is across turns); grpo none; gigpo step_gamma.
    """
    out: dict[str, Any] = {k: float(getattr(trainer_cfg, k)) for k in _DISCOUNTS}
    out["kl_routing"] = str(getattr(trainer_cfg, "bilevel_kl_routing", "own_turn"))
    out["norm_by_std"] = bool(getattr(trainer_cfg, "grpo_norm_by_std", True))
    out["step_gamma"] = float(getattr(trainer_cfg, "gigpo_gamma", 0.95))
    out["step_weight"] = float(getattr(trainer_cfg, "gigpo_step_weight", 1.0))
    return out
