"""Sokoban: Table 16 rewards on hand-made boards, turn rules, relations, solver, generation."""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest

from worldloop import envs  # noqa: F401  (registers the ids)
from worldloop.envs.grid.sokoban import SokobanEnv, parse_symbolic, room_topology
from worldloop.envs.grid.solvers import SokobanSolver

ID = "worldloop/Sokoban-v0"


def ans(actions: str) -> str:
    return f"<think><observation>o</observation><reasoning>r</reasoning><prediction>p</prediction></think><answer>{actions}</answer>"


def make(board: str, **kw):
    env = gymnasium.make(ID, render_mode="text", **kw)
    env.reset(seed=0)
    env.unwrapped.load_board(board)
    return env


def test_push_onto_target_solves_with_table16_rewards() -> None:
    env = make("######\n#P_XO#\n#____#\n######")
    _, reward, term, trunc, info = env.step(ans("Right, Right"))
    # Right: walk, -0.1; Right: push the box onto the target, +1 box, +10 success (no step penalty)
    # env = -0.1 + 1 + 10 = 10.9; format +0.5 -> 11.4
    assert info["env_reward"] == pytest.approx(10.9) and info["format_reward"] == 0.5
    assert reward == pytest.approx(11.4) and term and not trunc and info["success"]
    assert info["actions"] == ["Right", "Right"] and info["actions_executed"] == 2 and info["actions_effective"] == 2
    assert info["state"]["symbolic"] == "######\n#__P*#\n#____#\n######"


def test_push_off_target_and_blocked_moves() -> None:
    env = make("#######\n#P*_XO#\n#_____#\n#######")
    _, reward, term, _, info = env.step(ans("Right,Right,Up"))
    # Right pushes the box off its target: -1 - 0.1; Right is blocked by two boxes in a row: -0.1, not
    # effective; Up hits the wall: -0.1, not effective -> env = -1.1 - 0.1 - 0.1 = -1.3; +0.5 format
    assert info["env_reward"] == pytest.approx(-1.3) and reward == pytest.approx(-0.8)
    assert info["actions_executed"] == 3 and info["actions_effective"] == 1 and not term
    assert info["state"]["structured"]["box_positions"] == [[1, 3], [1, 4]]
    assert info["metrics"]["boxes_on_target"] == 0.0


def test_bad_turns_change_nothing() -> None:
    env = make("######\n#P_XO#\n#____#\n######")
    before = env.unwrapped.expert_response()
    for response in ("Right", "<answer>Right</answer>", ans("Right, Jump"), ans(""), "x" * (1 << 20)):
        _, reward, term, trunc, info = env.step(response)
        assert reward == 0.0 and info["env_reward"] == 0.0 and info["format_reward"] == 0.0
        assert not info["format_ok"] and info["actions_executed"] == 0 and not term and not trunc
        assert info["state"]["structured"]["player_position"] == [1, 1] and info["steps"] == 0
    assert info["reason"].startswith("response has")
    _, _, _, _, info = env.step(ans("Right, Jump"))
    assert info["unknown_actions"] == ["Jump"] and info["actions"] == [] and info["reason"] == "unknown action 'Jump'"
    assert env.unwrapped.expert_response() == before


def test_extra_actions_and_step_limit() -> None:
    env = make("#########\n#P______#\n#_____XO#\n#########", max_actions_per_step=3, max_steps=5)
    _, _, _, trunc, info = env.step(ans("right,RIGHT, Right ,Right,Right"))
    assert info["actions"] == ["Right"] * 3 and info["actions_executed"] == 3 and not trunc
    _, reward, term, trunc, info = env.step(ans("Right,Right,Right"))
    # only 2 of the 3 run: max_steps=5 executed actions; -0.1 each, +0.5 format
    assert info["actions_executed"] == 2 and trunc and not term and reward == pytest.approx(0.3)
    _, reward, _, _, info = env.step(ans("Left"))
    assert reward == 0.0 and info["actions_executed"] == 0 and info["reason"] == "episode already ended"


def test_relations_of_a_hand_made_board() -> None:
    env = make("######\n#_O__#\n#_X__#\n#__P_#\n######")
    state = env.unwrapped._current_state()
    assert state["relations"] == [
        "box0 is above and on the left side of the player",
        "target0 is above and on the left side of the player",
        "target0 is above and at the same column as box0",
    ]
    assert state["structured"] == {"player_position": [3, 3], "box_positions": [[2, 2]],
                                   "target_positions": [[1, 2]], "grid_size": [5, 6]}
    env = make("#######\n#O_P_X#\n#_X__O#\n#######")
    rel = env.unwrapped._current_state()["relations"]
    assert rel == [
        "box0 is at the same row and to the right of the player",
        "box1 is below and on the left side of the player",
        "target0 is at the same row and to the left of the player",
        "target1 is below and on the right side of the player",
        "target0 is at the same row and to the left of box0",
        "target0 is above and on the left side of box1",
        "target1 is below and at the same column as box0",
        "target1 is at the same row and to the right of box1",
    ]


def test_boxes_keep_their_names_when_pushed() -> None:
    env = make("#######\n#_____#\n#PX_XO#\n#____O#\n#######")
    env.step(ans("Right"))
    s = env.unwrapped._current_state()["structured"]
    assert s["box_positions"] == [[2, 3], [2, 4]]  # box0 moved right, box1 stayed
    env.step(ans("Right"))  # blocked: box0 against box1
    assert env.unwrapped._current_state()["structured"]["box_positions"] == [[2, 3], [2, 4]]


def test_solver_minimum_on_hand_boards() -> None:
    walls, targets, boxes, player = parse_symbolic("######\n#P_XO#\n#____#\n######")
    assert SokobanSolver(walls, targets).solve(player, boxes).actions == ["Right", "Right"]
    # the box must be pushed up then the player walks around: Up is impossible from below the wall
    walls, targets, boxes, player = parse_symbolic("#######\n#__O__#\n#__X__#\n#__P__#\n#######")
    plan = SokobanSolver(walls, targets).solve(player, boxes)
    assert plan.actions == ["Up"] and plan.states[-1][1] == (1 * 7 + 3,)
    # a box in a corner that is not a target can never be solved (dead cell pruning keeps it None)
    walls, targets, boxes, player = parse_symbolic("######\n#X__O#\n#_P__#\n######")
    assert SokobanSolver(walls, targets).solve(player, boxes) is None


def test_reverse_play_depths_are_exact_minimums() -> None:
    rng = np.random.default_rng(0)
    for _ in range(6):
        walls = room_topology(rng, 7, 7, 24)
        floor = [tuple(int(v) for v in p) for p in np.argwhere(~walls)]
        solver = SokobanSolver(walls, sorted(floor[:2]))
        search = solver.reverse_search()
        for k in range(search.max_depth + 1):
            for p, boxes in search.states_at(k)[:2]:
                forward = solver.solve(divmod(p, 7), [divmod(b, 7) for b in boxes])
                assert len(forward.actions) == len(search.plan((p, boxes)).actions) == k
    env = gymnasium.make(ID, render_mode="text", min_actions_to_succeed=7)
    for seed in range(5):
        env.reset(seed=seed)
        assert env.unwrapped.optimal_actions >= 7


def test_max_actions_to_succeed_caps_the_start_distance() -> None:
    """Levels of 2..4 optimal actions with the cap, every distance in that range drawn; without it
    some level of 40 needs more than 4."""
    capped = gymnasium.make(ID, render_mode="text", min_actions_to_succeed=2, max_actions_to_succeed=4)
    free = gymnasium.make(ID, render_mode="text", min_actions_to_succeed=2)
    seen, longest_free = set(), 0
    for seed in range(40):
        capped.reset(seed=seed)
        seen.add(capped.unwrapped.optimal_actions)
        free.reset(seed=seed)
        longest_free = max(longest_free, free.unwrapped.optimal_actions)
    assert seen == {2, 3, 4}
    assert longest_free > 4
    with pytest.raises(ValueError, match="max_actions_to_succeed"):
        SokobanEnv(min_actions_to_succeed=5, max_actions_to_succeed=4)


@pytest.mark.parametrize("kw", [{}, {"dim_room": [7, 7], "num_boxes": 2, "min_actions_to_succeed": 8}])
def test_expert_replay_reaches_success_with_plus_ten(kw) -> None:
    env = gymnasium.make(ID, render_mode="text", **kw)
    for seed in range(4):
        env.reset(seed=seed)
        optimal = env.unwrapped.optimal_actions
        executed, rewards = 0, []
        while True:
            _, reward, term, trunc, info = env.step(env.unwrapped.expert_response())
            executed += info["actions_executed"]
            rewards.append(info["env_reward"])
            if term or trunc:
                break
        assert term and info["success"] and executed == optimal
        assert rewards[-1] >= 10.0  # the finishing action carries the +10 success reward


def test_bad_kwargs_name_the_kwarg() -> None:
    for kw, name in (({"dim_room": [3, 6]}, "dim_room"), ({"dim_room": "6x6"}, "dim_room"), ({"num_boxes": 0}, "num_boxes"),
                     ({"num_boxes": 8, "dim_room": [5, 5]}, "num_boxes"), ({"min_actions_to_succeed": -1}, "min_actions"),
                     ({"max_steps": 0}, "max_steps")):
        with pytest.raises(ValueError, match=name):
            SokobanEnv(**kw)
    env = SokobanEnv(dim_room=[5, 5], min_actions_to_succeed=60)
    with pytest.raises(RuntimeError, match="min_actions_to_succeed"):
        env.reset(seed=0)


def test_crop_outer_wall_draws_the_inside_of_the_room() -> None:
    """crop_outer_wall: a 6x6 room at 28 px a cell is the 4x4 inside of the full drawing, 112 px; the
    text state is the whole room's; a board whose outer ring has a gap refuses to be cropped."""
    kw = dict(dim_room=[6, 6], min_actions_to_succeed=2, render_mode="vision", prompt_format="grounding_worldmodeling")
    full = gymnasium.make(ID, image_size=168, **kw)
    crop = gymnasium.make(ID, image_size=112, crop_outer_wall=True, **kw)
    for seed in range(3):
        obs_f, info_f = full.reset(seed=seed)
        obs_c, info_c = crop.reset(seed=seed)
        img_f, img_c = np.asarray(obs_f["image"]), np.asarray(obs_c["image"])
        assert img_f.shape == (168, 168, 3) and img_c.shape == (112, 112, 3)
        assert np.array_equal(img_c, img_f[28:140, 28:140])
        assert info_c["state"] == info_f["state"] and info_c["state"]["symbolic"].count("\n") == 5
    assert gymnasium.make(ID, crop_outer_wall=True, **kw).unwrapped.image_size == 4 * SokobanEnv.CELL_PX
    open_ring = gymnasium.make(ID, image_size=112, crop_outer_wall=True, **kw)
    open_ring.reset(seed=0)
    with pytest.raises(ValueError, match="outer ring"):
        open_ring.unwrapped.load_board("######\n#P_XO_\n#____#\n######")
        open_ring.unwrapped._render_image()


def test_progress_reward_is_the_solver_distance_difference() -> None:
    # player (1,1), box (1,3), target (1,4): the shortest plan is Right, Right (d = 2)
    env = make("######\n#P_XO#\n#____#\n######", progress_reward=0.5)
    _, reward, _, _, info = env.step(ans("Right"))
    # d 2 -> 1: +0.5 * 1; env = -0.1 + 0.5 = 0.4; +0.5 format
    assert info["progress_reward"] == pytest.approx(0.5) and info["env_reward"] == pytest.approx(0.4)
    assert reward == pytest.approx(0.9)
    _, reward, term, _, info = env.step(ans("Right"))
    # d 1 -> 0: +0.5; env = 10 (success) + 1 (box on target) + 0.5 = 11.5
    assert term and info["env_reward"] == pytest.approx(11.5) and reward == pytest.approx(12.0)
    _, reward, _, _, info = env.step(ans("Right"))
    assert reward == 0.0 and info["progress_reward"] == 0.0  # the episode has ended


def test_progress_reward_charges_detours_and_dead_ends() -> None:
    # player (1,1), box (2,2), target (2,4): Down, Right, Right (d = 3)
    env = make("######\n#P___#\n#_X_O#\n#____#\n######", progress_reward=0.5, max_steps=10)
    assert env.unwrapped._distance_to_goal() == 3
    _, _, _, _, info = env.step(ans("Right"))
    # from (1,2) the plan is Left, Down, Right, Right: d 3 -> 4, -0.5; env = -0.1 - 0.5
    assert info["progress_reward"] == pytest.approx(-0.5) and info["env_reward"] == pytest.approx(-0.6)
    _, _, term, _, info = env.step(ans("Down"))
    # the box goes to the bottom row, off the target's row for good: d -> max_steps = 10, -0.5 * 6
    assert not term and info["progress_reward"] == pytest.approx(-3.0) and info["env_reward"] == pytest.approx(-3.1)
    _, _, _, _, info = env.step(ans("Jump"))  # a rejected turn runs nothing and earns no shaping
    assert info["progress_reward"] == 0.0 and info["env_reward"] == 0.0


def test_progress_reward_off_by_default_and_checked() -> None:
    env = make("######\n#P_XO#\n#____#\n######")
    _, reward, _, _, info = env.step(ans("Right"))
    assert info["progress_reward"] == 0.0 and info["env_reward"] == pytest.approx(-0.1)
    for bad in (-0.1, float("nan"), "1", True):
        with pytest.raises(ValueError, match="progress_reward"):
            gymnasium.make(ID, progress_reward=bad)
