"""FrozenLake (VAGEN App. A.4 Tables 8/9/17): ``worldloop/FrozenLake-v0``, gymnasium's dynamics.

Knobs: ``size`` (4; ignored when ``desc`` is given), ``is_slippery`` (False), ``desc`` (a fixed map:
list of equal-length strings over ``S F H G``, one ``S``; None: a new random map every reset),
``p`` (0.8: probability that a generated cell is frozen, as gymnasium's ``generate_random_map``),
``min_actions_to_succeed`` (5; enforced on generated maps only), ``max_actions_per_step`` (3),
``max_steps`` (100 executed actions), ``image_size`` (default 48 px per cell), ``view`` ("board": the
whole board as it lies; "egocentric": a window of ``2 * size - 1`` cells a side centred on the player,
cells off the board black, so the whole board is always in it and the cell a move reaches is always
the same cell of the image), ``outlook`` (what :meth:`FrozenLakeEnv.move_outlook` names: "moves", the
four cells one move reaches; "around", the eight cells around the player; "toward", the eight cells and
then the moves toward the goal again with their cells: "...; Toward the goal: Down hole, Right ice."),
``relation_prompt``
("default"; "vagen": both relations of goal and holes to the player; "local": the goal and the holes
next to the player, see below and :mod:`worldloop.envs.grid.grid_env`), plus the common kwargs of
:class:`worldloop.envs.base.VisualEnv`.

Dynamics are gymnasium's own ``FrozenLakeEnv`` (wrapped, seeded from the episode seed; with
``is_slippery`` the move goes perpendicular with gymnasium's probabilities). Generated maps put
the start and the goal on random distinct cells (as VAGEN: the goal is not always bottom-right)
and are redrawn until the shortest hole-free path is at least ``min_actions_to_succeed`` long.

Rewards per executed action (Table 17): +10 when the player reaches the goal, else -0.1 (falling
into a hole ends the episode with that -0.1); +0.5 format reward per well-formed turn.

Entities (relations, App. D.1 style): ``the player``, ``goal``, ``hole0``, ``hole1``, ... (holes in
reading order), e.g. ``"goal is below and on the right side of the player"``,
``"hole0 is at the same place as the player"`` after a fall. With ``relation_prompt="local"`` the
relations are what the next move depends on (:func:`local_relations`): the goal's relation, then
every hole at Chebyshev distance <= 1 from the player (the cells one or two distinct moves reach,
and its own cell after a fall) in reading order, each named ``hole``: ``"goal is below and on the
left side of the player"``, ``"hole is at the same row and to the left of the player"``.

Symbolic grid (App. C): ``_`` frozen (the start too), ``O`` hole, ``G`` goal, ``P`` player, ``X``
player fell into a hole, ``*`` player on the goal. Structured (App. C keys): ``player_position``,
``target_position`` (the goal), ``hole_positions``, ``grid_size``; positions are [row, col].
"""

from __future__ import annotations

from typing import Any, Hashable, Sequence

import numpy as np
from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv as GymFrozenLake

from worldloop.envs.base import ActionResult, check_int, relation_sentence
from worldloop.envs.grid.grid_env import MOVES, GridEnv, generate_level
from worldloop.envs.grid.render import cell_size, compose, grid_image_shape, tile_stack
from worldloop.envs.grid.solvers import DIRECTIONS, Plan, bfs

_GYM_ACTION = {"Left": 0, "Down": 1, "Right": 2, "Up": 3}
_TILE_NAMES = ("ice", "hole", "goal", "elf", "elf_hole", "elf_goal", "void")
_VOID = _TILE_NAMES.index("void")
_CODE = {"S": 0, "F": 0, "H": 1, "G": 2}


def check_desc(desc: Any) -> list[str]:
    """A FrozenLake map as a list of strings, or ValueError naming ``desc``."""
    if isinstance(desc, np.ndarray):
        desc = ["".join(c.decode() if isinstance(c, bytes) else str(c) for c in row) for row in desc]
    if isinstance(desc, str) or not isinstance(desc, (list, tuple)) or not desc:
        raise ValueError(f"desc must be a list of strings over 'SFHG', got {desc!r}")
    rows = [r.decode() if isinstance(r, bytes) else r for r in desc]
    if not all(isinstance(r, str) and r and set(r) <= set("SFHG") for r in rows) or len({len(r) for r in rows}) != 1:
        raise ValueError(f"desc must be equal-length strings over 'SFHG', got {desc!r}")
    joined = "".join(rows)
    if joined.count("S") != 1 or "G" not in joined:
        raise ValueError(f"desc needs exactly one 'S' and at least one 'G', got {desc!r}")
    return list(rows)


def local_relations(goal: tuple[int, int], holes: Sequence[tuple[int, int]], player: tuple[int, int]) -> list[str]:
    """``relation_prompt="local"``: the goal's relation to the player, then each hole at Chebyshev
    distance <= 1 from it, in the order of ``holes`` (reading order), named ``hole``."""
    near = [h for h in holes if max(abs(h[0] - player[0]), abs(h[1] - player[1])) <= 1]
    return [relation_sentence("goal", goal, "the player", player)] + [
        relation_sentence("hole", h, "the player", player) for h in near]


def frozenlake_state(desc: Sequence[str], player: tuple[int, int], local: bool = False) -> dict:
    """The ground-truth state dict of a FrozenLake position (``local``: the relations of
    :func:`local_relations`)."""
    h, w = len(desc), len(desc[0])
    goals = [(r, c) for r in range(h) for c in range(w) if desc[r][c] == "G"]
    holes = [(r, c) for r in range(h) for c in range(w) if desc[r][c] == "H"]
    if local:
        rel = local_relations(goals[0], holes, player)
    else:
        rel = [relation_sentence("goal", g, "the player", player) for g in goals[:1]]
        rel += [relation_sentence(f"hole{i}", hole, "the player", player) for i, hole in enumerate(holes)]
    grid = [["_" if ch in "SF" else "O" if ch == "H" else "G" for ch in row] for row in desc]
    here = desc[player[0]][player[1]]
    grid[player[0]][player[1]] = "X" if here == "H" else "*" if here == "G" else "P"
    return {
        "relations": rel,
        "symbolic": "\n".join("".join(row) for row in grid),
        "structured": {
            "player_position": [int(player[0]), int(player[1])],
            "target_position": [int(goals[0][0]), int(goals[0][1])],
            "hole_positions": [[int(r), int(c)] for r, c in holes],
            "grid_size": [h, w],
        },
    }


def shortest_path(desc: Sequence[str], start: tuple[int, int]) -> Plan | None:
    """BFS over non-hole cells from ``start`` to a goal (deterministic moves)."""
    h, w = len(desc), len(desc[0])

    def succ(p):
        for name, (dr, dc) in DIRECTIONS.items():
            r, c = p[0] + dr, p[1] + dc
            if 0 <= r < h and 0 <= c < w and desc[r][c] != "H":
                yield name, (r, c)

    if desc[start[0]][start[1]] == "H":
        return None
    return bfs(tuple(start), succ, lambda p: desc[p[0]][p[1]] == "G")


def random_map(rng: np.random.Generator, size: int, p: float) -> list[str]:
    """Holes with probability 1-p; start and goal on two random distinct cells."""
    cells = np.where(rng.random((size, size)) < p, "F", "H").astype("<U1")
    s, g = rng.choice(size * size, size=2, replace=False)
    cells[divmod(int(s), size)] = "S"
    cells[divmod(int(g), size)] = "G"
    return ["".join(row) for row in cells]


class FrozenLakeEnv(GridEnv):
    """Reach the goal without falling into a hole; see the module docstring."""

    DEFAULT_MAX_ACTIONS_PER_STEP = 3
    DEFAULT_MAX_STEPS = 100
    CELL_PX = 48
    STRUCT_KEYS = ("player_position", "target_position", "hole_positions", "grid_size")
    NL_HINT = ('Describe where things are relative to the player, such as "goal is below and on the right side of '
               'the player", "hole0 is at the same row and to the left of the player" (names: the player, goal, '
               'hole0, hole1, ...).')
    VAGEN_NL_HINT = ('Describe the position of the goal and of each hole relative to the player only: give every '
                     'object both its vertical relation (above, below or same row) and its horizontal relation (left, '
                     'right or same column) to the player, such as "goal is below and on the right side of the '
                     'player", "hole0 is at the same row and to the left of the player".')
    LOCAL_NL_HINT = ('Describe what your next move depends on, relative to the player: first the goal, then every hole '
                     'next to the player (the 8 cells around it, diagonals included; none if there is no such hole), '
                     'each with both its vertical relation (above, below or same row) and its horizontal relation '
                     '(left, right or same column), calling every hole "hole", such as "goal is below and on the left '
                     'side of the player", "hole is at the same row and to the left of the player".')

    VIEWS = ("board", "egocentric")
    OUTLOOKS = ("moves", "around", "toward")

    def __init__(
        self,
        *,
        size: int | None = None,
        is_slippery: bool = False,
        desc: Sequence[str] | None = None,
        p: float = 0.8,
        min_actions_to_succeed: int = 5,
        max_actions_per_step: int = 3,
        max_steps: int = 100,
        image_size: int | None = None,
        view: str = "board",
        outlook: str = "moves",
        **common: Any,
    ) -> None:
        self.fixed_desc = None if desc is None else check_desc(desc)
        if self.fixed_desc is not None:
            n = max(len(self.fixed_desc), len(self.fixed_desc[0]))
        else:
            n = check_int("size", 4 if size is None else size, 2, 32)
        if not isinstance(is_slippery, (bool, np.bool_)):
            raise ValueError(f"is_slippery must be a bool, got {is_slippery!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
            raise ValueError(f"p must be a number in (0, 1], got {p!r}")
        if view not in self.VIEWS:
            raise ValueError(f"view must be one of {list(self.VIEWS)}, got {view!r}")
        self.view = view
        if outlook not in self.OUTLOOKS:
            raise ValueError(f"outlook must be one of {list(self.OUTLOOKS)}, got {outlook!r}")
        self.outlook = outlook
        self.size = n
        super().__init__(max_steps=max_steps, min_actions_to_succeed=min_actions_to_succeed,
                         max_actions_per_step=max_actions_per_step,
                         image_size=self.CELL_PX * self._view_cells() if image_size is None else image_size, **common)
        self.is_slippery = bool(is_slippery)
        self.p = float(p)
        self.task = f"{n}x{n}" + ("-slippery" if self.is_slippery else "")
        self.desc: list[str] = list(self.fixed_desc or ["S" + "F" * (n - 2) + "G"] + ["F" * n] * (n - 1))
        self._gym: GymFrozenLake | None = None

    # ----------------------------------------------------------- level

    def _generate(self, rng: np.random.Generator, options: dict | None) -> None:
        if self.fixed_desc is not None:
            desc = self.fixed_desc
            start = divmod("".join(desc).index("S"), len(desc[0]))
            plan = shortest_path(desc, start) or Plan([], [start])
        else:
            def solve(d):
                return shortest_path(d, divmod("".join(d).index("S"), self.size))

            desc, plan = generate_level(rng, lambda r: random_map(r, self.size, self.p), solve,
                                        self.min_actions_to_succeed, "FrozenLake")
        if self._gym is None or desc != self.desc:
            self._gym = GymFrozenLake(desc=list(desc), is_slippery=self.is_slippery)
        self.desc = list(desc)
        self._gym.reset(seed=int(rng.integers(2**31 - 1)))
        self._start_episode(plan)

    @property
    def player(self) -> tuple[int, int]:
        assert self._gym is not None
        return divmod(int(self._gym.s), len(self.desc[0]))

    def _here(self) -> str:
        r, c = self.player
        return self.desc[r][c]

    # ----------------------------------------------------------- dynamics

    def _apply_action(self, value: str) -> ActionResult:
        assert self._gym is not None
        before = int(self._gym.s)
        after = int(self._gym.step(_GYM_ACTION[value])[0])
        return ActionResult(after != before)

    def _is_success(self) -> bool:
        return self._here() == "G"

    def _is_terminal(self) -> bool:
        return self._here() in "GH"

    def _get_state(self) -> dict:
        return frozenlake_state(self.desc, self.player, local=self.relation_prompt == "local")

    def _snapshot(self) -> Any:
        assert self._gym is not None
        return (int(self._gym.s), self._gym.lastaction, self._gym.np_random.bit_generator.state)

    def _restore(self, snap: Any) -> None:
        assert self._gym is not None
        self._gym.s, self._gym.lastaction, self._gym.np_random.bit_generator.state = snap
        self._state_cache = None

    # ----------------------------------------------------------- solver

    OUTLOOK_WORDS = {"H": "hole", "G": "goal", "F": "ice", "S": "ice"}

    DIAGONALS = (("Down-left", (1, -1)), ("Down-right", (1, 1)), ("Up-left", (-1, -1)), ("Up-right", (-1, 1)))

    def move_outlook(self) -> str:
        """Each move's cell, in the order of the actions: "Left ice, Down hole, Right edge, Up goal.";
        with ``outlook="around"`` the four diagonal cells follow (every cell a turn of distinct moves can
        reach): "Left ice, Down hole, Right edge, Up goal; Down-left ice, Down-right hole, Up-left edge,
        Up-right edge."; with ``outlook="toward"`` the moves that bring the player closer to the goal follow
        again, in the same order, with their cells: "...; Toward the goal: Down hole, Right ice.", so the
        answer can pick the safe one of the few moves just written (docs/learning-history.md "Naming the
        moves toward the goal")."""
        text = ", ".join(f"{name} {self._cell(*DIRECTIONS[name])}" for name in MOVES)
        if self.outlook in ("around", "toward"):
            text += "; " + ", ".join(f"{name} {self._cell(dr, dc)}" for name, (dr, dc) in self.DIAGONALS)
        toward = self._moves_toward_goal() if self.outlook == "toward" else []
        if toward:
            text += "; Toward the goal: " + ", ".join(f"{name} {self._cell(*DIRECTIONS[name])}" for name in toward)
        return text + "."

    def _cell(self, dr: int, dc: int) -> str:
        """The outlook's word for the cell ``(dr, dc)`` from the player: ice, hole, goal, or edge off the board."""
        r, c = self.player
        rr, cc = r + dr, c + dc
        inside = 0 <= rr < len(self.desc) and 0 <= cc < len(self.desc[0])
        return self.OUTLOOK_WORDS[self.desc[rr][cc]] if inside else "edge"

    def _moves_toward_goal(self) -> list[str]:
        """The moves (in the order of MOVES) that shorten the player's Manhattan distance to the goal,
        whatever their cell holds."""
        r, c = self.player
        goal = divmod("".join(self.desc).index("G"), len(self.desc[0]))
        return [name for name in MOVES
                if abs(goal[0] - r - DIRECTIONS[name][0]) + abs(goal[1] - c - DIRECTIONS[name][1])
                < abs(goal[0] - r) + abs(goal[1] - c)]

    def tempting_dead_end(self) -> bool:
        """A move that shortens the player's Manhattan distance to the goal steps into a hole."""
        return any(self._cell(*DIRECTIONS[name]) == "hole" for name in self._moves_toward_goal())

    def _solver_key(self) -> Hashable:
        return self.player

    def _solve(self) -> Plan | None:
        return shortest_path(self.desc, self.player)

    # ----------------------------------------------------------- rendering and prompts

    def _view_cells(self) -> int:
        return 2 * self.size - 1 if self.view == "egocentric" else self.size

    def _image_shape(self) -> tuple[int, int, int]:
        return grid_image_shape(self._view_cells(), self._view_cells(), self.image_size)

    def _render_image(self) -> np.ndarray:
        codes = np.array([[_CODE[ch] for ch in row] for row in self.desc], dtype=np.intp)
        codes[self.player] += 3
        side = self._view_cells()
        if self.view == "egocentric":
            # the board shifted so the player sits in the middle cell; the rest is off the board ("void")
            window = np.full((side, side), _VOID, dtype=np.intp)
            r0, c0 = self.size - 1 - self.player[0], self.size - 1 - self.player[1]
            window[r0 : r0 + codes.shape[0], c0 : c0 + codes.shape[1]] = codes
            codes = window
        return compose(codes, tile_stack(_TILE_NAMES, cell_size(side, self.image_size)), side=self.image_size)

    def _system_intro(self) -> str:
        rule2 = ("2. Frozen tiles are slippery, you may move perpendicular to your intended direction.\n"
                 if self.is_slippery else "")
        return (
            "You are a FrozenLake solver.\n"
            "FrozenLake Quick Guide\n"
            "Goal: Reach the goal (G).\n"
            "Symbols (If image is provided there are no symbols):\n"
            f"{self._view_line()}"
            "_ Frozen | O Hole | G Goal | P Player | X Player fell into hole | * Player on goal\n"
            "Rules:\n"
            "1. Avoid falling into holes.\n"
            f"{rule2}"
            "Actions you can take: Left, Down, Right, Up."
        )

    def _view_line(self) -> str:
        if self.view != "egocentric" or not self.vision:
            return ""
        return "The image is centred on the player: the player is always in its middle cell, black is off the board.\n"

    def _example_fields(self) -> dict[str, str]:
        desc = ["FFFF", "FHFF", "FFFH", "HFFG"]
        local = self.relation_prompt == "local"
        before, after = frozenlake_state(desc, (1, 3), local), frozenlake_state(desc, (2, 2), local)
        return {"observation": self.describe_state(before), "prediction": self.describe_state(after),
                "reasoning": "The goal is down on my left and there is a hole right below me, so I go left then down.",
                "think": "The goal is down on my left and a hole is right below me, so I go left then down.",
                "answer": self.ACTION_SEP.join(["Left", "Down"])}
