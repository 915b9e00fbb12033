"""ManiSkill/SAPIEN backend of the PrimitiveSkill env (``PrimitiveSkillEnv(backend="maniskill")``).

Renders the tabletop with SAPIEN, ManiSkill's simulator and renderer (lit, shadowed, the same
camera as the built-in renderer) instead of the numpy ray caster. The task state and the primitive
rules stay worldloop's (:mod:`worldloop.envs.primitive_skill.world`): VAGEN's motion-planned ManiSkill skills and its
task classes (``PlaceTwoCube``, ``StackThreeCube``, ``PutAppleInDrawer``, ``AlignTwoCube``) live in
VAGEN's repository, not in ManiSkill, so this adapter reproduces their scenes, not their controllers.

Needs ``pip install mani_skill`` (which brings ``sapien``) and a Vulkan-capable GPU driver for
SAPIEN's renderer; when either is missing the constructor raises RuntimeError saying so.

Public API::

    require_maniskill() -> module sapien
    ManiSkillRenderer(size)
        .render(tabletop) -> np.ndarray uint8 [size, size, 3]
"""

from __future__ import annotations

import math

import numpy as np


def require_maniskill():
    """Import mani_skill and sapien or raise RuntimeError with installation advice."""
    try:
        import mani_skill  # noqa: F401
        import sapien
    except ImportError as e:
        raise RuntimeError(
            "PrimitiveSkillEnv(backend='maniskill') needs ManiSkill, which is not installed "
            f"({e}). Install it with `pip install mani_skill` (SAPIEN comes with it; rendering needs a "
            "Vulkan-capable GPU driver), or use the default backend='builtin'."
        ) from None
    return sapien


def _look_at_quat(eye: np.ndarray, target: np.ndarray) -> list[float]:
    """SAPIEN camera orientation (x forward, y left, z up) as a wxyz quaternion."""
    f = target - eye
    f /= np.linalg.norm(f)
    left = np.cross([0.0, 0.0, 1.0], f)
    left /= max(np.linalg.norm(left), 1e-9)
    up = np.cross(f, left)
    m = np.stack([f, left, up], axis=1)
    w = math.sqrt(max(0.0, 1.0 + m[0, 0] + m[1, 1] + m[2, 2])) / 2.0
    x = math.copysign(math.sqrt(max(0.0, 1.0 + m[0, 0] - m[1, 1] - m[2, 2])) / 2.0, m[2, 1] - m[1, 2])
    y = math.copysign(math.sqrt(max(0.0, 1.0 - m[0, 0] + m[1, 1] - m[2, 2])) / 2.0, m[0, 2] - m[2, 0])
    z = math.copysign(math.sqrt(max(0.0, 1.0 - m[0, 0] - m[1, 1] + m[2, 2])) / 2.0, m[1, 0] - m[0, 1])
    return [w, x, y, z]


class ManiSkillRenderer:
    """A SAPIEN scene rebuilt from ``Tabletop.primitives()`` at every render (a few dozen actors)."""

    def __init__(self, size: int) -> None:
        self.sapien = require_maniskill()
        self.size = int(size)
        try:
            self.scene = self.sapien.Scene()
            self.scene.set_ambient_light([0.45, 0.45, 0.45])
            self.scene.add_directional_light([0.3, 0.4, -1.0], [0.8, 0.8, 0.8], shadow=True)
            self.camera = None
        except Exception as e:
            raise RuntimeError(
                f"ManiSkill is installed but SAPIEN cannot render here ({type(e).__name__}: {e}); it needs a "
                "Vulkan-capable GPU driver. Use backend='builtin' on machines without one."
            ) from None
        self._actors: list = []

    def _material(self, rgb):
        return self.sapien.render.RenderMaterial(base_color=[c / 255.0 for c in rgb] + [1.0])

    def render(self, tt) -> np.ndarray:
        sapien = self.sapien
        for a in self._actors:
            self.scene.remove_actor(a)
        self._actors = []
        table = self.scene.create_actor_builder()
        table.add_box_visual(half_size=[1.5, 1.5, 0.01], material=self._material((190, 160, 120)))
        actor = table.build_kinematic(name="table")
        actor.set_pose(sapien.Pose([0.0, 0.0, -0.01]))
        self._actors.append(actor)
        for i, p in enumerate(tt.primitives()):
            b = self.scene.create_actor_builder()
            if p[0] == "box":
                lo, hi = np.asarray(p[1]) / 1000.0, np.asarray(p[2]) / 1000.0
                b.add_box_visual(half_size=((hi - lo) / 2).tolist(), material=self._material(p[3]))
                center = ((hi + lo) / 2).tolist()
            elif p[0] == "sphere":
                b.add_sphere_visual(radius=p[2] / 1000.0, material=self._material(p[3]))
                center = (np.asarray(p[1]) / 1000.0).tolist()
            else:  # target: red and white rings, thin discs stacked slightly above the table
                for k, rgb in enumerate(((210, 40, 40), (245, 245, 245), (210, 40, 40), (245, 245, 245))):
                    r = p[2] / 1000.0 * (4 - k) / 4
                    b.add_cylinder_visual(radius=r, half_length=0.0005,
                                          pose=sapien.Pose([0, 0, 0.0005 + 0.0002 * k], [0.7071068, 0, 0.7071068, 0]),
                                          material=self._material(rgb))
                center = [p[1][0] / 1000.0, p[1][1] / 1000.0, 0.0]
            actor = b.build_kinematic(name=f"part{i}")
            actor.set_pose(sapien.Pose(center))
            self._actors.append(actor)
        eye, look, fov = tt.camera()
        e, t = np.asarray(eye, float) / 1000.0, np.asarray(look, float) / 1000.0
        if self.camera is None:
            self.camera = self.scene.add_camera("third_person", self.size, self.size, math.radians(fov), 0.01, 10.0)
        self.camera.set_local_pose(sapien.Pose(e.tolist(), _look_at_quat(e, t)))
        self.scene.update_render()
        self.camera.take_picture()
        rgba = np.asarray(self.camera.get_picture("Color"))
        return np.clip(rgba[..., :3] * 255.0, 0, 255).astype(np.uint8)
