"""worldloop.learner.rewards: turn rewards, WMAct Eq. 4 rescaling and Eq. 5 annealing, by hand."""

from __future__ import annotations

import pytest
import torch

from worldloop.common.schemas import Trajectory, decode_trajectory, encode_trajectory
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
