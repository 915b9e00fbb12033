"""Maze (WMAct App. A.1): ``worldloop/Maze-v0``.

Knobs: ``size`` (11, odd, >= 5: the board is size x size; WMAct uses 11 standard and 15 hard),
``min_actions_to_succeed`` (1), ``max_actions_per_step`` (10: WMAct lets a turn carry several
commands and maze solutions are 20-60 moves long), ``max_steps`` (200 executed actions),
``image_size`` (default 16 px per cell), plus the common kwargs of :class:`worldloop.envs.base.VisualEnv`.

Levels: randomized Prim's algorithm over the cells at even coordinates (a perfect maze: one path
between any two cells), the player starts in a random corner (all four are open), the goal is the
open cell farthest from the start by BFS (ties broken at random), as WMAct describes.

Actions: ``Left, Down, Right, Up`` (aliases ``move up`` ...). Moving into a wall or off the board
changes nothing (not "effective"). Rewards per executed action: +10 when the player reaches the
goal, else -0.1 (VAGEN's scheme, applied to WMAct's task); +0.5 format reward per well-formed turn.

Entities: ``the player`` and ``goal``; relation: ``"goal is below and on the left side of the
player"``. Symbolic grid (WMAct): ``P`` player, ``X`` destination, ``o`` path, ``*`` wall, separated
by spaces (the player on the goal shows as ``P``). Structured: ``player_position``,
``goal_position``, ``grid_size``; positions are [row, col].
"""

from __future__ import annotations

from typing import Any, Hashable

import numpy as np

from worldloop.envs.base import ActionResult, check_int, relation_sentence
from worldloop.envs.grid.grid_env import GridEnv, generate_level
from worldloop.envs.grid.render import cell_size, compose, grid_image_shape, tile_stack
from worldloop.envs.grid.solvers import DIRECTIONS, Plan, bfs

_TILE_NAMES = ("maze_wall", "maze_path", "maze_player", "maze_goal", "maze_player_goal")


def prim_maze(rng: np.random.Generator, n: int) -> np.ndarray:
    """Walls (True) of an n x n perfect maze (n odd) carved by randomized Prim's algorithm."""
    walls = np.ones((n, n), dtype=bool)
    m = (n + 1) // 2  # cells per side at even coordinates
    in_maze = np.zeros((m, m), dtype=bool)
    in_frontier = np.zeros((m, m), dtype=bool)
    start = (int(rng.integers(m)), int(rng.integers(m)))
    frontier: list[tuple[int, int]] = []

    def add(cell: tuple[int, int]) -> None:
        in_maze[cell] = True
        walls[2 * cell[0], 2 * cell[1]] = False
        for dr, dc in DIRECTIONS.values():
            r, c = cell[0] + dr, cell[1] + dc
            if 0 <= r < m and 0 <= c < m and not in_maze[r, c] and not in_frontier[r, c]:
                in_frontier[r, c] = True
                frontier.append((r, c))

    add(start)
    while frontier:
        i = int(rng.integers(len(frontier)))
        frontier[i], frontier[-1] = frontier[-1], frontier[i]
        cell = frontier.pop()
        links = [(cell[0] + dr, cell[1] + dc) for dr, dc in DIRECTIONS.values()]
        links = [x for x in links if 0 <= x[0] < m and 0 <= x[1] < m and in_maze[x]]
        other = links[int(rng.integers(len(links)))]
        walls[cell[0] + other[0], cell[1] + other[1]] = False  # the wall between (sum of halves)
        add(cell)
    return walls


def _succ_fn(walls: np.ndarray):
    n_r, n_c = walls.shape

    def succ(p):
        for name, (dr, dc) in DIRECTIONS.items():
            r, c = p[0] + dr, p[1] + dc
            if 0 <= r < n_r and 0 <= c < n_c and not walls[r, c]:
                yield name, (r, c)

    return succ


def farthest_cell(rng: np.random.Generator, walls: np.ndarray, start: tuple[int, int]) -> tuple[int, int]:
    """An open cell at maximal BFS distance from ``start`` (ties broken with ``rng``)."""
    succ = _succ_fn(walls)
    dist = {start: 0}
    frontier = [start]
    while frontier:
        nxt = []
        for p in frontier:
            for _, q in succ(p):
                if q not in dist:
                    dist[q] = dist[p] + 1
                    nxt.append(q)
        if not nxt:
            break
        frontier = nxt
    far = sorted(frontier)
    return far[int(rng.integers(len(far)))]


def maze_state(walls: np.ndarray, player: tuple[int, int], goal: tuple[int, int]) -> dict:
    """The ground-truth state dict of a maze position."""
    grid = np.where(walls, "*", "o").astype("<U1")
    grid[goal] = "X"
    grid[player] = "P"
    return {
        "relations": [relation_sentence("goal", goal, "the player", player)],
        "symbolic": "\n".join(" ".join(row) for row in grid),
        "structured": {"player_position": [int(player[0]), int(player[1])],
                       "goal_position": [int(goal[0]), int(goal[1])],
                       "grid_size": [int(walls.shape[0]), int(walls.shape[1])]},
    }


class MazeEnv(GridEnv):
    """Walk the player to the destination; see the module docstring."""

    DEFAULT_MAX_ACTIONS_PER_STEP = 10
    DEFAULT_MAX_STEPS = 200
    CELL_PX = 16
    _SNAP_ATTRS = ("player",)
    STRUCT_KEYS = ("player_position", "goal_position", "grid_size")
    NL_HINT = ('Describe where the goal is relative to the player, such as "goal is below and on the left side of the '
               'player" (names: the player, goal).')

    def __init__(
        self,
        *,
        size: int = 11,
        min_actions_to_succeed: int = 1,
        max_actions_per_step: int = 10,
        max_steps: int = 200,
        image_size: int | None = None,
        **common: Any,
    ) -> None:
        n = check_int("size", size, 5, 101)
        if n % 2 == 0:
            raise ValueError(f"size must be odd (corridors and walls alternate), got {size!r}")
        super().__init__(max_steps=max_steps, min_actions_to_succeed=min_actions_to_succeed,
                         max_actions_per_step=max_actions_per_step,
                         image_size=self.CELL_PX * n if image_size is None else image_size, **common)
        self.size = n
        self.task = f"{n}x{n}"
        self.walls = np.zeros((n, n), dtype=bool)
        self.player = (0, 0)
        self.goal = (n - 1, n - 1)

    def _make_level(self, rng: np.random.Generator):
        walls = prim_maze(rng, self.size)
        corners = [(0, 0), (0, self.size - 1), (self.size - 1, 0), (self.size - 1, self.size - 1)]
        start = corners[int(rng.integers(4))]
        return walls, start, farthest_cell(rng, walls, start)

    @staticmethod
    def _solve_level(level) -> Plan | None:
        walls, start, goal = level
        return bfs(start, _succ_fn(walls), lambda p: p == goal)

    def _generate(self, rng: np.random.Generator, options: dict | None) -> None:
        level, plan = generate_level(rng, self._make_level, self._solve_level, self.min_actions_to_succeed, "Maze")
        self.walls, self.player, self.goal = level
        self._start_episode(plan)

    def load_board(self, text: str) -> None:
        """Replace the level by a hand-made square grid in the symbolic format (``P X o *``, spaces optional)."""
        rows = [r.replace(" ", "") for r in text.strip().splitlines() if r.strip()]
        n = len(rows)
        if any(len(r) != n for r in rows) or "".join(rows).count("P") != 1 or "".join(rows).count("X") != 1:
            raise ValueError("a maze board is square with one P and one X")
        self.walls = np.array([[ch == "*" for ch in r] for r in rows], dtype=bool)
        self.player = divmod("".join(rows).index("P"), n)
        self.goal = divmod("".join(rows).index("X"), n)
        self.size = n
        self._loaded()

    def _apply_action(self, value: str) -> ActionResult:
        dr, dc = DIRECTIONS[value]
        r, c = self.player[0] + dr, self.player[1] + dc
        if not (0 <= r < self.size and 0 <= c < self.size) or self.walls[r, c]:
            return ActionResult(False)
        self.player = (r, c)
        return ActionResult(True)

    def _is_success(self) -> bool:
        return self.player == self.goal

    def _get_state(self) -> dict:
        return maze_state(self.walls, self.player, self.goal)

    def _solver_key(self) -> Hashable:
        return self.player

    def _solve(self) -> Plan | None:
        return self._solve_level((self.walls, self.player, self.goal))

    def _image_shape(self) -> tuple[int, int, int]:
        return grid_image_shape(self.size, self.size, self.image_size)

    def _render_image(self) -> np.ndarray:
        codes = np.where(self.walls, 0, 1).astype(np.intp)
        codes[self.goal] = 3
        codes[self.player] = 4 if self.player == self.goal else 2
        return compose(codes, tile_stack(_TILE_NAMES, cell_size(self.size, self.image_size)), side=self.image_size)

    def _system_intro(self) -> str:
        return (
            "You are a Maze solver.\n"
            "Maze Quick Guide\n"
            "Goal: Move the player (P) to the destination (X) through the maze.\n"
            "Symbols (If image is provided there are no symbols):\n"
            "P Player | X Destination | o Empty space (passable) | * Wall (impassable)\n"
            "Rules:\n"
            "1. You can only move onto empty space; walls and the border block you.\n"
            "Actions you can take: Left, Down, Right, Up."
        )

    def _example_fields(self) -> dict[str, str]:
        walls = np.array([[0, 0, 0, 0, 0], [1, 1, 1, 1, 0], [0, 0, 0, 0, 0], [0, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=bool)
        before, after = maze_state(walls, (0, 2), (4, 4)), maze_state(walls, (0, 4), (4, 4))
        why = "The wall below me is open only at the right end, so I first go right twice to reach the opening."
        return {"observation": self.describe_state(before), "prediction": self.describe_state(after),
                "reasoning": why, "think": why, "answer": self.ACTION_SEP.join(["Right", "Right"])}
