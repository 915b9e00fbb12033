"""What is fixed in the PrimitiveSkill tasks: instructions, workspaces, sizes, tolerances, the primitives.

The numbers follow VAGEN's task classes (``PlaceTwoCube``, ``StackThreeCube``, ``PutAppleInDrawer``,
``AlignTwoCube``; metres there, millimetres here). Frame: the viewer faces −x; −y is to the viewer's
left, +z is up (the paper's hint).

Public API::

    TASKS = ("place", "stack", "drawer", "align")
    INSTRUCTIONS: dict[str, str]               # task -> the instruction of the prompt
    WORKSPACES: dict[str, ((x0, x1), (y0, y1), (z0, z1))]   # reach limits in mm, printed in the prompt
    CUBE_HALF, APPLE_R, TARGET_R, ALIGN_TOL, PLACE_TOL, ...  # sizes and tolerances, mm
    CAB_*, DRAWER_*, HANDLE_Z                  # the cabinet and its drawer (drawer task), mm
    COLORS: dict[str, (r, g, b)]
    Action(name, args)                          # pick | place | push with 3 or 6 numbers
    parse_action(text) -> Action | None ; format_action(Action) -> str

The rules that use them are :mod:`worldloop.envs.primitive_skill.world`; the drawing is
:mod:`worldloop.envs.primitive_skill.scene`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

TASKS = ("place", "stack", "drawer", "align")
INSTRUCTIONS = {
    "place": "Please put the red cube on the left target and the green cube on the right target.",
    "stack": "Please stack the red cube on the green cube, and then stack the purple cube on the "
             "red cube.",
    "drawer": "Please put the apple in the drawer and close the drawer.",
    "align": "Please align the cubes in the y-axis, which means the x-coordinates of both cubes "
             "should be 0 (+-10mm).",
}
WORKSPACES = {  # (x, y, z) limits in mm, as VAGEN's tasks (x 1000)
    "place": ((-100, 150), (-200, 200), (10, 200)),
    "stack": ((-100, 150), (-150, 150), (10, 150)),
    "drawer": ((-500, -100), (-570, 200), (10, 470)),
    "align": ((-100, 150), (-150, 150), (10, 200)),
}
CUBE_HALF = 20.0
APPLE_R = 36.0
TARGET_R = 50.0
ALIGN_TOL = 10.0
PLACE_TOL = 15.0  # a release point may be this much below the resting height
GRASP_XY_SLACK = 5.0
GRASP_Z_SLACK = 10.0
HANDLE_TOL = 30.0
DRAWER_CLOSED = 30.0
COLORS = {"red_cube": (220, 40, 40), "green_cube": (40, 185, 60), "purple_cube": (165, 50, 200),
          "apple": (200, 25, 30)}

# cabinet and drawer (drawer task), mm
CAB_X = (-620.0, -380.0)
CAB_FRONT_Y = -590.0
CAB_BACK_Y = -870.0
CAB_TOP = 420.0
DRAWER_X = (-600.0, -400.0)  # interior
DRAWER_FLOOR = 200.0
DRAWER_TOP = 320.0
DRAWER_MAX_OPEN = 280.0
DRAWER_PANEL = 20.0
HANDLE_Z = 260.0

_NUM = r"\s*(-?\d+(?:\.\d+)?)\s*"
_ACTION_RE = re.compile(r"^\s*(pick|place|push)\s*\((" + _NUM + r"(?:," + _NUM + r")*)\)\s*$",
                        re.IGNORECASE)


@dataclass(frozen=True)
class Action:
    name: str  # pick | place | push
    args: tuple[float, ...]


def parse_action(text: str) -> Action | None:
    """``pick(x,y,z)``, ``place(x,y,z)`` or ``push(x1,y1,z1,x2,y2,z2)`` (numbers, any spacing)."""
    if not isinstance(text, str) or len(text) > 200:
        return None
    m = _ACTION_RE.match(text)
    if not m:
        return None
    name = m.group(1).lower()
    try:
        args = tuple(float(v) for v in m.group(2).split(","))
    except ValueError:
        return None
    if len(args) != (6 if name == "push" else 3) or not all(math.isfinite(a) for a in args):
        return None
    return Action(name, args)


def _num_text(v: float) -> str:
    return str(int(round(v))) if abs(v - round(v)) < 1e-9 else f"{v:.1f}"


def format_action(a: Action) -> str:
    """Canonical spelling: ``pick(62,-55,20)`` (integers as integers, other values to 0.1 mm)."""
    return f"{a.name}(" + ",".join(_num_text(v) for v in a.args) + ")"
