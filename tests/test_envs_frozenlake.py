"""FrozenLake: Table 17 rewards on a fixed map, holes, relations, slippery dynamics, generation."""

from __future__ import annotations

import gymnasium
import pytest

from worldloop import envs  # noqa: F401
from worldloop.envs.grid.frozenlake import FrozenLakeEnv, shortest_path

ID = "worldloop/FrozenLake-v0"
DESC = ["SFFF", "FHFH", "FFFH", "HFFG"]


def ans(actions: str) -> str:
    return f"<think>t</think><answer>{actions}</answer>"


def make(**kw):
    env = gymnasium.make(ID, desc=DESC, render_mode="text", prompt_format="free_think", **kw)
    _, info = env.reset(seed=0)
    return env, info


def test_relations_symbolic_structured_of_the_fixed_map() -> None:
    _, info = make()
    state = info["state"]
    assert state["relations"] == [
        "goal is below and on the right side of the player",
        "hole0 is below and on the right side of the player",
        "hole1 is below and on the right side of the player",
        "hole2 is below and on the right side of the player",
        "hole3 is below and at the same column as the player",
    ]
    assert state["symbolic"] == "P___\n_O_O\n___O\nO__G"
    assert state["structured"] == {"player_position": [0, 0], "target_position": [3, 3],
                                   "hole_positions": [[1, 1], [1, 3], [2, 3], [3, 0]], "grid_size": [4, 4]}


def test_the_state_carries_the_outlook_a_turn_is_judged_against() -> None:
    """info["state"]["outlook"] is the outlook of that state, before and after a step, and reaches the
    trajectory's State (the judge's outlook_score compares a turn's reasoning with it)."""
    from worldloop.common.contracts.schemas import State, decode_trajectory, encode_trajectory, state_from_info
    from worldloop.testing.trajectories import make_trajectory

    env, info = make(outlook="around")
    assert info["state"]["outlook"] == ("Left edge, Down ice, Right ice, Up edge; Down-left edge, Down-right hole, "
                                        "Up-left edge, Up-right edge.")
    _, _, _, _, after = env.step(ans("Right,Right"))
    assert after["state"]["outlook"] == env.unwrapped.move_outlook() != info["state"]["outlook"]
    traj = make_trajectory("s1", turns=1)
    traj.turns[0].state_before = state_from_info(after)
    back = decode_trajectory(encode_trajectory(traj)).turns[0].state_before
    assert back.outlook == after["state"]["outlook"]
    assert State(relations=[], symbolic=None, structured={}).outlook is None  # envs without an outlook


def test_move_outlook_names_each_moves_cell_on_the_fixed_map() -> None:
    """DESC = SFFF / FHFH / FFFH / HFFG, the cells each move leads into, by hand along a safe path:
    (0, 0) -> Right, Right -> (0, 2) -> Down -> (1, 2) -> Down -> (2, 2) -> Down -> (3, 2)."""
    env, _ = make()
    u = env.unwrapped
    seen = [u.move_outlook()]
    for moves in ("Right,Right", "Down", "Down", "Down"):
        env.step(ans(moves))
        seen.append(u.move_outlook())
    assert u.player == (3, 2)
    assert seen == [
        "Left edge, Down ice, Right ice, Up edge.",   # (0, 0): (1, 0) F, (0, 1) F
        "Left ice, Down ice, Right ice, Up edge.",    # (0, 2): (0, 1) F, (1, 2) F, (0, 3) F
        "Left hole, Down ice, Right hole, Up ice.",   # (1, 2): (1, 1) H, (2, 2) F, (1, 3) H, (0, 2) F
        "Left ice, Down ice, Right hole, Up ice.",    # (2, 2): (2, 1) F, (3, 2) F, (2, 3) H, (1, 2) F
        "Left ice, Down edge, Right goal, Up ice.",   # (3, 2): (3, 1) F, (3, 3) G, (2, 2) F
    ]


def test_the_outlook_around_adds_the_four_diagonal_cells() -> None:
    """outlook="around" on DESC along the same path: Down-left, Down-right, Up-left, Up-right after the moves."""
    env, _ = make(outlook="around")
    u = env.unwrapped
    seen = [u.move_outlook().split("; ")[1]]
    for moves in ("Right,Right", "Down", "Down", "Down"):
        env.step(ans(moves))
        seen.append(u.move_outlook().split("; ")[1])
    assert seen == [
        "Down-left edge, Down-right hole, Up-left edge, Up-right edge.",  # (0, 0): (1, 1) H
        "Down-left hole, Down-right hole, Up-left edge, Up-right edge.",  # (0, 2): (1, 1) H, (1, 3) H
        "Down-left ice, Down-right hole, Up-left ice, Up-right ice.",     # (1, 2): (2, 1), (2, 3) H, (0, 1), (0, 3)
        "Down-left ice, Down-right goal, Up-left hole, Up-right hole.",   # (2, 2): (3, 1), (3, 3) G, (1, 1), (1, 3)
        "Down-left edge, Down-right edge, Up-left ice, Up-right hole.",   # (3, 2): (2, 1), (2, 3) H
    ]
    assert u.move_outlook().startswith("Left ice, Down edge, Right goal, Up ice; ")
    with pytest.raises(ValueError, match="outlook must be one of"):
        FrozenLakeEnv(outlook="all")


def test_the_outlook_toward_names_the_moves_that_close_in_on_the_goal_again() -> None:
    """outlook="toward" on DESC (goal at (3, 3)) along the same path: after the eight cells, the moves
    that shorten the Manhattan distance to the goal, in the order Left, Down, Right, Up, with their cells
    (checked against each step's row and column difference by hand)."""
    env, _ = make(outlook="toward")
    u = env.unwrapped
    seen = [u.move_outlook()]
    for moves in ("Right,Right", "Down", "Down", "Down"):
        env.step(ans(moves))
        seen.append(u.move_outlook())
    assert [s.split("; ")[2] for s in seen] == [
        "Toward the goal: Down ice, Right ice.",    # (0, 0): goal below and right; (1, 0) F, (0, 1) F
        "Toward the goal: Down ice, Right ice.",    # (0, 2): (1, 2) F, (0, 3) F
        "Toward the goal: Down ice, Right hole.",   # (1, 2): (2, 2) F, (1, 3) H
        "Toward the goal: Down ice, Right hole.",   # (2, 2): (3, 2) F, (2, 3) H
        "Toward the goal: Right goal.",             # (3, 2): same row, goal on the right
    ]
    assert seen[0].startswith("Left edge, Down ice, Right ice, Up edge; Down-left edge, Down-right hole, ")
    # the judge's parser reads the eight cells by their first mention: the repeated moves change nothing
    from worldloop.judge.rule.outlook import outlook_cells, outlook_score
    assert len(outlook_cells(seen[2])) == 8 and outlook_cells(seen[2])["right"] == "hole"
    assert outlook_score(seen[2], seen[2]) == 1.0
    env.step(ans("Right"))  # on the goal: no move closes in, so no third part
    assert "Toward" not in u.move_outlook()


def test_reaching_the_goal() -> None:
    env, _ = make(max_actions_per_step=6)
    # optimal path S(0,0) -> (0,2) -> (2,2) -> (3,3): Right,Right,Down,Down,Down,Right = 6 actions
    assert env.unwrapped.optimal_actions == 6
    _, reward, term, _, info = env.step(ans("Right,Right,Down,Down,Down,Right"))
    # five -0.1 steps, the sixth reaches the goal: +10 -> env = 10 - 0.5 = 9.5; +0.5 format = 10.0
    assert info["env_reward"] == pytest.approx(9.5) and reward == pytest.approx(10.0)
    assert term and info["success"] and info["state"]["symbolic"].endswith("O__*")


def test_falling_into_a_hole_ends_the_episode() -> None:
    env, _ = make()
    _, reward, term, trunc, info = env.step(ans("Down, Right, Right"))
    # Down -0.1, Right into hole0 at (1,1) -0.1 and the episode ends; the third action never runs
    assert info["actions_executed"] == 2 and info["env_reward"] == pytest.approx(-0.2)
    assert reward == pytest.approx(0.3) and term and not trunc and not info["success"]
    assert "hole0 is at the same place as the player" in info["state"]["relations"]
    assert info["state"]["symbolic"].splitlines()[1] == "_X_O"


def test_border_moves_are_not_effective() -> None:
    env, _ = make()
    _, reward, _, _, info = env.step(ans("Up,Left"))
    assert info["actions_effective"] == 0 and info["env_reward"] == pytest.approx(-0.2)


def test_slippery_follows_gymnasium_and_is_seeded() -> None:
    def run(seed: int) -> list[list[int]]:
        env = gymnasium.make(ID, desc=["SFFFFFFF"] + ["FFFFFFFF"] * 6 + ["FFFFFFFG"], is_slippery=True, render_mode="text",
                             prompt_format="no_think", max_actions_per_step=1)
        env.reset(seed=seed)
        out = []
        for _ in range(12):
            _, _, term, trunc, info = env.step("<answer>Right</answer>")
            out.append(info["state"]["structured"]["player_position"])
            if term or trunc:
                break
        return out

    a, b = run(3), run(3)
    assert a == b  # same seed, same slips
    # with gymnasium's slippery ice some intended "Right" moves go down/up instead
    assert any(pos[0] != 0 for pos in a + run(4) + run(5))


def test_generated_maps_have_a_long_enough_path() -> None:
    env = gymnasium.make(ID, render_mode="text", size=5, min_actions_to_succeed=6)
    for seed in range(10):
        _, info = env.reset(seed=seed)
        desc = env.unwrapped.desc
        start = divmod("".join(desc).index("S"), 5)
        assert len(shortest_path(desc, start).actions) == env.unwrapped.optimal_actions >= 6


def test_bad_kwargs() -> None:
    for kw, name in (({"desc": ["SFF", "FG"]}, "desc"), ({"desc": ["FFF", "FFG"]}, "desc"), ({"desc": "SFFG"}, "desc"),
                     ({"size": 1}, "size"), ({"p": 0.0}, "p must"), ({"is_slippery": "yes"}, "is_slippery")):
        with pytest.raises(ValueError, match=name):
            FrozenLakeEnv(**kw)


def test_the_distinct_moves_demonstrator_looks_again_after_each_direction() -> None:
    """expert_response(distinct_moves=True): the plan's moves up to the first repeated one; the
    observation is the true state and the prediction the true state after exactly those moves."""
    from worldloop.envs.parsing import parse_response

    env = gymnasium.make(ID, desc=DESC, render_mode="text", prompt_format="grounding_worldmodeling")
    env.reset(seed=0)
    e = env.unwrapped
    assert parse_response(e.expert_response(), "grounding_worldmodeling").answer == "Down,Down,Right"
    answers = []
    for _ in range(6):
        text = e.expert_response(distinct_moves=True)
        p = parse_response(text, "grounding_worldmodeling")
        answers.append(p.answer)
        expected_after = e.describe_state(e.simulate(p.answer.split(",")))
        assert p.observation == e.describe_state(e._current_state()) and p.prediction == expected_after
        _, _, term, _, info = env.step(text)
        assert e.describe_state(info["state"]) == expected_after
        if term:
            break
    # (0,0) D -> (1,0) D,R -> (2,1) D,R -> (3,2) R: the goal in four turns (the plain expert: two)
    assert answers == ["Down", "Down,Right", "Down,Right", "Right"] and info["success"]


def test_progress_reward_counts_a_hole_as_max_steps_away() -> None:
    env, _ = make(progress_reward=0.1, max_steps=20)
    assert env.unwrapped._distance_to_goal() == 6
    _, reward, term, _, info = env.step(ans("Down, Right"))
    # Down: (1,0), 5 from the goal; Right: into hole0, no plan -> max_steps = 20: 0.1 * (6 - 20) = -1.4
    # env = -0.2 - 1.4 = -1.6; +0.5 format
    assert term and info["progress_reward"] == pytest.approx(-1.4)
    assert info["env_reward"] == pytest.approx(-1.6) and reward == pytest.approx(-1.1)


def test_the_egocentric_view_keeps_the_player_in_the_middle_cell() -> None:
    """view="egocentric": a 7 x 7 window of 28 px cells on the 4 x 4 board, the player's cell in the middle,
    every board cell where the player's offset puts it and every other cell black, compared with the
    board view's own cells, pixel for pixel, along DESC's safe path."""
    kw = dict(desc=DESC, render_mode="vision", prompt_format="free_think")
    board = gymnasium.make(ID, image_size=112, **kw)
    ego = gymnasium.make(ID, image_size=196, view="egocentric", **kw)
    board.reset(seed=0)
    ego.reset(seed=0)
    assert "centred on the player" in ego.unwrapped.system_prompt()
    assert "centred on the player" not in board.unwrapped.system_prompt()
    for moves in ("", "Right,Right", "Down", "Down"):
        if moves:
            board.step(ans(moves))
            ego.step(ans(moves))
        pr, pc = ego.unwrapped.player
        assert board.unwrapped.player == (pr, pc)
        b, e = board.unwrapped._render_image(), ego.unwrapped._render_image()
        assert e.shape == (196, 196, 3)
        for r in range(7):
            for c in range(7):
                cell = e[28 * r : 28 * r + 28, 28 * c : 28 * c + 28]
                br, bc = r - 3 + pr, c - 3 + pc
                if 0 <= br < 4 and 0 <= bc < 4:
                    assert (cell == b[28 * br : 28 * br + 28, 28 * bc : 28 * bc + 28]).all(), (moves, r, c)
                else:
                    assert not cell.any(), (moves, r, c)
    with pytest.raises(ValueError, match="view must be one of"):
        FrozenLakeEnv(view="top-down")


@pytest.mark.parametrize("desc, tempting", [
    (["SFFF", "FHFF", "FFFF", "FFFG"], False),  # the goal lies down and right; neither neighbour that way is a hole
    (["SHFF", "FFFF", "FFFF", "FFFG"], True),   # right, toward the goal, is a hole
    (["SFFF", "HFFF", "FFFF", "FFFG"], True),   # down, toward the goal, is a hole
    (["GFFF", "FSHF", "FFFF", "FFFF"], False),  # the goal up-left; the hole to the right leads away from it
    (["GHFF", "FSFF", "FFFF", "FFFF"], True),   # up, toward the goal, is a hole
])
def test_a_tempting_dead_end_is_a_hole_one_move_toward_the_goal(desc: list[str], tempting: bool) -> None:
    env = FrozenLakeEnv(desc=desc)
    env.reset(seed=0)
    assert env.tempting_dead_end() is tempting
