"""Taxi (WMAct App. A.1): ``worldloop/Taxi-v0``, gymnasium's 5x5 Taxi dynamics.

Knobs: ``min_actions_to_succeed`` (1), ``max_actions_per_step`` (10: WMAct lets a turn carry several
commands), ``max_steps`` (200 executed actions, gymnasium's time limit for Taxi), ``image_size``
(default 40 px per cell), plus the common kwargs of :class:`worldloop.envs.base.VisualEnv`.

Dynamics are gymnasium's own ``TaxiEnv`` (dry roads, no fickle passenger), wrapped: the episode's
taxi cell, passenger depot and destination depot (different from the passenger's) are drawn from the
seeded RNG and redrawn until the optimal plan has at least ``min_actions_to_succeed`` actions.

Actions: ``Left, Down, Right, Up, Pickup, Dropoff`` (aliases ``move up``, ``north``, ``pick up``,
``drop off`` ...). Rewards per executed action: +10 when the passenger is dropped at the
destination, else -0.1, and an extra -1 for an illegal ``Pickup``/``Dropoff`` (gymnasium's -10,
scaled like its -1 step cost is scaled to -0.1; WMAct: "invalid attempts incur a penalty");
+0.5 format reward per well-formed turn. An action is effective when gymnasium's state changes
(a move into a wall, or an illegal pickup/dropoff, is not).

Entities (relations, App. D.1 style): ``the taxi`` (the agent), ``passenger``, ``destination``:
``"passenger is above and on the left side of the taxi"`` (or ``"passenger is in the taxi"``),
``"destination is below and at the same column as the taxi"``, and while the passenger waits
``"destination is at the same row and to the right of the passenger"``.

Symbolic map (WMAct): gymnasium's map with cells 7 characters wide; ``|`` wall, ``:`` open, ``T``
taxi, ``P`` waiting passenger, ``D`` destination, ``R G Y B`` the depots, ``T/P`` taxi and waiting
passenger, ``T(P)`` taxi carrying the passenger, ``T(P)/D`` carrying at the destination, ``T/D``,
``P/D``, ``T/P/D``. Structured: ``taxi_position``, ``passenger_position`` (the taxi's while carried),
``passenger_in_taxi``, ``destination_position``, ``grid_size``; positions are [row, col].
"""

from __future__ import annotations

from typing import Any, Hashable

import numpy as np
from gymnasium.envs.toy_text.taxi import MAP, TaxiEnv as GymTaxi

from worldloop.envs.base import ActionResult, relation_sentence
from worldloop.envs.grid.grid_env import MOVE_ALIASES, MOVES, GridEnv, generate_level
from worldloop.envs.grid.render import cell_size, compose, grid_image_shape, overlay, pad_square, sprite_rgba, tile_stack
from worldloop.envs.grid.solvers import Plan, bfs

ACTIONS = (*MOVES, "Pickup", "Dropoff")
_GYM_ACTION = {"Down": 0, "Up": 1, "Right": 2, "Left": 3, "Pickup": 4, "Dropoff": 5}
_BY_ID = {v: k for k, v in _GYM_ACTION.items()}
LOCS = [(0, 0), (0, 4), (4, 0), (4, 3)]
LOC_NAMES = "RGYB"
ILLEGAL_PENALTY = 1.0
CELL_CHARS = 7
_TILE_NAMES = ("road", "depot_r", "depot_g", "depot_y", "depot_b")


def _decode(s: int) -> tuple[int, int, int, int]:
    s, dest = divmod(int(s), 4)
    s, pas = divmod(s, 5)
    row, col = divmod(s, 5)
    return row, col, pas, dest


def taxi_state(s: int) -> dict:
    """The ground-truth state dict of gymnasium Taxi state ``s``."""
    row, col, pas, dest = _decode(s)
    taxi, dpos = (row, col), LOCS[dest]
    carried = pas == 4
    ppos = taxi if carried else LOCS[pas]
    rel = ["passenger is in the taxi" if carried else relation_sentence("passenger", ppos, "the taxi", taxi),
           relation_sentence("destination", dpos, "the taxi", taxi)]
    if not carried:
        rel.append(relation_sentence("destination", dpos, "the passenger", ppos))
    return {
        "relations": rel,
        "symbolic": taxi_map(row, col, pas, dest),
        "structured": {"taxi_position": [row, col], "passenger_position": [int(ppos[0]), int(ppos[1])],
                       "passenger_in_taxi": carried, "destination_position": [int(dpos[0]), int(dpos[1])],
                       "grid_size": [5, 5]},
    }


def _label(cell: tuple[int, int], taxi: tuple[int, int], pas: int, dest: int) -> str:
    at_taxi, at_dest = cell == taxi, cell == LOCS[dest]
    waiting_here = pas < 4 and cell == LOCS[pas]
    if at_taxi:
        if pas == 4:
            return "T(P)/D" if at_dest else "T(P)"
        return "/".join(["T"] + (["P"] if waiting_here else []) + (["D"] if at_dest else []))
    if waiting_here or at_dest:
        return "/".join((["P"] if waiting_here else []) + (["D"] if at_dest else []))
    return LOC_NAMES[LOCS.index(cell)] if cell in LOCS else ""


def taxi_map(row: int, col: int, pas: int, dest: int) -> str:
    """WMAct-style ASCII map of a Taxi state (gymnasium's walls, wide cells with labels)."""
    border = "+" + "-" * (CELL_CHARS * 5 + 4) + "+"
    lines = [border]
    for r in range(5):
        parts = ["|"]
        for c in range(5):
            parts.append(_label((r, c), (row, col), pas, dest).center(CELL_CHARS))
            parts.append(MAP[r + 1][2 * c + 2])
        lines.append("".join(parts))
    lines.append(border)
    return "\n".join(lines)


class TaxiEnv(GridEnv):
    """Pick up the passenger and drop them at the destination; see the module docstring."""

    ACTIONS = ACTIONS
    ACTION_ALIASES = {**MOVE_ALIASES, "pick up": "Pickup", "drop off": "Dropoff", "pick": "Pickup", "drop": "Dropoff"}
    DEFAULT_MAX_ACTIONS_PER_STEP = 10
    DEFAULT_MAX_STEPS = 200
    CELL_PX = 40
    STRUCT_KEYS = ("taxi_position", "passenger_position", "passenger_in_taxi", "destination_position", "grid_size")
    NL_HINT = ('Describe where things are relative to the taxi, such as "passenger is above and on the left side of the '
               'taxi", "destination is below and at the same column as the taxi" (names: the taxi, passenger, '
               'destination).')

    def __init__(
        self,
        *,
        min_actions_to_succeed: int = 1,
        max_actions_per_step: int = 10,
        max_steps: int = 200,
        image_size: int | None = None,
        **common: Any,
    ) -> None:
        super().__init__(max_steps=max_steps, min_actions_to_succeed=min_actions_to_succeed,
                         max_actions_per_step=max_actions_per_step,
                         image_size=self.CELL_PX * 5 if image_size is None else image_size, **common)
        self._gym = GymTaxi()
        self._base: tuple[int, np.ndarray] | None = None

    # ----------------------------------------------------------- level

    def _make_level(self, rng: np.random.Generator) -> int:
        row, col, pas = (int(v) for v in rng.integers(0, [5, 5, 4]))
        dest = [d for d in range(4) if d != pas][int(rng.integers(3))]
        return int(self._gym.encode(row, col, pas, dest))

    def _plan_from(self, s: int) -> Plan | None:
        P = self._gym.P

        def succ(x):
            for a in range(6):
                nxt = P[x][a][0][1]
                if nxt != x:
                    yield _BY_ID[a], nxt

        return bfs(int(s), succ, lambda x: _decode(x)[2] == _decode(x)[3])

    def _generate(self, rng: np.random.Generator, options: dict | None) -> None:
        s, plan = generate_level(rng, self._make_level, self._plan_from, self.min_actions_to_succeed, "Taxi")
        self._gym.reset(seed=int(rng.integers(2**31 - 1)))
        self._gym.s, self._gym.lastaction = s, None
        self._start_episode(plan)

    def load_state(self, taxi_row: int, taxi_col: int, passenger: int, destination: int) -> None:
        """Put gymnasium's Taxi in a given state (passenger/destination: 0-3 = R, G, Y, B; passenger 4 = in taxi)."""
        if not (0 <= taxi_row < 5 and 0 <= taxi_col < 5 and 0 <= passenger <= 4 and 0 <= destination < 4):
            raise ValueError("taxi_row/taxi_col in 0..4, passenger in 0..4, destination in 0..3")
        self._gym.s, self._gym.lastaction = int(self._gym.encode(taxi_row, taxi_col, passenger, destination)), None
        self._loaded()

    # ----------------------------------------------------------- dynamics

    def _apply_action(self, value: str) -> ActionResult:
        before = int(self._gym.s)
        after, reward, *_ = self._gym.step(_GYM_ACTION[value])
        return ActionResult(int(after) != before, -ILLEGAL_PENALTY if reward <= -10 else 0.0)

    def _is_success(self) -> bool:
        _, _, pas, dest = _decode(self._gym.s)
        return pas == dest

    def _get_state(self) -> dict:
        return taxi_state(int(self._gym.s))

    def _metrics(self) -> dict[str, float]:
        return {**super()._metrics(), "passenger_in_taxi": float(_decode(self._gym.s)[2] == 4)}

    def _snapshot(self) -> Any:
        return int(self._gym.s), self._gym.lastaction

    def _restore(self, snap: Any) -> None:
        self._gym.s, self._gym.lastaction = snap
        self._state_cache = None

    def _solver_key(self) -> Hashable:
        return int(self._gym.s)

    def _solve(self) -> Plan | None:
        return self._plan_from(int(self._gym.s))

    # ----------------------------------------------------------- rendering and prompts

    def _background(self, cell: int) -> np.ndarray:
        if self._base is None or self._base[0] != cell:
            codes = np.zeros((5, 5), dtype=np.intp)
            for i, loc in enumerate(LOCS):
                codes[loc] = i + 1
            img = compose(codes, tile_stack(_TILE_NAMES, cell))
            t = max(2, cell // 8)
            for r in range(5):
                for c in range(4):
                    if MAP[r + 1][2 * c + 2] == "|":
                        x = (c + 1) * cell
                        img[r * cell : (r + 1) * cell, max(0, x - t // 2) : x + (t + 1) // 2] = (30, 30, 30)
            img[:t, :] = img[-t:, :] = img[:, :t] = img[:, -t:] = (30, 30, 30)
            img.setflags(write=False)
            self._base = (cell, img)
        return self._base[1]

    def _image_shape(self) -> tuple[int, int, int]:
        return grid_image_shape(5, 5, self.image_size)

    def _render_image(self) -> np.ndarray:
        cell = cell_size(5, self.image_size)
        img = self._background(cell).copy()
        row, col, pas, dest = _decode(self._gym.s)
        overlay(img, sprite_rgba("destination", cell), LOCS[dest][0] * cell, LOCS[dest][1] * cell)
        shared = pas < 4 and LOCS[pas] == (row, col)
        size = cell // 2 if shared else cell  # taxi and waiting passenger side by side, half size
        if pas < 4:
            overlay(img, sprite_rgba("passenger", size), LOCS[pas][0] * cell, LOCS[pas][1] * cell + cell - size)
        overlay(img, sprite_rgba("taxi_full" if pas == 4 else "taxi", size), row * cell + cell - size, col * cell)
        return pad_square(img, self.image_size)

    def _system_intro(self) -> str:
        return (
            "You are a Taxi driver.\n"
            "Taxi Quick Guide\n"
            "Goal: Pick up the passenger and drop them off at the destination.\n"
            "Symbols (If image is provided there are no symbols):\n"
            "| Wall | : Open path | T Taxi | P Passenger waiting | D Destination | R, G, Y, B Special points | "
            "T/P Taxi and waiting passenger in the same cell | T(P) Taxi carrying the passenger | "
            "T(P)/D Taxi carrying the passenger at the destination | T/D Taxi at the destination | "
            "P/D Passenger waiting at the destination\n"
            "Rules:\n"
            "1. Walls (|) block moves between cells.\n"
            "2. Pickup only where the passenger waits; Dropoff only at the destination while carrying the "
            "passenger; otherwise you get a penalty.\n"
            "Actions you can take: Left, Down, Right, Up, Pickup, Dropoff."
        )

    def _example_fields(self) -> dict[str, str]:
        before = taxi_state(int(self._gym.encode(1, 0, 0, 3)))
        after = taxi_state(int(self._gym.encode(0, 0, 4, 3)))
        why = "The passenger waits one cell above the taxi, so I go up and pick them up."
        return {"observation": self.describe_state(before), "prediction": self.describe_state(after),
                "reasoning": why, "think": why, "answer": self.ACTION_SEP.join(["Up", "Pickup"])}
