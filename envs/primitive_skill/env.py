"""PrimitiveSkill (VAGEN App. A.4 Tables 12/13/19, App. B.2 prompt, App. C.2 structured state):
``worldloop/PrimitiveSkill-v0``.

A Panda-like arm on a tabletop, commanded with ``pick(x, y, z)``, ``place(x, y, z)`` and
``push(x1, y1, z1, x2, y2, z2)`` in millimetres, up to 2 per turn separated by ``|``. The tasks
(``task`` kwarg) are VAGEN's: ``place`` (red cube on the left target, green cube on the right one),
``stack`` (red on green, purple on red), ``drawer`` (apple into the drawer, then close it) and
``align`` (both cubes at x = 0 +- 10 mm). The rules (workspace reach, grasping, support, collisions,
drawer) and stages are documented in :mod:`worldloop.envs.primitive_skill.world`; a primitive whose coordinates are
wrong fails, changes nothing and says why in the next observation.

Knobs: ``task`` (default "place"), ``max_actions_per_step`` (2), ``max_steps`` (10 executed
primitives), ``image_size`` (256), ``named_positions`` (False: in vision mode the prompt lists the
object positions as an unnamed list in a per-episode random order, as the paper's prompt, so the
agent must match them to the image; True, and always in text mode: ``{name: (x, y, z)}``),
``backend`` ("builtin" numpy renderer | "maniskill" SAPIEN renderer, :mod:`worldloop.envs.adapters.maniskill`),
plus the common kwargs of :class:`worldloop.envs.base.VisualEnv`. ``state_format``: "natural_language" or
"structured" (the paper uses structured for this task; the presets do too).

Rewards per executed primitive (Table 19): a stage reward when the highest stage reached so far in
the episode rises from p to k: 2(k - p), so an episode that reaches stage s has collected
(s + 1) x 2 in stage rewards (VAGEN's ``compute_reward``); +10 when the primitive completes the task
(the episode ends), else -0.1; +0.5 format reward per well-formed turn (see envs/base.py). An answer
with a malformed primitive (unknown name, wrong number of arguments, not numbers) rejects the turn
like any format error.

State: ``structured`` is the App. C.2 position dict ``{"red_cube": [x, y, z], ..., "left_target":
[x, y, 0]}`` (integers, mm; the drawer task adds ``drawer``, ``drawer_handle`` and
``drawer_open_value``); ``relations`` are sentences such as ``"red_cube is at (62, -55, 20)"``,
``"the gripper is holding red_cube"``, ``"red_cube is in left_target"``, ``"red_cube is on top of
green_cube"``, ``"the drawer is open by 263 mm"``; ``symbolic`` is None. ``info["task"]`` is the
task name; ``info["metrics"]``: ``stage`` (highest stage reached, -1 none), ``stages`` (number of
non-final stages).
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import numpy as np

from worldloop.envs.base import ActionResult, VisualEnv
from worldloop.envs.parsing import ActionParse
from worldloop.envs.primitive_skill.tasks import INSTRUCTIONS, TASKS, WORKSPACES, Action, format_action, parse_action
from worldloop.envs.primitive_skill.world import Tabletop

BACKENDS = ("builtin", "maniskill")
_SPLIT_RE = re.compile(r"[|;\n]")


class PrimitiveSkillEnv(VisualEnv):
    ACTIONS: tuple[str, ...] = ()
    ACTION_SEP = "|"
    STATE_FORMATS_SUPPORTED = ("natural_language", "structured")
    DEFAULT_MAX_ACTIONS_PER_STEP = 2
    DEFAULT_MAX_STEPS = 10
    DEFAULT_IMAGE_SIZE = 256

    def __init__(self, *, task: str = "place", named_positions: bool = False, backend: str = "builtin",
                 **common: Any) -> None:
        if task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {task!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if not isinstance(named_positions, bool):
            raise ValueError(f"named_positions must be a bool, got {named_positions!r}")
        super().__init__(**common)
        self.task = task
        self.named_positions = named_positions or not self.vision
        self.backend = backend
        self.tt: Tabletop | None = None
        self.best_stage = -1
        self._order: list[str] = []
        self._feedback: list[str] = []
        self._renderer = None
        if backend == "maniskill":
            from worldloop.envs.adapters.maniskill import ManiSkillRenderer

            self._renderer = ManiSkillRenderer(self.image_size)

    # ------------------------------------------------------------------ episode

    def _generate(self, rng: np.random.Generator, options: dict | None) -> None:
        self.tt = Tabletop.generate(self.task, rng)
        names = list(self.tt.positions())
        self._order = [names[int(i)] for i in rng.permutation(len(names))]
        self.best_stage = -1
        self._feedback = []

    def _parse_actions(self, answer: str) -> ActionParse:
        items = [s.strip() for s in _SPLIT_RE.split(answer or "")]
        items = [s for s in items if s]
        if not items:
            return ActionParse(reason="no action in the answer")
        kept, dropped = items[: self.max_actions_per_step], max(0, len(items) - self.max_actions_per_step)
        values, unknown = [], []
        for item in kept:
            a = parse_action(item)
            if a is None:
                unknown.append(item[:80])
            else:
                values.append(a)
        if unknown:
            return ActionParse([format_action(v) for v in values], None, unknown, dropped,
                               f"not a primitive: {unknown[0]!r} (use pick(x,y,z), place(x,y,z), "
                               "push(x1,y1,z1,x2,y2,z2))")
        return ActionParse([format_action(v) for v in values], values, [], dropped, "")

    def _apply_action(self, value) -> ActionResult:
        ok, changed, msg = self.tt.execute(value)
        self._feedback.append(msg)
        reward = 0.0
        stage = self.tt.stage()
        if stage > self.best_stage:
            reward = 2.0 * (stage - self.best_stage)
            self.best_stage = stage
        return ActionResult(changed, reward)

    def step(self, response: Any):
        self._feedback = []
        return super().step(response)

    def _is_success(self) -> bool:
        return bool(self.tt.success())

    def _get_state(self) -> dict:
        return {"relations": self.tt.relations(), "symbolic": None, "structured": self.tt.structured()}

    def _metrics(self) -> dict[str, float]:
        return {"stage": float(self.best_stage), "stages": float(self.tt.n_stages())}

    def _snapshot(self) -> Any:
        return (self.tt.copy(), self.best_stage, list(self._feedback))

    def _restore(self, snap: Any) -> None:
        tt, self.best_stage, fb = snap
        self.tt, self._feedback = tt.copy(), list(fb)
        self._state_cache = None

    # ------------------------------------------------------------------ observations

    def _render_image(self) -> np.ndarray:
        if self._renderer is not None:
            return self._renderer.render(self.tt)
        return self.tt.render(self.image_size)

    def _positions_text(self) -> str:
        pos = self.tt.positions()
        if self.named_positions:
            return "{" + ", ".join(f"'{n}': ({', '.join(str(v) for v in pos[n])})" for n in pos) + "}"
        return "[" + ", ".join(f"({', '.join(str(v) for v in pos[n])})" for n in self._order) + "]"

    def _render_text(self) -> str:
        return self.describe_state(self._current_state())

    def _turn_context(self) -> str:
        (x0, x1), (y0, y1), (z0, z1) = WORKSPACES[self.task]
        other = self.tt.other_info()
        lines = []
        if self._feedback:
            lines.append("Env_feedback: " + " ".join(self._feedback))
        lines += [f"Human Instruction: {INSTRUCTIONS[self.task]}",
                  f"x_workspace_limit: ({x0}, {x1})", f"y_workspace_limit: ({y0}, {y1})",
                  f"z_workspace_limit: ({z0}, {z1})", "Object positions:", self._positions_text(),
                  "Other information:", str(other) if other else "No other information needed"]
        return "\n".join(lines)

    # ------------------------------------------------------------------ expert

    def _expert_actions(self) -> list[str]:
        if self._is_terminal():
            return []
        actions = self.tt.expert_actions(self.max_actions_per_step)
        if not actions:  # no way forward from here (e.g. the drawer was closed too early): still answer
            name, pos = next(iter(self.tt.positions().items()))
            actions = [format_action(Action("pick", tuple(float(v) for v in pos)))]
        return actions

    def _expert_reasoning(self, actions: Sequence[str]) -> str:
        return (f"To {INSTRUCTIONS[self.task][len('Please '):].rstrip('.').lower()}, I use the true object "
                f"positions: {' then '.join(actions)}. When placing I keep z at the resting height or above.")

    # ------------------------------------------------------------------ prompts

    def _system_intro(self) -> str:
        return (
            "You are an AI assistant controlling a Franka Emika robot arm. Your goal is to understand human "
            "instructions and translate them into a sequence of executable actions for the robot, based on "
            "visual input and the instruction.\n"
            "Action Space Guide\n"
            "You can command the robot using the following actions:\n"
            "1. pick(x, y, z) # To grasp an object located at position(x,y,z) in the robot's workspace.\n"
            "2. place(x, y, z) # To place the object currently held by the robot's gripper at the target "
            "position (x,y,z).\n"
            "3. push(x1, y1, z1, x2, y2, z2) # To push an object from position (x1,y1,z1) to (x2,y2,z2).\n"
            "Hints:\n"
            "1. The coordinates (x, y, z) are in millimeters and are all integers.\n"
            "2. Please ensure that the coordinates are within the workspace limits.\n"
            "3. The position is the center of the object, when you place, please consider the volume of the "
            "object. It's always fine to set z much higher when placing an item.\n"
            "4. We will provide the object positions to you, but you need to match them to the object in the "
            "image by yourself. You're facing toward the negative x-axis, and the negative y-axis is to your "
            "left, the positive y-axis is to your right, and the positive z-axis is up.\n"
            "Actions you can take: pick(x, y, z), place(x, y, z), push(x1, y1, z1, x2, y2, z2)."
        )

    def _action_line(self) -> str:
        return f"You can take up to {self.max_actions_per_step} action(s) at a time, separated by |."

    def _state_format_hint(self) -> str:
        if self.state_format == "structured":
            return ("Write the observation and the prediction as a dictionary of object positions in millimeters, "
                    "e.g. {'red_cube': (100, 100, 40), 'green_cube': (200, 200, 60)}.")
        return "Describe the objects with their positions (x, y, z) in millimeters and what the gripper holds."

    def _example_fields(self) -> dict[str, str]:
        if self.state_format == "structured":
            obs = "{'red_cube': (100, 100, 40), 'green_cube': (80, 100, 20)}"
            pred = "{'red_cube': (80, 100, 60), 'green_cube': (80, 100, 20)}"
        else:
            obs = "The red cube is on the left at (100,100,40), the green cube is on the right at (80,100,20)."
            pred = "After executing this action, the red cube will be at (80,100,60), on top of the green cube."
        return {"observation": obs, "prediction": pred,
                "reasoning": "I need to pick the red cube at (100,100,40) and place it on the green cube at (80,100,20).",
                "think": "I need to pick the red cube at (100,100,40) and place it at (80,100,60).",
                "answer": "pick(100,100,40)|place(80,100,60)"}
