"""How the PrimitiveSkill tabletop looks: its drawable parts, the camera, and the ray-cast view.

Public API (``tt`` is a :class:`worldloop.envs.primitive_skill.world.Tabletop`, which offers these as
``tt.primitives()``, ``tt.camera()`` and ``tt.render(size)``)::

    primitives(tt) -> list[tuple]    # ("box", lo, hi, rgb) / ("sphere", centre, radius, rgb) /
                                     # ("target", (x, y), radius), robot millimetres, any renderer
    camera(tt) -> (eye, look_at, fov)
    render(tt, size) -> np.ndarray   # uint8 (size, size, 3), numpy ray caster

The SAPIEN renderer (:mod:`worldloop.envs.adapters.maniskill`) draws the same primitives from the
same camera.
"""

from __future__ import annotations

import math

import numpy as np

from worldloop.envs.navigation.raycast import Scene
from worldloop.envs.primitive_skill.tasks import (APPLE_R, CAB_BACK_Y, CAB_FRONT_Y, CAB_TOP, CAB_X, COLORS, CUBE_HALF,
                                                  DRAWER_FLOOR, DRAWER_PANEL, DRAWER_TOP, DRAWER_X, TARGET_R)


def primitives(tt) -> list[tuple]:
    """The scene as drawable parts in robot millimetres, for any renderer.

    ``("box", lo, hi, rgb)``, ``("sphere", centre, radius, rgb)`` and ``("target", (x, y), radius)``
    (a red/white bull's-eye on the table); the robot base, the objects, the cabinet and drawer,
    and the gripper (palm, wrist and two fingers, closed when holding) where it last acted.
    """
    out: list[tuple] = [("target", xy, TARGET_R) for xy in tt.targets.values()]
    base = (-560, -60, 0), (-440, 60, 120)
    if tt.task != "drawer":
        base = (-680, -60, 0), (-560, 60, 120)
    out.append(("box", base[0], base[1], (235, 235, 235)))
    for name, b in tt.bodies.items():
        x, y, z = b.pos
        if b.kind == "cube":
            out.append(("box", (x - CUBE_HALF, y - CUBE_HALF, z - CUBE_HALF),
                        (x + CUBE_HALF, y + CUBE_HALF, z + CUBE_HALF), COLORS[name]))
        else:
            out.append(("sphere", (x, y, z), APPLE_R, COLORS[name]))
            out.append(("box", (x - 3, y - 3, z + APPLE_R - 4), (x + 3, y + 3, z + APPLE_R + 12), (90, 60, 30)))
    if tt.task == "drawer":
        o = tt.drawer_open
        wood, dark = (150, 110, 75), (110, 80, 55)
        # cabinet shell around the drawer slot
        out += [("box", (CAB_X[0], CAB_BACK_Y, 0), (CAB_X[1], CAB_FRONT_Y, DRAWER_FLOOR - 10), wood),
                ("box", (CAB_X[0], CAB_BACK_Y, DRAWER_TOP + 10), (CAB_X[1], CAB_FRONT_Y, CAB_TOP), wood),
                ("box", (CAB_X[0], CAB_BACK_Y, DRAWER_FLOOR - 10), (DRAWER_X[0] - 2, CAB_FRONT_Y, DRAWER_TOP + 10),
                 wood),
                ("box", (DRAWER_X[1] + 2, CAB_BACK_Y, DRAWER_FLOOR - 10), (CAB_X[1], CAB_FRONT_Y, DRAWER_TOP + 10),
                 wood)]
        front = CAB_FRONT_Y + o
        if o > DRAWER_PANEL:
            out += [("box", (DRAWER_X[0], CAB_FRONT_Y, DRAWER_FLOOR - 8),
                     (DRAWER_X[1], front - DRAWER_PANEL, DRAWER_FLOOR), (225, 215, 195)),
                    ("box", (DRAWER_X[0], CAB_FRONT_Y, DRAWER_FLOOR), (DRAWER_X[0] + 8, front, DRAWER_TOP - 20), dark),
                    ("box", (DRAWER_X[1] - 8, CAB_FRONT_Y, DRAWER_FLOOR), (DRAWER_X[1], front, DRAWER_TOP - 20), dark)]
        out.append(("box", (DRAWER_X[0], max(front - DRAWER_PANEL, CAB_FRONT_Y - 1), DRAWER_FLOOR - 8),
                    (DRAWER_X[1], front + 1, DRAWER_TOP), (170, 125, 85)))
        hx, hy, hz = tt.handle_pos()
        out.append(("box", (hx - 50, front, hz - 8), (hx + 50, hy + 6, hz + 8), (60, 60, 65)))
    gx, gy, gz = tt.gripper
    grey = (70, 70, 80)
    spread = CUBE_HALF + 4 if tt.holding else 38
    out += [("box", (gx - 12, gy - 45, gz + 25), (gx + 12, gy + 45, gz + 50), grey),
            ("box", (gx - 25, gy - 25, gz + 50), (gx + 25, gy + 25, gz + 140), (225, 225, 230)),
            ("box", (gx - 8, gy - spread - 8, gz - 15), (gx + 8, gy - spread, gz + 25), grey),
            ("box", (gx - 8, gy + spread, gz - 15), (gx + 8, gy + spread + 8, gz + 25), grey)]
    return out

def camera(tt) -> tuple[tuple[float, float, float], tuple[float, float, float], float]:
    """(eye, look-at point, field of view in degrees) in robot millimetres: behind the table, facing -x."""
    if tt.task == "drawer":
        return (250.0, -230.0, 700.0), (-510.0, -392.0, 0.0), 80.0
    return (400.0, 0.0, 560.0), (-20.0, 0.0, 0.0), 46.0


def _r(p):
    """Robot mm (x, y, z) -> render metres (X, Y, Z) with Y up, Z = -x."""
    return (p[1] / 1000.0, p[2] / 1000.0, -p[0] / 1000.0)


def render(tt, size: int) -> np.ndarray:
    """Third-person view (numpy ray caster) of :func:`primitives` from :func:`camera`."""
    rings = [(210, 40, 40), (245, 245, 245), (210, 40, 40), (245, 245, 245)]
    prims = primitives(tt)
    decals = [(p[1][1] / 1000.0, -p[1][0] / 1000.0, p[2] / 1000.0, rings) for p in prims if p[0] == "target"]
    sc = Scene((-1.5, 0.0, -1.2), (1.5, 2.0, 1.6), wall_colors=((205, 210, 215),) * 4,
               floor_color=(190, 160, 120), ceiling_color=(230, 230, 230), floor_tile=0.0, decals=decals)
    for oid, p in enumerate(prims, start=1):
        if p[0] == "box":
            a, b = _r(p[1]), _r(p[2])
            sc.add_box([min(a[i], b[i]) for i in range(3)], [max(a[i], b[i]) for i in range(3)], p[3], oid)
        elif p[0] == "sphere":
            sc.add_sphere(_r(p[1]), p[2] / 1000.0, p[3], oid)
    eye, look, fov = camera(tt)
    e, t = np.array(_r(eye)), np.array(_r(look))
    v = t - e
    yaw = math.degrees(math.atan2(v[0], v[2]))
    pitch = math.degrees(math.atan2(-v[1], math.hypot(v[0], v[2])))
    return sc.render(tuple(e), yaw, pitch, fov, size).rgb
