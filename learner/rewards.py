"""Turn rewards of a trajectory, their [B, L] placement, and WMAct max-turn annealing.

Public API::

    effective_action_ratio(traj) -> float                   # WMAct N_eff / N
    turn_rewards(traj, *, wmact_rescale) -> list[float]     # r_t per turn
    place_turn_rewards(turn_end_mask, rewards) -> [B, L] float32 tensor
    anneal_max_turns(current_max, observed_turns) -> int    # WMAct Eq. 5

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
from typing import Sequence

import msgspec
import torch

from worldloop.common.contracts.schemas import Trajectory, total_turn_reward


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
