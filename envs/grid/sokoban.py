"""Sokoban (VAGEN App. A.4 Tables 6/7/16; WMAct App. A.1 hard variants): ``worldloop/Sokoban-v0``.

Knobs: ``dim_room`` [rows, cols] incl. the outer wall (default [6, 6]), ``num_boxes`` (1),
``max_steps`` (100 executed actions), ``min_actions_to_succeed`` (5: the optimal solution of every
generated level is at least this long), ``max_actions_to_succeed`` (None; a number: and at most this
long), ``max_actions_per_step`` (3), ``image_size`` (default
32 px per cell), ``crop_outer_wall`` (False; True: the image leaves out the outer ring of wall,
which every generated room has, so a 6x6 room is drawn as its 4x4 inside; the text state, the
relations and the dynamics are those of the whole room), ``relation_prompt`` ("default"; "vagen": describe target and boxes relative to the
player only, see :mod:`worldloop.envs.grid.grid_env`), plus the common kwargs of
:class:`worldloop.envs.base.VisualEnv`.

Actions: ``Left, Down, Right, Up`` (aliases ``move up``, ``push up``, ``north``, ...). Walking into a
box pushes it when the cell behind it is free; a blocked move changes nothing (not "effective").

Rewards per executed action (Table 16): +1 when a box is pushed onto a target, -1 when pushed off
one (gym-sokoban, so on/off cycling earns nothing), +10 when the action solves the level, else
-0.1; +0.5 format reward per well-formed turn (see envs/base.py for the turn rules).

Levels: a random room (gym-sokoban's random-walk topology) with targets on random floor cells,
then reverse play from the solved room (boxes on the targets, the player anywhere): an exhaustive
breadth-first reverse play by moves and pulls (:meth:`worldloop.envs.grid.solvers.SokobanSolver.reverse_search`),
so every state it reaches is solvable and its depth is its exact minimum number of actions. The
start is a random state at a distance drawn uniformly from [``min_actions_to_succeed``, deepest],
where deepest is the room's deepest state or ``max_actions_to_succeed`` (None: no cap) if that is
closer; a room whose deepest state is closer than ``min_actions_to_succeed`` is redrawn. The
optimal plan comes with it (the expert's first plan); later plans come from the forward BFS solver.

Entities (relations, App. D.1 style): ``the player``, ``box0``, ``box1``, ... (numbered by their
starting position in reading order; a box keeps its number when pushed), ``target0``, ... (reading
order). Relations: every box relative to the player, every target relative to the player, every
target relative to every box, e.g. ``"target0 is above and on the left side of box0"``.

Symbolic grid (App. C): ``#`` wall, ``_`` floor, ``O`` target, ``X`` box, ``P`` player, ``*`` box on
target, ``S`` player on target. Structured (App. C): ``player_position``, ``box_positions``,
``target_positions``, ``grid_size``; positions are [row, col] from the top-left.
"""

from __future__ import annotations

from typing import Any, Hashable, Sequence

import numpy as np

from worldloop.envs.base import ActionResult, check_int, relation_sentence
from worldloop.envs.grid.grid_env import GridEnv, generate_level
from worldloop.envs.grid.render import cell_size, compose, grid_image_shape, tile_stack
from worldloop.envs.grid.solvers import DIRECTIONS, Plan, SokobanSolver

Pos = tuple[int, int]

_MASKS = [
    np.array(m, dtype=bool)
    for m in (
        [[0, 0, 0], [1, 1, 1], [0, 0, 0]],
        [[0, 1, 0], [0, 1, 0], [0, 1, 0]],
        [[0, 0, 0], [1, 1, 0], [0, 1, 0]],
        [[0, 0, 0], [1, 1, 0], [1, 1, 0]],
        [[0, 0, 0], [0, 1, 1], [0, 1, 0]],
    )
]
_STEPS = [(1, 0), (0, 1), (-1, 0), (0, -1)]
_TILE_NAMES = ("wall", "floor", "target", "box", "box_target", "player", "player_target")
SOLVER_MAX_STATES = 400_000
REVERSE_MAX_STATES = 300_000


def room_topology(rng: np.random.Generator, h: int, w: int, num_steps: int, p_change: float = 0.35) -> np.ndarray:
    """Walls (True) of a random room: gym-sokoban's random walk stamping small floor masks."""
    floor = np.zeros((h, w), dtype=bool)
    r, c = int(rng.integers(1, h - 1)), int(rng.integers(1, w - 1))
    turns = rng.random(num_steps) < p_change
    dirs = rng.integers(4, size=num_steps + 1)
    masks = rng.integers(len(_MASKS), size=num_steps)
    dr, dc = _STEPS[dirs[-1]]
    for i in range(num_steps):
        if turns[i]:
            dr, dc = _STEPS[dirs[i]]
        r, c = min(max(r + dr, 1), h - 2), min(max(c + dc, 1), w - 2)
        floor[r - 1 : r + 2, c - 1 : c + 2] |= _MASKS[masks[i]]
    floor[0, :] = floor[-1, :] = floor[:, 0] = floor[:, -1] = False
    return ~floor


def sokoban_state(walls: np.ndarray, targets: Sequence[Pos], boxes: Sequence[Pos], player: Pos) -> dict:
    """The ground-truth state dict (relations, symbolic grid, structured) of a Sokoban position."""
    rel = [relation_sentence(f"box{i}", b, "the player", player) for i, b in enumerate(boxes)]
    rel += [relation_sentence(f"target{j}", t, "the player", player) for j, t in enumerate(targets)]
    rel += [relation_sentence(f"target{j}", t, f"box{i}", b) for j, t in enumerate(targets) for i, b in enumerate(boxes)]
    grid = np.where(walls, "#", "_").astype("<U1")
    for t in targets:
        grid[t] = "O"
    tset = set(targets)
    for b in boxes:
        grid[b] = "*" if b in tset else "X"
    grid[player] = "S" if player in tset else "P"
    return {
        "relations": rel,
        "symbolic": "\n".join("".join(row) for row in grid),
        "structured": {
            "player_position": [int(player[0]), int(player[1])],
            "box_positions": [[int(r), int(c)] for r, c in boxes],
            "target_positions": [[int(r), int(c)] for r, c in targets],
            "grid_size": [int(walls.shape[0]), int(walls.shape[1])],
        },
    }


def parse_symbolic(text: str) -> tuple[np.ndarray, list[Pos], list[Pos], Pos]:
    """(walls, targets, boxes, player) of an App. C symbol grid (hand-made boards in tests/demos)."""
    rows = [r for r in text.strip().splitlines() if r.strip()]
    h, w = len(rows), max(len(r) for r in rows)
    walls = np.ones((h, w), dtype=bool)
    targets, boxes, player = [], [], None
    for r, row in enumerate(rows):
        for c, ch in enumerate(row):
            walls[r, c] = ch == "#"
            if ch in "O*S":
                targets.append((r, c))
            if ch in "X*":
                boxes.append((r, c))
            if ch in "PS":
                player = (r, c)
    if player is None or not boxes or len(boxes) != len(targets):
        raise ValueError("a Sokoban board needs one player and as many boxes as targets")
    return walls, targets, boxes, player


_EXAMPLE_BEFORE = "######\n#__P_#\n#__X_#\n#____#\n#__O_#\n######"


class SokobanEnv(GridEnv):
    """Push every box onto a target; see the module docstring."""

    DEFAULT_MAX_ACTIONS_PER_STEP = 3
    DEFAULT_MAX_STEPS = 100
    CELL_PX = 32
    _SNAP_ATTRS = ("player", "boxes")
    STRUCT_KEYS = ("player_position", "box_positions", "target_positions", "grid_size")
    NL_HINT = ('Describe where things are relative to each other, such as "box0 is above and on the left side of the '
               'player", "target0 is below and at the same column as box0" (names: the player, box0, box1, ..., '
               'target0, target1, ...).')
    VAGEN_NL_HINT = ('Describe the position of the target and of each box relative to the player only: give every '
                     'object both its vertical relation (above, below or same row) and its horizontal relation (left, '
                     'right or same column) to the player, such as "box0 is below and on the right side of the '
                     'player", "target0 is below and at the same column as the player".')

    def __init__(
        self,
        *,
        dim_room: Sequence[int] = (6, 6),
        num_boxes: int = 1,
        max_steps: int = 100,
        min_actions_to_succeed: int = 5,
        max_actions_to_succeed: int | None = None,
        max_actions_per_step: int = 3,
        image_size: int | None = None,
        crop_outer_wall: bool = False,
        **common: Any,
    ) -> None:
        if isinstance(dim_room, (int, np.integer)) and not isinstance(dim_room, bool):
            dim_room = (dim_room, dim_room)
        if not isinstance(dim_room, (list, tuple)) or len(dim_room) != 2:
            raise ValueError(f"dim_room must be [rows, cols], got {dim_room!r}")
        h, w = (check_int("dim_room", v, 5, 30) for v in dim_room)
        nb = check_int("num_boxes", num_boxes, 1, 8)
        if nb + 1 > (h - 2) * (w - 2) // 2:
            raise ValueError(f"num_boxes={nb} does not fit in dim_room={[h, w]}")
        self.crop_outer_wall = bool(crop_outer_wall)
        if max_actions_to_succeed is not None:
            max_actions_to_succeed = check_int("max_actions_to_succeed", max_actions_to_succeed,
                                               max(1, int(min_actions_to_succeed)))
        self.max_actions_to_succeed = max_actions_to_succeed
        shown = max(h, w) - 2 * self.crop_outer_wall
        super().__init__(max_steps=max_steps, min_actions_to_succeed=min_actions_to_succeed,
                         max_actions_per_step=max_actions_per_step,
                         image_size=self.CELL_PX * shown if image_size is None else image_size, **common)
        self.dim_room = (h, w)
        self.num_boxes = nb
        self.task = f"{h}x{w}-{nb}box"
        self.walls = np.ones((h, w), dtype=bool)
        self.targets: list[Pos] = []
        self.boxes: list[Pos] = []
        self.player: Pos = (1, 1)
        self._solver: SokobanSolver | None = None

    # ----------------------------------------------------------- level

    def _make_level(self, rng: np.random.Generator):
        h, w = self.dim_room
        walls = room_topology(rng, h, w, int(1.7 * (h + w)))
        floor = [(int(r), int(c)) for r, c in np.argwhere(~walls)]
        if len(floor) < self.num_boxes + 1:
            return None
        targets = sorted(floor[i] for i in rng.choice(len(floor), self.num_boxes, replace=False))
        solver = SokobanSolver(walls, targets)
        search = solver.reverse_search(REVERSE_MAX_STATES)
        need = max(1, self.min_actions_to_succeed)
        if search.max_depth < need:
            return None
        deepest = search.max_depth
        if self.max_actions_to_succeed is not None:
            deepest = min(deepest, self.max_actions_to_succeed)
        candidates = search.states_at(int(rng.integers(need, deepest + 1)))
        start = candidates[int(rng.integers(len(candidates)))]
        player = divmod(start[0], w)
        boxes = sorted(divmod(b, w) for b in start[1])
        return walls, targets, boxes, player, solver, search.plan(start)

    def _generate(self, rng: np.random.Generator, options: dict | None) -> None:
        level, plan = generate_level(rng, self._make_level, lambda lv: lv[5], self.min_actions_to_succeed, "Sokoban")
        self.walls, self.targets, self.boxes, self.player, self._solver, _ = level
        self._start_episode(plan)

    def load_board(self, text: str) -> None:
        """Replace the level by a hand-made App. C symbol grid (tests, demos); the step count restarts."""
        walls, targets, boxes, player = parse_symbolic(text)
        self.walls, self.targets, self.boxes, self.player = walls, sorted(targets), sorted(boxes), player
        self.dim_room = walls.shape
        self._solver = SokobanSolver(walls, self.targets)
        self._loaded()

    # ----------------------------------------------------------- dynamics

    def _apply_action(self, value: str) -> ActionResult:
        dr, dc = DIRECTIONS[value]
        r, c = self.player
        nxt = (r + dr, c + dc)
        if self.walls[nxt]:
            return ActionResult(False)
        reward = 0.0
        if nxt in self.boxes:
            beyond = (nxt[0] + dr, nxt[1] + dc)
            if self.walls[beyond] or beyond in self.boxes:
                return ActionResult(False)
            self.boxes = [beyond if b == nxt else b for b in self.boxes]
            reward = float(beyond in self.targets) - float(nxt in self.targets)
        self.player = nxt
        return ActionResult(True, reward)

    def _is_success(self) -> bool:
        return all(b in self.targets for b in self.boxes)

    def _get_state(self) -> dict:
        return sokoban_state(self.walls, self.targets, self.boxes, self.player)

    def _metrics(self) -> dict[str, float]:
        on = sum(b in self.targets for b in self.boxes)
        return {**super()._metrics(), "boxes_on_target": on / max(1, len(self.boxes))}

    # ----------------------------------------------------------- solver

    def _solver_key(self) -> Hashable:
        assert self._solver is not None
        return self._solver.state(self.player, self.boxes)

    def _solve(self) -> Plan | None:
        assert self._solver is not None
        return self._solver.solve(self.player, self.boxes, SOLVER_MAX_STATES)

    # ----------------------------------------------------------- rendering and prompts

    def _image_shape(self) -> tuple[int, int, int]:
        h, w = self.dim_room
        k = 2 * self.crop_outer_wall
        return grid_image_shape(h - k, w - k, self.image_size)

    def _render_image(self) -> np.ndarray:
        codes = np.where(self.walls, 0, 1).astype(np.intp)
        for t in self.targets:
            codes[t] = 2
        for b in self.boxes:
            codes[b] = 4 if codes[b] == 2 else 3
        codes[self.player] = 6 if codes[self.player] == 2 else 5
        if self.crop_outer_wall:  # the outer ring is wall in every generated room: the image shows the inside
            if not (self.walls[0].all() and self.walls[-1].all() and self.walls[:, 0].all() and self.walls[:, -1].all()):
                raise ValueError("crop_outer_wall: this board's outer ring is not all wall; it cannot be cropped")
            codes = codes[1:-1, 1:-1]
        h, w = codes.shape
        cell = cell_size(max(h, w), self.image_size)
        return compose(codes, tile_stack(_TILE_NAMES, cell), side=self.image_size)

    def _system_intro(self) -> str:
        return (
            "You are a Sokoban solver.\n"
            "Sokoban Quick Guide\n"
            "Goal: Push all boxes onto targets.\n"
            "Symbols (If image is provided there are no symbols):\n"
            "# Wall | _ Floor | O Target | X Box | P You | * Box on Target | S You on Target\n"
            "Rules:\n"
            "1. Push boxes (can't pull).\n"
            "2. Avoid walls.\n"
            "Actions you can take: Left, Down, Right, Up."
        )

    def _example_fields(self) -> dict[str, str]:
        walls, targets, boxes, player = parse_symbolic(_EXAMPLE_BEFORE)
        before = sokoban_state(walls, targets, boxes, player)
        after = sokoban_state(walls, targets, [(4, 3)], (3, 3))
        return {"observation": self.describe_state(before), "prediction": self.describe_state(after),
                "reasoning": "I need to go down then push the box down to the target.",
                "think": "The box is one step below me, and the target is two steps below the box, so I go down twice.",
                "answer": self.ACTION_SEP.join(["Down", "Down"])}
