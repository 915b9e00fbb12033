"""Navigation (VAGEN App. A.4, Tables 10/11/18; App. B.2 prompt; App. D.1 state): ``worldloop/Navigation-v0``.

The agent sees a first-person view of an indoor room and must get within ``success_threshold``
metres of the object named (``split="base"``) or described by its use (``split="common_sense"``)
in the instruction. The default backend is the self-contained world of :mod:`worldloop.envs.navigation.world`
(numpy ray casting; rooms with walls, an optional partition and typed furniture); ``backend="ai2thor"``
runs the same task in AI2-THOR through :mod:`worldloop.envs.adapters.ai2thor` when it is installed and can render.

Knobs: ``split`` ("base" | "common_sense"), ``fov`` (100 degrees), ``step_length`` (0.25 m),
``success_threshold`` (1.0 m, distance from the agent to the target's centre on the floor plane),
``resolution`` (Table 11's name for ``image_size``; default 255), ``max_actions_per_step`` (5),
``max_steps`` (30 executed actions), ``max_objects_in_state`` (8), ``min_plan``/``max_plan``
(3/12: the start is this many expert actions away from success), ``backend`` ("builtin" | "ai2thor"),
``thor_options`` (dict passed to the adapter), plus the common kwargs of :class:`worldloop.envs.base.VisualEnv`.

Actions (Table 10): ``moveahead, moveback, moveright, moveleft, rotateright, rotateleft, lookup,
lookdown`` (aliases such as ``move ahead``, ``move forward``, ``turn left`` and the paper's typo
``movelleft``). A move that would hit a wall or furniture does nothing ("Last action is not executed
successfully"); lookup/lookdown beyond AI2-THOR's horizon range (-30..60 degrees) do nothing.

Rewards per executed action (Table 18): +10 when it brings the agent within the threshold (the
episode ends), else -0.1; +0.5 format reward per well-formed turn (see envs/base.py).

State (App. D.1): ``structured`` is the navigation dict ``{"target_obj_type", "target_distance_to_player",
"target_direction_to_player", "target_visible", "visible_objects": [{"type", "direction_to_player",
"distance_to_player"}]}`` (directions ahead/left/right/back by the relative bearing buckets of VAGEN's
env: |angle| <= 45 ahead, 45..135 right, -135..-45 left, else back; distances in metres, 2 decimals;
visible objects: at least 4 pixels in a 96 px render, nearest first). ``relations`` are sentences:
``"the target toaster is ahead of the player, 2.59 m away"``, ``"the target toaster is visible in the
view"``, ``"the countertop is on the left of the player, 0.94 m away"`` (entities: ``the player``,
``the target <label>``, ``the <label>`` of each visible object). ``symbolic`` is None (not supported).
Natural-language observations (expert, examples) are first person: "The toaster is ahead of me,
about 2.6 m away. I can also see a countertop on my left (0.9 m)."

``info["task"]`` is the split; ``info["metrics"]``: ``distance_to_target``, ``optimal_actions``
(expert plan length at reset).
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np

from worldloop.envs.base import ActionResult, VisualEnv, check_int
from worldloop.envs.navigation.catalog import type_label
from worldloop.envs.navigation.world import ACTION_DESCRIPTIONS, ACTIONS, SPLITS, World

BACKENDS = ("builtin", "ai2thor")

_ALIASES = {
    "move ahead": "moveahead", "move forward": "moveahead", "forward": "moveahead", "ahead": "moveahead",
    "move back": "moveback", "move backward": "moveback", "backward": "moveback",
    "move right": "moveright", "strafe right": "moveright", "move left": "moveleft",
    "strafe left": "moveleft", "movelleft": "moveleft", "moverightt": "moveright",
    "rotate right": "rotateright", "turn right": "rotateright", "rotate left": "rotateleft",
    "turn left": "rotateleft", "look up": "lookup", "tilt up": "lookup", "look down": "lookdown",
    "tilt down": "lookdown",
}
_WHERE = {"ahead": "ahead of me", "left": "on my left", "right": "on my right", "back": "behind me"}


def describe_gt(gt: dict) -> str:
    """First-person sentences of an App. D.1 navigation dict (what an agent should say)."""
    label = type_label(gt["target_obj_type"])
    dist = gt["target_distance_to_player"]
    where = _WHERE[gt["target_direction_to_player"]]
    if gt.get("target_visible"):
        s = f"The {label} is {where}, about {dist:.1f} m away."
    else:
        s = f"I cannot see the {label} in my view; it is {where}, about {dist:.1f} m away."
    others = [e for e in gt.get("visible_objects", []) if e["type"] != gt["target_obj_type"]][:4]
    if others:
        s += " I can also see " + ", ".join(
            f"a {type_label(e['type'])} {_WHERE[e['direction_to_player']]} ({e['distance_to_player']:.1f} m)"
            for e in others) + "."
    return s


class NavigationEnv(VisualEnv):
    ACTIONS = ACTIONS
    ACTION_ALIASES = _ALIASES
    ACTION_SEP = ","
    STATE_FORMATS_SUPPORTED = ("natural_language", "structured")
    DEFAULT_MAX_ACTIONS_PER_STEP = 5
    DEFAULT_MAX_STEPS = 30
    DEFAULT_IMAGE_SIZE = 255

    def __init__(self, *, split: str = "base", fov: float = 100.0, step_length: float = 0.25,
                 success_threshold: float = 1.0, resolution: int | None = None,
                 image_size: int | None = None, max_objects_in_state: int = 8, min_plan: int = 3,
                 max_plan: int = 12, backend: str = "builtin", thor_options: dict | None = None,
                 **common: Any) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if resolution is not None and image_size is not None and resolution != image_size:
            raise ValueError(f"resolution={resolution!r} and image_size={image_size!r} disagree; give one")
        for name, value, lo, hi in (("fov", fov, 10.0, 170.0), ("step_length", step_length, 0.05, 2.0),
                                    ("success_threshold", success_threshold, 0.1, 10.0)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
                raise ValueError(f"{name} must be a number in [{lo}, {hi}], got {value!r}")
        super().__init__(image_size=image_size if image_size is not None else resolution, **common)
        self.split = split
        self.fov = float(fov)
        self.step_length = float(step_length)
        self.success_threshold = float(success_threshold)
        self.max_objects_in_state = check_int("max_objects_in_state", max_objects_in_state, 0, 100)
        self.min_plan = check_int("min_plan", min_plan, 0, 60)
        self.max_plan = check_int("max_plan", max_plan, max(1, self.min_plan), 60)
        self.backend = backend
        self.task = split
        self.world: Any = None
        self.optimal_actions: int | None = None
        self._feedback = ""
        self._thor = None
        if backend == "ai2thor":
            from worldloop.envs.adapters.ai2thor import ThorNavigation

            self._thor = ThorNavigation(fov=self.fov, size=self.image_size, step_length=self.step_length,
                                        success_threshold=self.success_threshold, min_plan=self.min_plan,
                                        max_plan=self.max_plan, **(thor_options or {}))

    # ------------------------------------------------------------------ episode

    def _generate(self, rng: np.random.Generator, options: dict | None) -> None:
        if self._thor is not None:
            self.world = self._thor.new_episode(rng, self.split)
        else:
            self.world = World.generate(rng, self.split, step_length=self.step_length,
                                        success_threshold=self.success_threshold,
                                        min_plan=self.min_plan, max_plan=self.max_plan)
        plan = getattr(self.world, "initial_plan", None) or self.world.plan(max_len=60)
        self.optimal_actions = None if plan is None else len(plan)
        self._feedback = ""

    def _apply_action(self, value: str) -> ActionResult:
        changed = bool(self.world.step(value))
        self._feedback = ("Last action is executed successfully." if changed
                          else "Last action is not executed successfully.")
        return ActionResult(changed)

    def _is_success(self) -> bool:
        return bool(self.world.success())

    def _get_state(self) -> dict:
        gt = self.world.ground_truth(self.max_objects_in_state, self.fov)
        return {"relations": self.world.relations(gt), "symbolic": None, "structured": gt}

    def _metrics(self) -> dict[str, float]:
        out = {"distance_to_target": round(float(self.world.distance_to_target()), 3)}
        if self.optimal_actions is not None:
            out["optimal_actions"] = float(self.optimal_actions)
        return out

    def _snapshot(self) -> Any:
        return (self.world.pose(), self._feedback)

    def _restore(self, snap: Any) -> None:
        pose, self._feedback = snap
        self.world.set_pose(pose)
        self._state_cache = None

    def close(self) -> None:
        if self._thor is not None:
            self._thor.close()
            self._thor = None
        super().close()

    # ------------------------------------------------------------------ observations

    def _render_image(self) -> np.ndarray:
        return self.world.render_rgb(self.image_size, self.fov)

    def _render_text(self) -> str:
        gt = self._current_state()["structured"]
        seen = [e for e in gt["visible_objects"]]
        head = f"You are in a {self.world.room_type}."
        if not seen:
            return head + " You see only walls and floor."
        items = ", ".join(f"a {type_label(e['type'])} {_WHERE[e['direction_to_player']]} "
                          f"({e['distance_to_player']:.1f} m)" for e in seen)
        return f"{head} In your view: {items}."

    def _turn_context(self) -> str:
        lines = []
        if self._feedback:
            lines.append(f"Env_feedback: {self._feedback}")
        lines.append(f"Human Instruction: {self.world.instruction}")
        return "\n".join(lines)

    def describe_state(self, state) -> str:
        if self.state_format == "natural_language":
            return describe_gt(state["structured"])
        return super().describe_state(state)

    # ------------------------------------------------------------------ expert

    def _expert_actions(self) -> list[str]:
        if self._is_terminal():
            return []
        plan = self.world.plan(max_len=60) or []
        return plan[: self.max_actions_per_step]

    def _expert_reasoning(self, actions: Sequence[str]) -> str:
        gt = self._current_state()["structured"]
        label = type_label(gt["target_obj_type"])
        where = _WHERE[gt["target_direction_to_player"]]
        return (f"The {label} is {where}, {gt['target_distance_to_player']:.1f} m away; "
                f"to get close to it while avoiding obstacles I will {', '.join(actions)}.")

    # ------------------------------------------------------------------ prompts

    def _system_intro(self) -> str:
        acts = "\n".join(f"{a}: {ACTION_DESCRIPTIONS[a]}" for a in ACTIONS)
        return (
            "You are a home robot and perform navigation tasks according to instructions.\n"
            f"Actions you can take: {', '.join(ACTIONS)}.\n{acts}\n"
            "Rewards:\nFormat correct: +0.5\nAchieve the human instruction: +10.0\n"
            "The instruction will be provided with each observation. Look at the image carefully and navigate "
            "to complete the instruction.\n"
            "Hints:\n"
            "1. You can take multiple actions at a time, in most cases, if you find the target object is far away "
            "from you, you can call moveahead, moveleft and moveright multiple times.\n"
            "2. If you find yourself seems to be stuck, you can lookdown to see if there's any object above or "
            "below you, you can also rotate to see if there's any object behind you."
        )

    def _state_format_hint(self) -> str:
        if self.state_format == "structured":
            return ('Write the observation and the prediction as a JSON dictionary with keys "target_obj_type", '
                    '"target_distance_to_player", "target_direction_to_player" (ahead, left, right or back), '
                    '"target_visible" and "visible_objects" (a list of {"type", "direction_to_player", '
                    '"distance_to_player"}).')
        return ("Both the observation and prediction should describe what you see or expect to see in the "
                "environment: where the target object is relative to you (ahead, left, right or behind) and "
                "how far away it is.")

    def _example_fields(self) -> dict[str, str]:
        before = {"target_obj_type": "DeskLamp", "target_distance_to_player": 2.4,
                  "target_direction_to_player": "right", "target_visible": True,
                  "visible_objects": [{"type": "DeskLamp", "direction_to_player": "right", "distance_to_player": 2.4},
                                      {"type": "Bed", "direction_to_player": "left", "distance_to_player": 1.6}]}
        after = dict(before, target_distance_to_player=0.9, target_direction_to_player="ahead",
                     visible_objects=[{"type": "DeskLamp", "direction_to_player": "ahead", "distance_to_player": 0.9}])
        if self.state_format == "structured":
            obs, pred = json.dumps(before), json.dumps(after)
        else:
            obs, pred = describe_gt(before), describe_gt(after)
        return {"observation": obs, "prediction": pred,
                "reasoning": "I need to move toward the desk lamp. I'll turn right and move forward.",
                "think": "The desk lamp is on my right, so I turn right and walk towards it.",
                "answer": "rotateright,moveahead,moveahead"}
