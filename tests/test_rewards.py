"""worldloop.learner.rewards: turn rewards, WMAct Eq. 4 rescaling and Eq. 5 annealing, and the trainer's
assembly of turn and KL token rewards (learner/rewards.py assemble_token_rewards), by hand."""

from __future__ import annotations

import math

import pytest
import torch

from worldloop.common.contracts.schemas import Trajectory, decode_trajectory, encode_trajectory
from worldloop.learner.rewards import anneal_max_turns, effective_action_ratio, place_turn_rewards, turn_rewards
from worldloop.testing.trajectories import make_trajectory


def trajectory() -> Trajectory:
    """3 turns; env rewards -0.1, 0.0, 10.0; format 0.5, 0.5, 0.0; reasoning 0.4, None, 0.25."""
    traj = make_trajectory("t-r", turns=3)
    for turn, (env, fmt, reason, n_eff, n) in zip(traj.turns, [(-0.1, 0.5, 0.4, 2, 2), (0.0, 0.5, None, 0, 2), (10.0, 0.0, 0.25, 1, 2)]):
        turn.env_reward, turn.format_reward, turn.reasoning_reward = env, fmt, reason
        turn.actions_effective, turn.actions_total = n_eff, n
    return decode_trajectory(encode_trajectory(traj))  # a real, valid message


def test_turn_rewards_sum_the_three_terms() -> None:
    assert turn_rewards(trajectory(), wmact_rescale=False) == pytest.approx([-0.1 + 0.5 + 0.4, 0.0 + 0.5 + 0.0, 10.0 + 0.0 + 0.25])


def test_wmact_rescales_only_the_positive_env_reward_by_episode_ratio() -> None:
    traj = trajectory()
    # N_eff = 2 + 0 + 1 = 3, N = 2 + 2 + 2 = 6 -> ratio 0.5 for the outcome (positive env reward);
    # the -0.1 step penalty is not an outcome and stays as it is
    assert effective_action_ratio(traj) == pytest.approx(0.5)
    got = turn_rewards(traj, wmact_rescale=True)
    assert got == pytest.approx([-0.1 + 0.5 + 0.4, 0.0 * 0.5 + 0.5, 10.0 * 0.5 + 0.0 + 0.25])
    assert traj.turns[2].env_reward == 10.0  # the message itself is left as it was
    # total env part = -0.1 + 0 + 10 * 3/6
    assert sum(got) - (0.5 + 0.4 + 0.5 + 0.25) == pytest.approx(-0.1 + 10.0 * 0.5)


def test_wmact_no_actions_means_no_rescaling_and_bad_counts_raise() -> None:
    traj = trajectory()
    for t in traj.turns:
        t.actions_effective = t.actions_total = 0
    assert turn_rewards(traj, wmact_rescale=True) == turn_rewards(traj, wmact_rescale=False)
    traj.turns[0].actions_effective, traj.turns[0].actions_total = 3, 1
    with pytest.raises(ValueError, match="actions_effective"):
        turn_rewards(traj, wmact_rescale=True)


def test_place_turn_rewards() -> None:
    end = torch.tensor([[0, 0, 1, 0, 1, 0], [0, 1, 0, 0, 0, 0]])
    got = place_turn_rewards(end, [[1.0, 0.0], [-0.5]])
    assert got.dtype == torch.float32
    assert got.tolist() == [[0, 0, 1.0, 0, 0.0, 0], [0, -0.5, 0, 0, 0, 0]]
    with pytest.raises(ValueError, match=r"rewards\[1\]"):
        place_turn_rewards(end, [[1.0, 0.0], [-0.5, 2.0]])
    with pytest.raises(ValueError, match="rows"):
        place_turn_rewards(end, [[1.0, 0.0]])


@pytest.mark.parametrize(
    "current, observed, want",
    [
        (5, [1, 2, 3, 4], 4),  # (2.5 + 4) / 2 = 3.25 -> ceil 4
        (5, [1, 1, 1, 2], 2),  # (1.25 + 2) / 2 = 1.625 -> 2
        (5, [2, 2, 2, 3], 3),  # (2.25 + 3) / 2 = 2.625 -> 3
        (5, [3, 3, 3], 3),  # (3 + 3) / 2 = 3: a batch that all uses k turns keeps k
        (5, [1, 1, 1], 1),
        (5, [1, 1, 1, 1, 1, 1, 1, 1, 1, 4], 3),  # (1.3 + 4) / 2 = 2.65 -> 3
        (3, [5, 5], 3),  # stale episodes from a larger limit: never raised
        (4, [], 4),  # nothing observed: unchanged
    ],
)
def test_anneal_max_turns_eq5(current: int, observed: list[int], want: int) -> None:
    assert anneal_max_turns(current, observed) == want


def test_anneal_max_turns_bad_input() -> None:
    with pytest.raises(ValueError, match="current_max"):
        anneal_max_turns(0, [1])
    with pytest.raises(ValueError, match="observed_turns"):
        anneal_max_turns(3, [0, 1])


# --------------------------------------------------------------------------- the trainer's assembly


def _assembly_batch():
    """Two trajectories on an 8-token layout: trajectory() (3 turns, ends at 2, 4, 7) and a 1-turn one
    (env 1.0, format 0.5, no reasoning, 1 of 2 actions effective: ratio 0.5; end at 3)."""
    one = make_trajectory("t-one", turns=1)
    turn = one.turns[0]
    turn.env_reward, turn.format_reward, turn.reasoning_reward = 1.0, 0.5, None
    turn.actions_effective, turn.actions_total = 1, 2
    end = torch.tensor([[0, 0, 1, 0, 1, 0, 0, 1], [0, 0, 0, 1, 0, 0, 0, 0]])
    mask = torch.tensor([[0, 1, 1, 0, 1, 0, 1, 1], [0, 1, 1, 1, 0, 0, 0, 0]], dtype=torch.float32)
    lp = torch.tensor([[-1.0, -0.5, -2.0, -0.3, -1.0, -0.7, -0.2, -3.0], [-0.1, -0.2, -0.3, -0.4, -9.0, -9.0, -9.0, -9.0]])
    ref = torch.tensor([[-2.0, -0.7, -1.5, -0.3, -1.0, -0.1, -0.4, -2.0], [-0.1, -0.6, -0.3, -0.1, 0.0, 0.0, 0.0, 0.0]])
    return [trajectory(), decode_trajectory(encode_trajectory(one))], end, mask, lp, ref


# k1 KL = logp - ref on the loss tokens (mask), 0 elsewhere: row 0 diffs 1.0, 0.2, -0.5, 0, 0, -0.6, 0.2, -1.0
# masked by 0 1 1 0 1 0 1 1; row 1 diffs 0, 0.4, 0, -0.3 then -9 on the padding, masked by 0 1 1 1 0 0 0 0
K1 = [[0.0, 0.2, -0.5, 0.0, 0.0, 0.0, 0.2, -1.0], [0.0, 0.4, 0.0, -0.3, 0.0, 0.0, 0.0, 0.0]]


def same(got: torch.Tensor, want: list[list[float]]) -> None:
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32), rtol=0, atol=1e-6)


def test_assembly_places_turn_rewards_at_turn_ends_and_minus_kl_coef_kl_on_loss_tokens() -> None:
    from worldloop.learner.rewards import assemble_token_rewards

    trajs, end, mask, lp, ref = _assembly_batch()
    turn, kl, tok = assemble_token_rewards(trajs, end, mask, lp, ref, wmact_rescale=False, kl_coef=0.1,
                                           kl_in_reward=True, kl_estimator="kl")
    # r_t = reasoning + format + env: 0.4 + 0.5 - 0.1, 0 + 0.5 + 0, 0.25 + 0 + 10; 0 + 0.5 + 1.0
    same(turn, [[0, 0, 0.8, 0, 0.5, 0, 0, 10.25], [0, 0, 0, 1.5, 0, 0, 0, 0]])
    same(kl, K1)
    # -0.1 * K1
    same(tok, [[0, -0.02, 0.05, 0, 0, 0, -0.02, 0.1], [0, -0.04, 0, 0.03, 0, 0, 0, 0]])
    assert turn.dtype == kl.dtype == tok.dtype == torch.float32


def test_assembly_with_wmact_and_kl_as_a_loss_term_or_without_a_reference() -> None:
    from worldloop.learner.rewards import assemble_token_rewards

    trajs, end, mask, lp, ref = _assembly_batch()
    # WMAct Eq. 4: positive env rewards * N_eff/N (3/6 and 1/2): 10 -> 5, 1.0 -> 0.5; the rest as it was
    turn, kl, tok = assemble_token_rewards(trajs, end, mask, lp, ref, wmact_rescale=True, kl_coef=0.1,
                                           kl_in_reward=False, kl_estimator="kl")
    same(turn, [[0, 0, 0.8, 0, 0.5, 0, 0, 5.25], [0, 0, 0, 1.0, 0, 0, 0, 0]])
    same(kl, K1)  # still measured (the step's reported KL)
    assert tok.abs().sum() == 0  # KL is a loss term then, not a reward
    # the k3 estimator: exp(ref - logp) - (ref - logp) - 1 on the loss tokens
    _, kl3, tok3 = assemble_token_rewards(trajs, end, mask, lp, ref, wmact_rescale=False, kl_coef=0.5,
                                          kl_in_reward=True, kl_estimator="low_var_kl")
    k3 = [[0.0 if d == 0.0 else math.exp(-d) + d - 1.0 for d in row] for row in K1]
    same(kl3, k3)
    same(tok3, [[-0.5 * x for x in row] for row in k3])
    # no reference model: no KL anywhere, whatever kl_in_reward says
    _, kl0, tok0 = assemble_token_rewards(trajs, end, mask, lp, None, wmact_rescale=False, kl_coef=0.1,
                                          kl_in_reward=True, kl_estimator="kl")
    assert kl0.abs().sum() == 0 and tok0.abs().sum() == 0
