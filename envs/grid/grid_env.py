"""Shared layer of the four grid envs (Sokoban, FrozenLake, Maze, Taxi) on top of VisualEnv.

Adds: direction actions with aliases (``Up``/``move up``/``push up``/``north`` ...), an expert that
caches the BFS plan of every state it passes through (one search per episode when the expert is
followed), cheap snapshots of the attributes named in ``_SNAP_ATTRS``, the state-format hints of
the prompt and the generate-until-hard-enough loop used for ``min_actions_to_succeed``.

``relation_prompt`` (kwarg of the envs that set ``VAGEN_NL_HINT``: Sokoban, FrozenLake): ``"default"``
keeps the env's own natural-language hint; ``"vagen"`` asks for what VAGEN's judge scores (the
``vagen`` rule mode, :mod:`worldloop.judge.vagen_score`): the position of every object relative to
the player only, with both a vertical and a horizontal relation each, and the prompt example and
the expert's descriptions (SFT demonstrations) then state only the player-relative sentences.
``"local"`` (envs that set ``LOCAL_NL_HINT``: FrozenLake) asks for what the next move depends on:
the env's ``state["relations"]`` are then exactly those sentences (FrozenLake: the goal's relation to
the player, then every hole within one cell of the player, diagonals included, named "hole"), so the
prompt example, the expert's descriptions, grounding pre-training and the ``local`` rule mode
(:mod:`worldloop.judge.local_score`) all use the same text. Sokoban does not offer it: its relations
(every box and target relative to the player, every target relative to every box) already hold what a
one-box push depends on except the walls, and naming walls would need a vocabulary the relation
grammar does not have. The config passes ``vagen`` / ``local`` when ``judge.rule_mode`` is that mode.

``progress_reward`` (kwarg of every grid env, default 0: the paper's reward table unchanged): a
potential-based shaping term (Ng, Harada & Russell 1999, with gamma 1) added to a turn's
``env_reward``: ``progress_reward * (d_before - d_after)``, where ``d`` is the number of actions
the solver's shortest plan still needs (0 once solved; ``max_steps`` from a state the solver
cannot finish, e.g. a box in a corner or a hole). An episode's shaping terms sum to
``progress_reward * (d_start - d_end)``: how much closer to the goal it ended, so episodes that all
fail still differ in reward. The optimal policy is unchanged by a potential difference. The turn's
``info["progress_reward"]`` reports the term (0.0 when off or nothing ran). Meant for training
episodes (``actor.envs[i].train_kwargs``): held-out evaluation keeps the paper's rewards.
"""

from __future__ import annotations

import copy
from typing import Any, Hashable, Sequence

import numpy as np

from worldloop.envs.base import VisualEnv, check_int
from worldloop.envs.grid.solvers import Plan

MOVES = ("Left", "Down", "Right", "Up")  # VAGEN's order ("Actions you can take: Left, Down, Right, Up.")

MOVE_ALIASES: dict[str, str] = {}
for _word, _syn in (("Left", "west"), ("Down", "south"), ("Right", "east"), ("Up", "north")):
    low = _word.lower()
    MOVE_ALIASES.update({f"move {low}": _word, f"push {low}": _word, f"go {low}": _word, _syn: _word})

MAX_GENERATION_ATTEMPTS = 300
RELATION_PROMPTS = ("default", "vagen", "local")


def generate_level(rng: np.random.Generator, make, solve, min_actions: int, what: str):
    """Draw levels with ``make(rng)`` until ``solve(level)`` gives a plan of >= max(1, min_actions).

    Returns ``(level, plan)``; RuntimeError naming ``min_actions_to_succeed`` after
    MAX_GENERATION_ATTEMPTS draws (a level that is already solved is never accepted).
    """
    need = max(1, int(min_actions))
    for _ in range(MAX_GENERATION_ATTEMPTS):
        level = make(rng)
        if level is None:
            continue
        plan = solve(level)
        if plan is not None and len(plan.actions) >= need:
            return level, plan
    raise RuntimeError(
        f"could not generate a {what} level needing >= {need} actions in {MAX_GENERATION_ATTEMPTS} attempts; "
        "lower min_actions_to_succeed or enlarge the level"
    )


class GridEnv(VisualEnv):
    """Grid env helpers; subclasses define the solver hooks below plus VisualEnv's required hooks."""

    ACTIONS = MOVES
    ACTION_ALIASES = MOVE_ALIASES
    _SNAP_ATTRS: tuple[str, ...] = ()
    # prompt texts per state format (subclass): entities / symbolic note / structured keys
    NL_HINT = ""
    STRUCT_KEYS: tuple[str, ...] = ()
    # the natural-language hints of relation_prompt="vagen" / "local" ("" = the env does not offer it)
    VAGEN_NL_HINT = ""
    LOCAL_NL_HINT = ""

    def __init__(self, *, min_actions_to_succeed: int = 0, relation_prompt: str = "default",
                 progress_reward: float = 0.0, **common: Any) -> None:
        hints = {"default": True, "vagen": bool(self.VAGEN_NL_HINT), "local": bool(self.LOCAL_NL_HINT)}
        offered = [p for p in RELATION_PROMPTS if hints[p]]
        if relation_prompt not in offered:
            raise ValueError(f"relation_prompt must be one of {list(offered)} for {type(self).__name__}, "
                             f"got {relation_prompt!r}")
        self.relation_prompt = relation_prompt
        if isinstance(progress_reward, bool) or not isinstance(progress_reward, (int, float, np.integer, np.floating)) \
                or not 0.0 <= float(progress_reward) < float("inf"):
            raise ValueError(f"progress_reward must be a finite number >= 0, got {progress_reward!r}")
        self.progress_reward = float(progress_reward)
        super().__init__(**common)
        self.min_actions_to_succeed = check_int("min_actions_to_succeed", min_actions_to_succeed, 0, 10_000)
        self._plan_cache: dict[Hashable, list[str] | None] = {}  # None: no plan
        self.optimal_actions: int | None = None  # length of the optimal plan at reset

    # ----------------------------------------------------------- solver hooks (subclass)

    def _solver_key(self) -> Hashable:
        """The current state as the solver sees it."""
        raise NotImplementedError

    def _solve(self) -> Plan | None:
        """BFS plan from the current state (``plan.states[i]`` are solver keys)."""
        raise NotImplementedError

    # ----------------------------------------------------------- expert

    def _remember(self, plan: Plan) -> None:
        for i, key in enumerate(plan.states[:-1]):
            self._plan_cache.setdefault(key, list(plan.actions[i:]))

    def _remaining_plan(self) -> list[str] | None:
        """The shortest plan from the current state ([] once terminal), None if the solver finds none."""
        if self._is_terminal():
            return [] if self._is_success() else None
        key = self._solver_key()
        if key not in self._plan_cache:
            found = self._solve()
            if found is None:
                self._plan_cache[key] = None
            else:
                self._remember(found)
        return self._plan_cache.get(key)

    def _expert_actions(self) -> list[str]:
        return list((self._remaining_plan() or [])[: self.max_actions_per_step])

    def _distance_to_goal(self) -> int:
        """The ``progress_reward`` potential: actions the shortest plan needs, ``max_steps`` if none."""
        plan = self._remaining_plan()
        return self.max_steps if plan is None else len(plan)

    def step(self, response: Any) -> tuple[dict, float, bool, bool, dict]:
        shaping = self.progress_reward > 0 and self._was_reset and not self._done
        before = self._distance_to_goal() if shaping else 0
        obs, reward, terminated, truncated, info = super().step(response)
        bonus = 0.0
        if shaping and info["actions_executed"]:
            bonus = round(self.progress_reward * (before - self._distance_to_goal()), 10)
            info["env_reward"] = round(info["env_reward"] + bonus, 10)
            reward += bonus
        info["progress_reward"] = bonus
        return obs, reward, terminated, truncated, info

    def _start_episode(self, plan: Plan) -> None:
        """Called by ``_generate`` with the optimal plan of the new level."""
        self._plan_cache = {}
        self._remember(plan)
        self.optimal_actions = len(plan.actions)

    def _loaded(self) -> None:
        """Bookkeeping after a hand-made board replaced the level (``load_board``)."""
        self._plan_cache = {}
        self.optimal_actions = None
        self._state_cache = None
        self._done = False
        self._was_reset = True
        self._last_actions = None
        self.steps = 0

    def _expert_reasoning(self, actions: Sequence[str]) -> str:
        rest = len(self._plan_cache.get(self._solver_key()) or [])
        moves = ", ".join(actions)
        return f"The shortest solution takes {rest} more action(s); I will do {moves} now." if rest else f"I will do {moves}."

    # ----------------------------------------------------------- snapshots

    def _snapshot(self) -> Any:
        return {k: copy.copy(getattr(self, k)) for k in self._SNAP_ATTRS}

    def _restore(self, snap: Any) -> None:
        for k, v in snap.items():
            setattr(self, k, v)
        self._state_cache = None

    # ----------------------------------------------------------- prompt pieces

    def _state_format_hint(self) -> str:
        if self.state_format == "symbolic":
            return "Write the observation and the prediction as the grid of symbols, one row per line."
        if self.state_format == "structured":
            keys = ", ".join(f'"{k}"' for k in self.STRUCT_KEYS)
            return (f"Write the observation and the prediction as a JSON dictionary with keys {keys}; "
                    "positions are [row, column] counted from 0 at the top-left.")
        return {"vagen": self.VAGEN_NL_HINT, "local": self.LOCAL_NL_HINT}.get(self.relation_prompt, self.NL_HINT)

    def describe_state(self, state: Any) -> str:
        """As :meth:`VisualEnv.describe_state`; with ``relation_prompt="vagen"`` the sentences are only
        those relative to the player (what that prompt asks for and the ``vagen`` judge scores)."""
        if self.relation_prompt == "vagen" and self.state_format == "natural_language":
            rel = [r for r in state.get("relations") or [] if str(r).endswith(" the player")]
            state = {**state, "relations": rel}
        return super().describe_state(state)

    def _metrics(self) -> dict[str, float]:
        return {} if self.optimal_actions is None else {"optimal_actions": float(self.optimal_actions)}
