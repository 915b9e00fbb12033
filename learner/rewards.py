"""Turn rewards of a trajectory, their [B, L] placement, and WMAct max-turn annealing.

Public API::

    effective_action_ratio(traj) -> float                   # WMAct N_eff / N
    turn_rewards(traj, *, wmact_rescale) -> list[float]     # r_t per turn
    place_turn_rewards(turn_end_mask, rewards) -> [B, L] float32 tensor
    anneal_max_turns(current_max, observed_turns) -> int    # WMAct Eq. 5
    assemble_token_rewards(trajectories, turn_end_mask, loss_mask, logprobs, ref_logprobs, *,
                           wmact_rescale, kl_coef, kl_in_reward, kl_estimator) -> (turn, kl, token) [B, L]
    batch_reward_stats(trajectories, wmact_rescale) -> dict  # an update's reward and success stats

Turn reward (VAGEN Sec. 5.3): r_t = reasoning_reward + format_reward + env_reward
(``worldloop.common.contracts.schemas.total_turn_reward``; an unscored turn has reasoning reward 0).

WMAct reward rescaling (WMAct Eq. 4, R_scaled = R_outcome * N_eff / N): the rescaled reward is the
outcome (task) reward only, i.e. the env rewards; the format and reasoning terms are not scaled.
N_eff = sum over the trajectory's turns of ``actions_effective`` (executed actions that changed the
state) and N = sum of ``actions_total``: the ratio is one number per episode, as in the paper.
Where it lands: the positive part of every turn's ``env_reward`` (the outcome: success, box on
target) is multiplied by that episode ratio, so the rescaled outcome stays on the turns that earned
it and sums to R_outcome * N_eff / N over the trajectory (masked_gae, grpo see only that sum;
bilevel_gae and turn_ppo keep the per-turn placement). A negative env reward (the per-step
penalty) is not an outcome and is left as it is: scaling it down by N_eff/N would make an episode
full of ineffective actions cheaper, the opposite of what Eq. 4 is for. An episode with N = 0 (no
action parsed in any turn) has no ineffective action to penalise: its ratio is 1.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Sequence

import msgspec
import torch

from worldloop.common.contracts.schemas import Trajectory, total_turn_reward
from worldloop.learner.losses import kl_penalty


def effective_action_ratio(traj: Trajectory) -> float:
    """WMAct N_eff / N over the whole episode (1.0 when it has no action at all)."""
    turns = traj.turns
    if not turns:
        raise ValueError("traj.turns: expected a non-empty list of turns")
    n_eff = sum(t.actions_effective for t in turns)
    n = sum(t.actions_total for t in turns)
    if n < 0 or n_eff < 0 or n_eff > n:
        raise ValueError(f"traj: actions_effective sum {n_eff} must lie in [0, actions_total sum {n}]")
    return 1.0 if n == 0 else n_eff / n


def turn_rewards(traj: Trajectory, *, wmact_rescale: bool) -> list[float]:
    """Per-turn reward r_t of a trajectory message; with ``wmact_rescale`` positive env rewards * N_eff/N."""
    ratio = effective_action_ratio(traj) if wmact_rescale else 1.0
    out = []
    for t in traj.turns:
        env = float(t.env_reward)
        turn = msgspec.structs.replace(t, env_reward=env * ratio) if wmact_rescale and env > 0 else t
        out.append(total_turn_reward(turn))
    return out


def place_turn_rewards(turn_end_mask: torch.Tensor, rewards: Sequence[Sequence[float]]) -> torch.Tensor:
    """The [B, L] ``turn_rewards`` tensor: row b's k-th turn end gets ``rewards[b][k]``, 0 elsewhere.

    Raises ValueError when a row's number of rewards differs from its number of turn ends.
    """
    if not isinstance(turn_end_mask, torch.Tensor) or turn_end_mask.dim() != 2:
        raise ValueError("turn_end_mask: expected a [B, L] tensor")
    end = turn_end_mask != 0
    if len(rewards) != end.shape[0]:
        raise ValueError(f"rewards: {len(rewards)} rows for a batch of {end.shape[0]}")
    counts = end.sum(1).tolist()
    for b, (row, n) in enumerate(zip(rewards, counts)):
        if len(row) != n:
            raise ValueError(f"rewards[{b}]: {len(row)} turn rewards for {n} turn ends")
    flat = torch.tensor([float(r) for row in rewards for r in row], dtype=torch.float32, device=end.device)
    out = torch.zeros(end.shape, dtype=torch.float32, device=end.device)
    out[end] = flat  # boolean indexing walks row-major, i.e. row by row, turn by turn
    return out


def anneal_max_turns(current_max: int, observed_turns: Sequence[int]) -> int:
    """WMAct Eq. 5 interaction-frequency annealing: L_max = (L_bar + L'_max) / 2.

    ``observed_turns`` are the turn counts of the episodes of the last tau training iterations
    (the caller keeps that window and calls this every tau iterations). L_bar is their mean
    (turns per episode; with equal group sizes that is the paper's per-prompt average) and
    L'_max their maximum. The result is rounded UP (ceil: the limit never drops below the
    average episode's need, and a batch that all uses k turns keeps k), then clamped to
    [1, current_max]: annealing only ever lowers the limit, also when stale episodes were
    played under an older, larger limit. No episode observed -> ``current_max`` unchanged.
    """
    if isinstance(current_max, bool) or not isinstance(current_max, int) or current_max < 1:
        raise ValueError(f"current_max: must be an int >= 1, got {current_max!r}")
    turns = [int(t) for t in observed_turns]
    if any(t < 1 for t in turns):
        raise ValueError(f"observed_turns: every episode has >= 1 turn, got {min(turns)}")
    if not turns:
        return current_max
    mean, largest = sum(turns) / len(turns), max(turns)
    target = math.ceil((mean + largest) / 2)  # exact when it is an integer: the turn counts are ints
    return max(1, min(current_max, target))


def batch_reward_stats(trajectories: list[Trajectory], wmact_rescale: bool) -> dict:
    """Mean per-trajectory reward by component, success rate overall and per env, turn counts."""
    n = max(len(trajectories), 1)
    comp = {"total": 0.0, "env": 0.0, "format": 0.0, "reasoning": 0.0}
    success: dict[str, list[int]] = defaultdict(list)
    for traj in trajectories:
        comp["total"] += sum(turn_rewards(traj, wmact_rescale=wmact_rescale))
        for t in traj.turns:
            comp["env"] += float(t.env_reward)
            comp["format"] += float(t.format_reward)
            comp["reasoning"] += float(t.reasoning_reward or 0.0)
        success[traj.env_name].append(int(traj.success))
    rates = {"all": sum(sum(v) for v in success.values()) / n}
    rates.update({k: sum(v) / len(v) for k, v in sorted(success.items())})
    return {"reward": {k: v / n for k, v in comp.items()}, "success_rate": rates,
            "turns": [len(t.turns) for t in trajectories]}


def assemble_token_rewards(trajectories: list[Trajectory], turn_end_mask: torch.Tensor, loss_mask: torch.Tensor,
                           logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None, *, wmact_rescale: bool,
                           kl_coef: float, kl_in_reward: bool, kl_estimator: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rewards an update trains on, all [B, L] float32 (step 3 of ``worldloop.learner.trainer``'s docstring):

    * turn rewards: row b's k-th turn end holds r_k = reasoning + format + env of trajectory b's
      turn k (``turn_rewards``, WMAct-rescaled with ``wmact_rescale``), 0 elsewhere;
    * per-token KL(prox || ref) by ``kl_estimator`` on the ``loss_mask`` tokens, 0 elsewhere (and
      everywhere without a reference model, ``ref_logprobs`` None);
    * token rewards: ``-kl_coef * KL`` with ``kl_in_reward`` and a reference, else 0.
    """
    turn = place_turn_rewards(turn_end_mask, [turn_rewards(x, wmact_rescale=wmact_rescale) for x in trajectories])
    if ref_logprobs is None:
        kl_tok = torch.zeros_like(loss_mask)
    else:
        kl_tok = torch.where(loss_mask > 0, kl_penalty(logprobs, ref_logprobs, kind=kl_estimator), 0.0)
    token = -kl_coef * kl_tok if (kl_in_reward and ref_logprobs is not None) else torch.zeros_like(loss_mask)
    return turn, kl_tok, token
