"""AI2-THOR backend of the Navigation env (``NavigationEnv(backend="ai2thor")``).

Runs the same task as the built-in world in AI2-THOR's iTHOR scenes: the episode's scene is drawn
from ``scenes`` (default: the 120 iTHOR floor plans), the target is an object type that occurs once
in the scene (a catalog type when there is one), the start is a reachable position that is
``min_plan``..``max_plan`` expert actions from success. Actions map to THOR's MoveAhead/MoveBack/
MoveRight/MoveLeft (``moveMagnitude=step_length``), RotateRight/RotateLeft (90 degrees) and
LookUp/LookDown (30 degrees); ground truth follows VAGEN's ``get_env_state`` (objects THOR marks
visible, bearing buckets, 2-D distances).

Needs ``pip install ai2thor`` (the Unity build, ~0.5 GB, is downloaded on first use) and a renderer:
an X server (``DISPLAY``) or ``thor_options={"platform": "CloudRendering"}`` on a machine with a
Vulkan-capable GPU. When either is missing the constructor raises RuntimeError saying so.

Public API::

    ThorNavigation(*, fov, size, step_length, success_threshold, scenes=None, platform=None,
                   gpu_device=None, visibility_distance=10.0, min_plan=3, max_plan=12)
        .new_episode(rng, split) -> ThorWorld     # the world interface of worldloop.envs.navigation.world.World
        .close()
"""

from __future__ import annotations

import math
import os

import numpy as np

from worldloop.envs.navigation.catalog import CATALOG, base_instruction, type_label
from worldloop.envs.navigation.world import HORIZONS, SPLITS, direction_word, plan_path, relations_from_gt

_ACTIONS = {"moveahead": "MoveAhead", "moveback": "MoveBack", "moveright": "MoveRight",
            "moveleft": "MoveLeft", "rotateright": "RotateRight", "rotateleft": "RotateLeft",
            "lookup": "LookUp", "lookdown": "LookDown"}
DEFAULT_SCENES = tuple(f"FloorPlan{i}" for r in (0, 200, 300, 400) for i in range(r + 1, r + 31))


def require_ai2thor():
    """Import ai2thor.controller or raise RuntimeError with installation advice."""
    try:
        import ai2thor.controller as controller  # noqa: F401
    except ImportError as e:
        raise RuntimeError(
            "NavigationEnv(backend='ai2thor') needs the ai2thor package, which is not installed "
            f"({e}). Install it with `pip install ai2thor` and provide a renderer (an X display via "
            "DISPLAY, or platform='CloudRendering' on a Vulkan GPU), or use the default backend='builtin'."
        ) from None
    return controller


class ThorNavigation:
    def __init__(self, *, fov: float, size: int, step_length: float, success_threshold: float,
                 scenes=None, platform: str | None = None, gpu_device: int | None = None,
                 visibility_distance: float = 10.0, min_plan: int = 3, max_plan: int = 12) -> None:
        controller_mod = require_ai2thor()
        kwargs = dict(agentMode="default", gridSize=step_length, visibilityDistance=visibility_distance,
                      renderDepthImage=False, renderInstanceSegmentation=False, width=int(size),
                      height=int(size), fieldOfView=float(fov))
        if platform == "CloudRendering":
            from ai2thor.platform import CloudRendering

            kwargs["platform"] = CloudRendering
            if gpu_device is not None:
                kwargs["gpu_device"] = int(gpu_device)
        elif platform is not None:
            raise ValueError(f"thor_options platform must be None or 'CloudRendering', got {platform!r}")
        elif not os.environ.get("DISPLAY"):
            raise RuntimeError(
                "ai2thor is installed but no renderer is available: DISPLAY is not set. Start an X server "
                "(e.g. `Xvfb :0 &` then DISPLAY=:0) or pass thor_options={'platform': 'CloudRendering'} on a "
                "machine with a Vulkan-capable GPU; the default backend='builtin' needs neither."
            )
        try:
            self.controller = controller_mod.Controller(**kwargs)
        except Exception as e:
            raise RuntimeError(f"ai2thor could not start its renderer: {type(e).__name__}: {e}") from None
        self.scenes = tuple(scenes) if scenes else DEFAULT_SCENES
        self.step_length = float(step_length)
        self.success_threshold = float(success_threshold)
        self.fov = float(fov)
        self.size = int(size)
        self.min_plan, self.max_plan = int(min_plan), int(max_plan)

    def close(self) -> None:
        try:
            self.controller.stop()
        except Exception:  # pragma: no cover - already stopped
            pass

    def new_episode(self, rng: np.random.Generator, split: str) -> "ThorWorld":
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        for _ in range(50):
            scene = self.scenes[int(rng.integers(len(self.scenes)))]
            self.controller.reset(scene=scene)
            event = self.controller.step(action="GetReachablePositions")
            reach = [(round(p["x"], 3), round(p["z"], 3)) for p in event.metadata["actionReturn"] or []]
            objects = event.metadata["objects"]
            counts: dict[str, int] = {}
            for o in objects:
                counts[o["objectType"]] = counts.get(o["objectType"], 0) + 1
            unique = [o for o in objects if counts[o["objectType"]] == 1]
            known = [o for o in unique if o["objectType"] in CATALOG and CATALOG[o["objectType"]].target]
            pool = known or unique
            if not pool or not reach:
                continue
            target = pool[int(rng.integers(len(pool)))]
            spec = CATALOG.get(target["objectType"])
            if split == "common_sense" and spec is not None and spec.common_sense:
                instruction = spec.common_sense[int(rng.integers(len(spec.common_sense)))]
            else:
                instruction = base_instruction(type_label(target["objectType"]))
            world = ThorWorld(self, scene, target, instruction, reach)
            for i in rng.permutation(len(reach))[:40]:
                x, z = reach[int(i)]
                world.set_pose((x, z, int(rng.integers(4)) * 90, 0))
                if world.distance_to_target() <= self.success_threshold + 0.5:
                    continue
                plan = world.plan(self.max_plan)
                if plan is not None and self.min_plan <= len(plan) <= self.max_plan:
                    return world
        raise RuntimeError("could not sample an AI2-THOR navigation episode from the given scenes")


class ThorWorld:
    """One AI2-THOR episode with the world interface of :class:`worldloop.envs.navigation.world.World`."""

    def __init__(self, owner: ThorNavigation, scene: str, target: dict, instruction: str, reachable):
        self.owner = owner
        self.scene = scene
        self.target = target
        self.target_pos = (float(target["position"]["x"]), float(target["position"]["z"]))
        self.instruction = instruction
        self.room_type = "room"
        self.reachable = list(reachable)

    @property
    def _c(self):
        return self.owner.controller

    def _agent(self) -> dict:
        return self._c.last_event.metadata["agent"]

    def pose(self):
        a = self._agent()
        return (a["position"]["x"], a["position"]["z"], int(round(a["rotation"]["y"])) % 360,
                int(round(a["cameraHorizon"])))

    def set_pose(self, pose) -> None:
        x, z, heading, horizon = pose
        y = self._agent()["position"]["y"]
        self._c.step(action="Teleport", position={"x": x, "y": y, "z": z}, rotation={"x": 0, "y": heading, "z": 0},
                     horizon=horizon, standing=True)

    def step(self, action: str) -> bool:
        before = self.pose()
        kw = {}
        if action.startswith("move"):
            kw["moveMagnitude"] = self.owner.step_length
        elif action.startswith("rotate"):
            kw["degrees"] = 90
        else:
            kw["degrees"] = 30
            i = HORIZONS.index(min(HORIZONS, key=lambda h: abs(h - before[3])))
            if not 0 <= i + (-1 if action == "lookup" else 1) < len(HORIZONS):
                return False
        event = self._c.step(action=_ACTIONS[action], **kw)
        return bool(event.metadata.get("lastActionSuccess")) and self.pose() != before

    def distance_to_target(self) -> float:
        x, z, _, _ = self.pose()
        return math.hypot(self.target_pos[0] - x, self.target_pos[1] - z)

    def success(self) -> bool:
        return self.distance_to_target() <= self.owner.success_threshold + 1e-9

    def render_rgb(self, size: int, fov: float) -> np.ndarray:
        frame = np.asarray(self._c.last_event.frame, dtype=np.uint8)
        if frame.shape[0] != size or frame.shape[1] != size:
            from PIL import Image

            frame = np.asarray(Image.fromarray(frame).resize((size, size), Image.BILINEAR))
        return frame

    def ground_truth(self, max_objects: int = 8, fov: float = 100.0) -> dict:
        x, z, heading, _ = self.pose()
        objs = []
        target_visible = False
        for o in self._c.last_event.metadata["objects"]:
            if not o.get("visible"):
                continue
            ox, oz = o["position"]["x"], o["position"]["z"]
            objs.append({"type": o["objectType"], "direction_to_player": direction_word(ox - x, oz - z, heading),
                         "distance_to_player": round(math.hypot(ox - x, oz - z), 2)})
            target_visible |= o["objectId"] == self.target["objectId"]
        objs.sort(key=lambda e: (e["distance_to_player"], e["type"]))
        tx, tz = self.target_pos
        return {"target_obj_type": self.target["objectType"],
                "target_distance_to_player": round(self.distance_to_target(), 2),
                "target_direction_to_player": direction_word(tx - x, tz - z, heading),
                "target_visible": target_visible, "visible_objects": objs[:max_objects]}

    def relations(self, gt: dict) -> list[str]:
        return relations_from_gt(gt)

    def plan(self, max_len: int = 60) -> list[str] | None:
        # plan in coordinates relative to the agent: THOR's grid need not be aligned with the origin
        x, z, heading, _ = self.pose()
        s = self.owner.step_length
        cells = {(round((px - x) / s), round((pz - z) / s)) for px, pz in self.reachable}
        cells.add((0, 0))
        return plan_path((0.0, 0.0), heading, s, lambda px, pz: (round(px / s), round(pz / s)) in cells,
                         (self.target_pos[0] - x, self.target_pos[1] - z), self.owner.success_threshold, max_len)
