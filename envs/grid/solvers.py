"""Breadth-first solvers for the grid envs (minimum number of actions; plans for demonstrations).

Public API::

    bfs(start, successors, is_goal, max_states=500_000) -> Plan | None
        Plan(actions: list[A], states: list[S])    # states[i] is the state before actions[i];
                                                   # states[-1] is the goal state
    grid_path(start, goal, passable, shape) -> list[str] | None    # 4-neighbour shortest path
    DIRECTIONS = {"Up": (-1, 0), "Down": (1, 0), "Left": (0, -1), "Right": (0, 1)}
    SokobanSolver(walls, targets)
        .solve(player, boxes, max_states=500_000) -> Plan | None   # states: (player, sorted boxes)
        .successors(state) / .is_goal(state)

Every edge costs one action, so the first time BFS generates a goal state its plan is optimal.
Moves that do not change the state (into a wall) are never generated. The Sokoban solver prunes
pushes onto "dead" cells (cells from which no box can ever reach a target: the complement of the
cells reachable from a target by pulls), which keeps the exact minimum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, Hashable, Iterable, Sequence, TypeVar

import numpy as np

S = TypeVar("S", bound=Hashable)
A = TypeVar("A")

DIRECTIONS: dict[str, tuple[int, int]] = {"Up": (-1, 0), "Down": (1, 0), "Left": (0, -1), "Right": (0, 1)}


@dataclass(frozen=True)
class Plan(Generic[S, A]):
    actions: list
    states: list


def bfs(
    start: S,
    successors: Callable[[S], Iterable[tuple[A, S]]],
    is_goal: Callable[[S], bool],
    max_states: int = 500_000,
) -> Plan | None:
    """Shortest action sequence from ``start`` to a goal state, or None (unsolvable / too large)."""
    if is_goal(start):
        return Plan([], [start])
    parent: dict = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for s in frontier:
            for a, t in successors(s):
                if t in parent:
                    continue
                parent[t] = (s, a)
                if is_goal(t):
                    return _backtrack(parent, t)
                nxt.append(t)
        if len(parent) > max_states:
            return None
        frontier = nxt
    return None


def _backtrack(parent: dict, goal) -> Plan:
    actions, states = [], [goal]
    node = goal
    while parent[node] is not None:
        prev, a = parent[node]
        actions.append(a)
        states.append(prev)
        node = prev
    actions.reverse()
    states.reverse()
    return Plan(actions, states)


def grid_path(
    start: tuple[int, int], goal: tuple[int, int], passable: np.ndarray, shape: tuple[int, int] | None = None
) -> list[str] | None:
    """Shortest list of direction words from ``start`` to ``goal`` over ``passable`` cells."""
    h, w = passable.shape if shape is None else shape

    def succ(p):
        for name, (dr, dc) in DIRECTIONS.items():
            r, c = p[0] + dr, p[1] + dc
            if 0 <= r < h and 0 <= c < w and passable[r, c]:
                yield name, (r, c)

    plan = bfs(tuple(start), succ, lambda p: p == tuple(goal))
    return None if plan is None else plan.actions


class SokobanSolver:
    """BFS over (player cell, sorted box cells) on flat indices of a fixed room."""

    _ORDER = ("Left", "Down", "Right", "Up")

    def __init__(self, walls: np.ndarray, targets: Sequence[tuple[int, int]]) -> None:
        self.h, self.w = walls.shape
        self.walls = walls
        n = self.h * self.w
        self.nbr: list[list[int]] = []
        for i in range(n):
            r, c = divmod(i, self.w)
            row = []
            for name in self._ORDER:
                dr, dc = DIRECTIONS[name]
                rr, cc = r + dr, c + dc
                ok = 0 <= rr < self.h and 0 <= cc < self.w and not walls[rr, cc]
                row.append(rr * self.w + cc if ok else -1)
            self.nbr.append(row)
        self.targets = frozenset(r * self.w + c for r, c in targets)
        self.live = self._live_cells()

    def _live_cells(self) -> list[bool]:
        """Cells from which a box can be pushed to some target (reverse pulls from the targets)."""
        live = [False] * (self.h * self.w)
        stack = list(self.targets)
        for t in stack:
            live[t] = True
        while stack:
            x = stack.pop()
            for d in range(4):
                y = self.nbr[x][d]  # box pulled from x to y needs y and the cell beyond y free
                if y >= 0 and self.nbr[y][d] >= 0 and not live[y]:
                    live[y] = True
                    stack.append(y)
        return live

    def flat(self, pos: Sequence[int]) -> int:
        return int(pos[0]) * self.w + int(pos[1])

    def state(self, player: Sequence[int], boxes: Iterable[Sequence[int]]) -> tuple[int, tuple[int, ...]]:
        return self.flat(player), tuple(sorted(self.flat(b) for b in boxes))

    def is_goal(self, state: tuple[int, tuple[int, ...]]) -> bool:
        return all(b in self.targets for b in state[1])

    def successors(self, state: tuple[int, tuple[int, ...]]):
        p, boxes = state
        nbr, live = self.nbr, self.live
        for d, name in enumerate(self._ORDER):
            n = nbr[p][d]
            if n < 0:
                continue
            if n in boxes:
                nn = nbr[n][d]
                if nn < 0 or nn in boxes or not live[nn]:
                    continue
                yield name, (n, tuple(sorted(nn if b == n else b for b in boxes)))
            else:
                yield name, (n, boxes)

    def solve(self, player: Sequence[int], boxes: Iterable[Sequence[int]], max_states: int = 500_000) -> Plan | None:
        return bfs(self.state(player, boxes), self.successors, self.is_goal, max_states)

    def reverse_search(self, max_states: int = 300_000) -> "ReverseSearch":
        """Exhaustive reverse play: BFS from every solved state by reverse moves and pulls.

        Every state found can be solved, and its BFS depth is its exact minimum number of actions
        (multi-source BFS over the reversed move graph). Stops after ``max_states`` states (depths
        found so far stay exact: BFS finishes a depth before the next).
        """
        opp = (2, 3, 0, 1)  # Left<->Right, Down<->Up in _ORDER
        floor = [i for i in range(self.h * self.w) if not self.walls[divmod(i, self.w)]]
        boxes0 = tuple(sorted(self.targets))
        parent: dict = {}
        order: list = []
        depth_start = [0]
        for p in floor:
            if p not in self.targets:
                s = (p, boxes0)
                parent[s] = None
                order.append(s)
        frontier = list(order)
        nbr = self.nbr
        while frontier and len(parent) < max_states:
            nxt = []
            for state in frontier:
                p, boxes = state
                for d in range(4):
                    q = nbr[p][d]
                    if q < 0 or q in boxes:
                        continue
                    action = self._ORDER[opp[d]]  # forward: from q back onto p
                    pred = (q, boxes)
                    if pred not in parent:
                        parent[pred] = (state, action)
                        order.append(pred)
                        nxt.append(pred)
                    b = nbr[p][opp[d]]
                    if b >= 0 and b in boxes:  # forward: from q push the box at p onto b
                        pred = (q, tuple(sorted(p if x == b else x for x in boxes)))
                        if pred not in parent:
                            parent[pred] = (state, action)
                            order.append(pred)
                            nxt.append(pred)
            if nxt:
                depth_start.append(len(order) - len(nxt))
            frontier = nxt
        return ReverseSearch(parent, order, depth_start)


@dataclass
class ReverseSearch:
    """States by exact distance to a solved state; ``plan(state)`` follows the search back."""

    parent: dict
    order: list
    depth_start: list  # depth_start[k] = index in ``order`` of the first state at distance k

    @property
    def max_depth(self) -> int:
        return len(self.depth_start) - 1

    def states_at(self, k: int) -> list:
        end = self.depth_start[k + 1] if k + 1 < len(self.depth_start) else len(self.order)
        return self.order[self.depth_start[k] : end]

    def plan(self, state) -> Plan:
        actions, states = [], [state]
        while self.parent[state] is not None:
            state, action = self.parent[state]
            actions.append(action)
            states.append(state)
        return Plan(actions, states)
