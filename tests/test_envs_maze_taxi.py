"""Maze (Prim's algorithm, corner start, farthest goal) and Taxi (gymnasium dynamics) rewards/relations."""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest

from worldloop import envs  # noqa: F401
from worldloop.envs.grid.maze import MazeEnv, farthest_cell, prim_maze
from worldloop.envs.grid.solvers import bfs

BOARD = """
P o o o o
* * * * o
o o o o o
o * * * *
o o o o X
"""


def ans(actions: str) -> str:
    return f"<answer>{actions}</answer>"


def test_maze_rewards_and_relations_on_a_hand_board() -> None:
    env = gymnasium.make("worldloop/Maze-v0", size=5, render_mode="text", prompt_format="no_think")
    env.reset(seed=0)
    env.unwrapped.load_board(BOARD)
    state = env.unwrapped._current_state()
    assert state["relations"] == ["goal is below and on the right side of the player"]
    assert state["symbolic"] == BOARD.strip()
    assert state["structured"] == {"player_position": [0, 0], "goal_position": [4, 4], "grid_size": [5, 5]}
    _, reward, _, _, info = env.step(ans("Down, Right, move right"))
    # Down hits a wall (not effective), two moves right: env = 3 * -0.1 = -0.3; +0.5 format -> 0.2
    assert info["actions_effective"] == 2 and reward == pytest.approx(0.2)
    assert info["state"]["relations"] == ["goal is below and on the right side of the player"]
    plan = "Right,Right,Down,Down,Left,Left,Left,Left,Down,Down,Right,Right,Right,Right"
    assert env.unwrapped.expert_response() == ans(",".join(plan.split(",")[:10]))
    _, _, _, _, info = env.step(ans(",".join(plan.split(",")[:10])))
    _, reward, term, _, info = env.step(ans("Right,Right,Right,Right"))
    # three -0.1 steps and the goal: env = 10 - 0.3 = 9.7, +0.5 -> 10.2
    assert term and info["success"] and reward == pytest.approx(10.2)
    assert info["state"]["relations"] == ["goal is at the same place as the player"]


@pytest.mark.parametrize("n", [5, 11, 15])
def test_prim_maze_is_perfect(n: int) -> None:
    rng = np.random.default_rng(n)
    walls = prim_maze(rng, n)
    m = (n + 1) // 2
    # a spanning tree over the m*m cells: m*m cells + (m*m - 1) opened walls between them
    assert int((~walls).sum()) == m * m + m * m - 1
    assert not walls[::2, ::2].any() and walls[1::2, 1::2].all()
    start = (0, 0)

    def succ(p):
        for dr, dc, a in ((1, 0, "D"), (-1, 0, "U"), (0, 1, "R"), (0, -1, "L")):
            r, c = p[0] + dr, p[1] + dc
            if 0 <= r < n and 0 <= c < n and not walls[r, c]:
                yield a, (r, c)

    far = farthest_cell(rng, walls, start)
    far_len = len(bfs(start, succ, lambda p: p == far).actions)
    for cell in map(tuple, np.argwhere(~walls)):
        plan = bfs(start, succ, lambda p, cell=cell: p == cell)
        assert plan is not None and len(plan.actions) <= far_len  # connected; the goal is the farthest


def test_maze_episode_starts_in_a_corner_and_is_seeded() -> None:
    env = gymnasium.make("worldloop/Maze-v0", size=15, render_mode="vision")
    corners = {(0, 0), (0, 14), (14, 0), (14, 14)}
    for seed in range(4):
        obs, info = env.reset(seed=seed)
        assert tuple(info["state"]["structured"]["player_position"]) in corners
        assert obs["image"].shape == (240, 240, 3)
    with pytest.raises(ValueError, match="size must be odd"):
        MazeEnv(size=10)


TAXI = "worldloop/Taxi-v0"


def test_taxi_pickup_dropoff_rewards() -> None:
    env = gymnasium.make(TAXI, render_mode="text", prompt_format="no_think")
    env.reset(seed=0)
    env.unwrapped.load_state(1, 0, 0, 3)  # taxi at (1,0), passenger waiting at R (0,0), destination B (4,3)
    rel = env.unwrapped._current_state()["relations"]
    assert rel == ["passenger is above and at the same column as the taxi",
                   "destination is below and on the right side of the taxi",
                   "destination is below and on the right side of the passenger"]
    _, reward, _, _, info = env.step(ans("Pickup, Up, pick up"))
    # illegal pickup: -0.1 - 1 (not effective); Up: -0.1; pickup: -0.1 -> env = -1.3, +0.5 -> -0.8
    assert info["env_reward"] == pytest.approx(-1.3) and reward == pytest.approx(-0.8)
    assert info["actions_effective"] == 2 and info["metrics"]["passenger_in_taxi"] == 1.0
    assert info["state"]["relations"][0] == "passenger is in the taxi"
    assert "T(P)" in info["state"]["symbolic"]
    steps = 0
    while True:
        _, reward, term, trunc, info = env.step(env.unwrapped.expert_response())
        steps += info["actions_executed"]
        if term or trunc:
            break
    assert term and info["success"] and info["env_reward"] >= 10 - 0.1 * steps
    assert "T/P/D" in info["state"]["symbolic"]


def test_taxi_map_shows_walls_and_depots() -> None:
    env = gymnasium.make(TAXI, render_mode="text")
    env.reset(seed=0)
    env.unwrapped.load_state(2, 2, 1, 2)  # passenger at G, destination Y
    lines = env.unwrapped._current_state()["symbolic"].splitlines()
    assert lines[0] == lines[-1] == "+" + "-" * 39 + "+"
    assert lines[1] == "|   R   :       |       :       :   P   |"
    assert lines[3] == "|       :       :   T   :       :       |"
    assert lines[5] == "|   D   |       :       |   B   :       |"


def _taxi_distance(a: tuple[int, int], b: tuple[int, int]) -> int:
    """Moves between two cells of gymnasium's Taxi map, by BFS over the map text itself ("|" between two
    cells of a row is a wall; rows are open), independent of the env's solver."""
    from gymnasium.envs.toy_text.taxi import MAP

    dist, todo = {a: 0}, [a]
    for r, c in todo:
        for dr, dc in ((1, 0), (-1, 0), (0, 1), (0, -1)):
            nr, nc = r + dr, c + dc
            if not (0 <= nr < 5 and 0 <= nc < 5) or (nr, nc) in dist:
                continue
            if dc and MAP[r + 1][2 * min(c, nc) + 2] == "|":
                continue
            dist[(nr, nc)] = dist[(r, c)] + 1
            todo.append((nr, nc))
    return dist[b]


def test_taxi_expert_is_optimal_from_reset() -> None:
    env = gymnasium.make(TAXI, render_mode="text", max_actions_per_step=20)
    # by hand on gymnasium's map: taxi (2, 2) to the passenger at G (0, 4): right 2, up 2 = 4 moves, pickup;
    # G to the destination Y (4, 0): down 2, left 4 along the open row 2, down 2 = 8 moves (the Manhattan
    # distance, so no path is shorter), dropoff: 4 + 1 + 8 + 1 = 14
    assert _taxi_distance((2, 2), (0, 4)) == 4 and _taxi_distance((0, 4), (4, 0)) == 8
    env.reset(seed=0)
    env.unwrapped.load_state(2, 2, 1, 2)
    _, _, term, _, info = env.step(env.unwrapped.expert_response())
    assert term and info["success"] and info["actions_executed"] == 14
    for seed in range(3):
        _, info = env.reset(seed=seed)
        st = info["state"]["structured"]
        taxi, passenger, dest = (tuple(st[k]) for k in ("taxi_position", "passenger_position", "destination_position"))
        # to the passenger, pick up, to the destination, drop off
        optimal = _taxi_distance(taxi, passenger) + 1 + _taxi_distance(passenger, dest) + 1
        _, _, term, _, info = env.step(env.unwrapped.expert_response())
        assert term and info["success"] and info["actions_executed"] == optimal == env.unwrapped.optimal_actions, seed
