"""The self-contained PrimitiveSkill tabletop: a Panda-like gripper abstraction with geometric rules.

A stand-in for VAGEN's ManiSkill tasks (App. A.4, Tables 12/13/19; the task definitions of
VAGEN's ``PlaceTwoCube``, ``StackThreeCube``, ``PutAppleInDrawer`` and ``AlignTwoCube``) that keeps
their structure, coordinates (millimetres, integers in the prompt) and stages, with the rules a real
arm faces so that wrong coordinates fail:

* **reach**: every point of an action must lie inside the task's workspace limits (the limits the
  prompt prints); otherwise the action fails and nothing moves;
* **grasp**: ``pick(x, y, z)`` closes the gripper at that point; it grasps the object whose body
  contains the point (5 mm horizontal / 10 mm vertical slack), only with an empty gripper and only
  if nothing rests on top of the object (top-down grasp);
* **place**: ``place(x, y, z)`` releases the held object with its centre at (x, y) no lower than
  ``z``; it drops onto the highest surface under its centre (table, a cube's top face, the drawer
  floor, the cabinet top). A release point more than 15 mm *below* the resting height, a footprint
  that overlaps another object without being supported by it (a cube half on the edge of another),
  or a spot inside the cabinet is a collision: the place fails and the gripper keeps the object;
* **push**: ``push(x1, y1, z1, x2, y2, z2)`` needs an empty gripper; at the drawer's front/handle
  a push towards the cabinet (−y) closes the drawer by that distance (a drawer cannot be pulled
  open with a push); on an object resting on the table it slides the object horizontally towards
  (x2, y2), stopping at the first collision; objects stacked on it ride along;
* **drawer**: the apple fits in the drawer only where the drawer is pulled out far enough
  (the exposed part between the cabinet front and the drawer's front panel); a closed drawer cannot
  be re-opened, so closing it before putting the apple in fails the task.

Stages (VAGEN's ``evaluate``; each stage requires the previous one's condition where VAGEN's
does, so that grasping the last cube first earns nothing):

* place:  0 red cube grasped · 1 red cube in the left target, released · 2 … and green cube
  grasped · success: red in left, green in right, both released;
* stack:  0 red grasped · 1 red on green, released · 2 … and purple grasped · success: purple on
  red on green, released;
* drawer: 0 apple grasped · 1 apple in the drawer, released · success: … and drawer closed
  (open value <= 30 mm);
* align:  0 one cube at |x| <= 10 mm, released · success: both.

Frame: the viewer faces −x; −y is to the viewer's left, +z is up (the paper's hint). Entities:
``red_cube``, ``green_cube``, ``purple_cube``, ``left_target``, ``right_target``, ``apple``,
``drawer`` (the centre of its open part, where things go in), ``drawer_handle``, ``gripper``.

Public API::

    Tabletop.generate(task, rng) -> Tabletop       # task in TASKS
    tt.execute(action: Action) -> tuple[bool, bool, str]   # (ok, changed state, feedback)
    tt.stage() -> int                                      # highest stage whose condition holds (-1)
    tt.success() -> bool
    tt.positions() -> dict[str, list[int]]                 # App. C.2 object positions (mm, ints)
    tt.structured() / tt.relations() / tt.describe()
    tt.expert_actions(max_actions=2) -> list[str]
    tt.render(size) -> np.ndarray (uint8 HxWx3)        # numpy ray caster
    tt.primitives() / tt.camera()                      # renderer-independent scene description

The tasks' fixed numbers (workspaces, sizes, tolerances, the cabinet) and the primitives' grammar
(``Action``, ``parse_action``, ``format_action``) are :mod:`worldloop.envs.primitive_skill.tasks`; the
drawing behind ``render`` / ``primitives`` / ``camera`` is :mod:`worldloop.envs.primitive_skill.scene`.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import numpy as np

from worldloop.envs.primitive_skill import scene
from worldloop.envs.primitive_skill.tasks import (ALIGN_TOL, APPLE_R, CAB_BACK_Y, CAB_FRONT_Y, CAB_TOP, CAB_X, CUBE_HALF,
                                                  DRAWER_CLOSED, DRAWER_FLOOR, DRAWER_PANEL, DRAWER_TOP,
                                                  DRAWER_X, GRASP_XY_SLACK, GRASP_Z_SLACK, HANDLE_TOL, HANDLE_Z, PLACE_TOL,
                                                  TARGET_R, TASKS, WORKSPACES, Action, format_action)


@dataclass
class Body:
    name: str
    kind: str  # cube | apple
    pos: list[float]  # centre, mm

    @property
    def half(self) -> float:
        return CUBE_HALF if self.kind == "cube" else APPLE_R


@dataclass
class Tabletop:
    task: str
    bodies: dict[str, Body]
    targets: dict[str, tuple[float, float]] = field(default_factory=dict)
    drawer_open: float = 0.0
    in_drawer: set[str] = field(default_factory=set)
    holding: str | None = None
    gripper: list[float] = field(default_factory=lambda: [0.0, 0.0, 250.0])

    # ------------------------------------------------------------------ generation

    @classmethod
    def generate(cls, task: str, rng: np.random.Generator) -> "Tabletop":
        if task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {task!r}")
        (x0, x1), (y0, y1), _ = WORKSPACES[task]
        for _ in range(1000):
            if task == "drawer":
                pos = [float(rng.uniform(-150, -100)), float(rng.uniform(-70, 200)), APPLE_R]
                tt = cls(task, {"apple": Body("apple", "apple", pos)},
                         drawer_open=float(rng.integers(170, 241)), gripper=[-300.0, 0.0, 350.0])
                return tt
            names = {"place": ("red_cube", "green_cube"), "align": ("red_cube", "green_cube"),
                     "stack": ("red_cube", "green_cube", "purple_cube")}[task]
            lo_x = 0.0 if task == "align" else x0
            xy = [(float(rng.uniform(lo_x + 25, x1 - 25)), float(rng.uniform(y0 + 25, y1 - 25)))
                  for _ in names]
            if any(math.dist(a, b) < 60 for i, a in enumerate(xy) for b in xy[i + 1:]):
                continue
            targets = {}
            if task == "place":
                targets = {"left_target": (80.0, -100.0), "right_target": (80.0, 100.0)}
                if any(math.dist(p, t) <= TARGET_R + 10 for p in xy for t in targets.values()):
                    continue
            if task == "align":
                if any(abs(p[0]) <= ALIGN_TOL + 10 for p in xy) or abs(xy[0][1] - xy[1][1]) < 50:
                    continue
            bodies = {n: Body(n, "cube", [round(p[0], 1), round(p[1], 1), CUBE_HALF])
                      for n, p in zip(names, xy)}
            return cls(task, bodies, targets=targets)
        raise RuntimeError("could not sample a tabletop layout")

    def copy(self) -> "Tabletop":
        return copy.deepcopy(self)

    # ------------------------------------------------------------------ geometry helpers

    def in_workspace(self, p) -> bool:
        (x0, x1), (y0, y1), (z0, z1) = WORKSPACES[self.task]
        return x0 <= p[0] <= x1 and y0 <= p[1] <= y1 and z0 <= p[2] <= z1

    def drawer_opening(self) -> tuple[float, float]:
        """y range of the drawer's exposed interior (cabinet front .. inside of the front panel)."""
        return CAB_FRONT_Y, CAB_FRONT_Y + max(self.drawer_open - DRAWER_PANEL, 0.0)

    def handle_pos(self) -> list[float]:
        return [(DRAWER_X[0] + DRAWER_X[1]) / 2, CAB_FRONT_Y + self.drawer_open + 20.0, HANDLE_Z]

    def drawer_pos(self) -> list[float]:
        lo, hi = self.drawer_opening()
        return [(DRAWER_X[0] + DRAWER_X[1]) / 2, (lo + hi) / 2, DRAWER_FLOOR]

    def _on_top_of(self, name: str) -> list[str]:
        """Bodies resting directly on ``name``."""
        b = self.bodies[name]
        out = []
        for o in self.bodies.values():
            if o.name == name or o.name == self.holding:
                continue
            if (abs(o.pos[0] - b.pos[0]) <= b.half and abs(o.pos[1] - b.pos[1]) <= b.half
                    and abs(o.pos[2] - o.half - (b.pos[2] + b.half)) < 1.0):
                out.append(o.name)
        return out

    def _footprint_hits(self, name: str, x: float, y: float, z_bottom: float) -> list[str]:
        """Other bodies whose footprint overlaps ``name``'s at (x, y) and reach above z_bottom."""
        b = self.bodies[name]
        out = []
        for o in self.bodies.values():
            if o.name in (name, self.holding):
                continue
            if (abs(o.pos[0] - x) < b.half + o.half - 0.5 and abs(o.pos[1] - y) < b.half + o.half - 0.5
                    and o.pos[2] + o.half > z_bottom + 0.5):
                out.append(o.name)
        return out

    def _over_cabinet(self, x: float, y: float, half: float) -> bool:
        return (CAB_X[0] - half < x < CAB_X[1] + half and CAB_BACK_Y - half < y < CAB_FRONT_Y + half)

    # ------------------------------------------------------------------ actions

    def execute(self, a: Action) -> tuple[bool, bool, str]:
        """Run one primitive. Returns (succeeded, state changed, feedback sentence)."""
        pts = [a.args[:3]] if a.name != "push" else [a.args[:3], a.args[3:]]
        for p in pts:
            if not self.in_workspace(p):
                return False, False, (f"{format_action(a)} failed: "
                                      f"({', '.join(str(int(round(v))) for v in p)}) is outside the workspace.")
        if a.name == "pick":
            return self._pick(*a.args)
        if a.name == "place":
            return self._place(*a.args)
        return self._push(*a.args)

    def _pick(self, x, y, z):
        if self.holding is not None:
            return False, False, f"pick failed: the gripper is already holding the {_label(self.holding)}."
        cands = [b for b in self.bodies.values()
                 if abs(b.pos[0] - x) <= b.half + GRASP_XY_SLACK and abs(b.pos[1] - y) <= b.half + GRASP_XY_SLACK
                 and abs(b.pos[2] - z) <= b.half + GRASP_Z_SLACK]
        if not cands:
            self.gripper = [x, y, z + 80.0]
            return False, False, "pick failed: there is no object at that position; the gripper closed on air."
        b = max(cands, key=lambda c: c.pos[2])
        above = self._on_top_of(b.name)
        if above:
            return False, False, (f"pick failed: the {_label(b.name)} cannot be grasped while the "
                                  f"{_label(above[0])} is on top of it.")
        if b.name in self.in_drawer and self.drawer_open < 2 * b.half + DRAWER_PANEL:
            return False, False, f"pick failed: the {_label(b.name)} is inside the closed drawer."
        self.holding = b.name
        self.in_drawer.discard(b.name)
        self.gripper = [b.pos[0], b.pos[1], b.pos[2] + b.half + 10.0]
        return True, True, f"The gripper grasped the {_label(b.name)}."

    def _place(self, x, y, z):
        if self.holding is None:
            return False, False, "place failed: the gripper is not holding anything."
        b = self.bodies[self.holding]
        h = b.half
        # supports under the centre: table (0), cube tops, the drawer floor, the cabinet top
        support, support_name = 0.0, "table"
        in_drawer = False
        if self.task == "drawer":
            lo, hi = self.drawer_opening()
            in_opening = DRAWER_X[0] <= x <= DRAWER_X[1] and lo <= y <= hi
            protrusion = (DRAWER_X[0] - h < x < DRAWER_X[1] + h
                          and CAB_FRONT_Y - h < y < CAB_FRONT_Y + self.drawer_open + h)
            if in_opening:
                fits = DRAWER_X[0] + h <= x <= DRAWER_X[1] - h and lo + h <= y <= hi - h
                if not fits:
                    return False, False, (f"place failed: the {_label(b.name)} does not fit in the "
                                          "drawer there; it would hit the drawer's walls.")
                if z < DRAWER_FLOOR + h - PLACE_TOL:
                    return False, False, (f"place failed: releasing at z={int(round(z))} would push the "
                                          f"{_label(b.name)} through the drawer floor.")
                support, support_name, in_drawer = DRAWER_FLOOR, "drawer", True
            elif self._over_cabinet(x, y, 0.0):
                if z < CAB_TOP + h - PLACE_TOL:
                    return False, False, (f"place failed: the {_label(b.name)} would collide with the "
                                          "cabinet.")
                support, support_name = CAB_TOP, "cabinet"
            elif self._over_cabinet(x, y, h) or (protrusion and z - h < DRAWER_TOP):
                return False, False, (f"place failed: the {_label(b.name)} would collide with the "
                                      "cabinet or the drawer.")
        for o in self.bodies.values():  # the highest cube whose top face is under the centre
            if o.name == b.name or o.kind != "cube" or b.kind != "cube":
                continue
            if abs(o.pos[0] - x) <= o.half and abs(o.pos[1] - y) <= o.half:
                top = o.pos[2] + o.half
                if top > support:
                    support, support_name = top, o.name
        rest = support + h
        if z < rest - PLACE_TOL:
            return False, False, (f"place failed: releasing at z={int(round(z))} would push the "
                                  f"{_label(b.name)} into the {_label(support_name)}; "
                                  f"it needs z >= {int(round(rest - PLACE_TOL))}.")
        hits = self._footprint_hits(b.name, x, y, support)
        if hits:
            return False, False, (f"place failed: the {_label(b.name)} would collide with the "
                                  f"{_label(hits[0])}.")
        b.pos = [float(x), float(y), rest]
        self.holding = None
        if in_drawer:
            self.in_drawer.add(b.name)
        self.gripper = [float(x), float(y), rest + h + 60.0]
        where = {"table": "on the table", "drawer": "in the drawer"}.get(support_name, f"on the {_label(support_name)}")
        return True, True, f"The {_label(b.name)} was placed {where}."

    def _push(self, x1, y1, z1, x2, y2, z2):
        if self.holding is not None:
            return False, False, f"push failed: the gripper is holding the {_label(self.holding)}."
        if self.task == "drawer":
            hx, hy, hz = self.handle_pos()
            at_front = (DRAWER_X[0] - HANDLE_TOL <= x1 <= DRAWER_X[1] + HANDLE_TOL
                        and abs(y1 - hy) <= HANDLE_TOL and DRAWER_FLOOR - HANDLE_TOL <= z1 <= DRAWER_TOP + HANDLE_TOL)
            if at_front:
                if y2 >= y1:
                    return False, False, "push failed: a drawer cannot be pulled open by pushing."
                before = self.drawer_open
                self.drawer_open = max(0.0, self.drawer_open - (y1 - y2))
                shift = self.drawer_open - before
                for n in self.in_drawer:
                    self.bodies[n].pos[1] += shift
                self.gripper = [self.handle_pos()[0], self.handle_pos()[1] + 30.0, HANDLE_Z]
                state = "closed" if self.drawer_open <= DRAWER_CLOSED else f"open by {int(round(self.drawer_open))} mm"
                return True, shift != 0, f"The drawer was pushed; it is now {state}."
        cands = [b for b in self.bodies.values()
                 if abs(b.pos[0] - x1) <= b.half + GRASP_XY_SLACK and abs(b.pos[1] - y1) <= b.half + GRASP_XY_SLACK
                 and abs(b.pos[2] - z1) <= b.half + GRASP_Z_SLACK and b.name not in self.in_drawer]
        if not cands:
            self.gripper = [x2, y2, z2]
            return False, False, "push failed: there is no object at the start point of the push."
        b = min(cands, key=lambda c: c.pos[2])
        if abs(b.pos[2] - b.half) > 1.0:
            return False, False, f"push failed: the {_label(b.name)} is not standing on the table."
        if abs(z2 - z1) > 2 * b.half:
            return False, False, "push failed: a push moves objects along the table; keep z1 and z2 close."
        riders = self._stack_above(b.name)
        dx, dy = x2 - b.pos[0], y2 - b.pos[1]
        length = math.hypot(dx, dy)
        if length < 0.5:
            return True, False, f"The {_label(b.name)} did not move."
        n = max(2, int(length / 2.0) + 1)
        fr = np.linspace(0.0, 1.0, n)[1:]
        last_ok = 0.0
        for f in fr:  # sweep: stop before the first collision
            nx, ny = b.pos[0] + dx * f, b.pos[1] + dy * f
            blocked = any(o.name not in riders and o.name != b.name
                          and abs(o.pos[0] - nx) < b.half + o.half and abs(o.pos[1] - ny) < b.half + o.half
                          and o.pos[2] - o.half < 2 * b.half for o in self.bodies.values())
            if self.task == "drawer" and self._over_cabinet(nx, ny, b.half):
                blocked = True
            if blocked:
                break
            last_ok = float(f)
        mx, my = dx * last_ok, dy * last_ok
        for name in [b.name] + riders:
            self.bodies[name].pos[0] += mx
            self.bodies[name].pos[1] += my
        self.gripper = [b.pos[0], b.pos[1], b.pos[2] + 60.0]
        if last_ok < 1.0:
            return True, (mx, my) != (0.0, 0.0), f"The {_label(b.name)} was pushed until it hit an obstacle."
        return True, True, f"The {_label(b.name)} was pushed."

    def _stack_above(self, name: str) -> list[str]:
        out, frontier = [], [name]
        while frontier:
            cur = frontier.pop()
            for above in self._on_top_of(cur):
                if above not in out:
                    out.append(above)
                    frontier.append(above)
        return out

    # ------------------------------------------------------------------ task state

    def _in_target(self, name: str, target: str) -> bool:
        b = self.bodies[name]
        tx, ty = self.targets[target]
        return math.hypot(b.pos[0] - tx, b.pos[1] - ty) <= TARGET_R and self.holding != name

    def _on(self, top: str, bottom: str, direct: bool = False) -> bool:
        """VAGEN's "top on bottom": centres closer than half a cube in xy, top higher by > half."""
        a, b = self.bodies[top], self.bodies[bottom]
        above = (a.pos[2] > b.pos[2] + CUBE_HALF) if not direct else abs(a.pos[2] - b.pos[2] - 2 * CUBE_HALF) < 1.0
        return (math.hypot(a.pos[0] - b.pos[0], a.pos[1] - b.pos[1]) < CUBE_HALF and above
                and self.holding != top)

    def _aligned(self, name: str) -> bool:
        return abs(self.bodies[name].pos[0]) <= ALIGN_TOL and self.holding != name

    def stage_flags(self) -> list[bool]:
        """Conditions of the stages in order; the last one is success."""
        h = self.holding
        if self.task == "place":
            red_in = self._in_target("red_cube", "left_target")
            green_in = self._in_target("green_cube", "right_target")
            return [h == "red_cube", red_in, red_in and h == "green_cube", red_in and green_in]
        if self.task == "stack":
            rg = self._on("red_cube", "green_cube")
            return [h == "red_cube", rg, rg and h == "purple_cube", rg and self._on("purple_cube", "red_cube")]
        if self.task == "drawer":
            inside = "apple" in self.in_drawer and h is None
            return [h == "apple", inside, inside and self.drawer_open <= DRAWER_CLOSED]
        n = int(self._aligned("red_cube")) + int(self._aligned("green_cube"))
        return [n >= 1, n == 2]

    def stage(self) -> int:
        """Index of the highest non-final stage whose condition holds now (-1 for none)."""
        flags = self.stage_flags()[:-1]
        best = -1
        for i, f in enumerate(flags):
            if f:
                best = i
        return best

    def success(self) -> bool:
        return self.stage_flags()[-1]

    def n_stages(self) -> int:
        return len(self.stage_flags()) - 1

    # ------------------------------------------------------------------ ground truth

    def positions(self) -> dict[str, list[int]]:
        """App. C.2 object positions (mm, rounded to integers), task objects first."""
        out: dict[str, list[int]] = {}
        for name, b in self.bodies.items():
            out[name] = [int(round(v)) for v in b.pos]
        for name, (x, y) in self.targets.items():
            out[name] = [int(round(x)), int(round(y)), 0]
        if self.task == "drawer":
            out["drawer"] = [int(round(v)) for v in self.drawer_pos()]
            out["drawer_handle"] = [int(round(v)) for v in self.handle_pos()]
        return out

    def other_info(self) -> dict:
        if self.task == "drawer":
            return {"drawer_open_value": int(round(self.drawer_open))}
        return {}

    def structured(self) -> dict:
        out: dict = dict(self.positions())
        out.update(self.other_info())
        return out

    def relations(self) -> list[str]:
        out = [f"{n} is at ({', '.join(str(v) for v in p)})" for n, p in self.positions().items()]
        out.append(f"the gripper is holding {self.holding}" if self.holding else "the gripper is empty")
        if self.task == "place":
            for cube in ("red_cube", "green_cube"):
                for t in self.targets:
                    if self._in_target(cube, t):
                        out.append(f"{cube} is in {t}")
        if self.task == "stack":
            for top in self.bodies:
                for bottom in self.bodies:
                    if top != bottom and self._on(top, bottom, direct=True):
                        out.append(f"{top} is on top of {bottom}")
        if self.task == "drawer":
            out.append("the drawer is closed" if self.drawer_open <= DRAWER_CLOSED
                       else f"the drawer is open by {int(round(self.drawer_open))} mm")
            out.append("apple is in the drawer" if "apple" in self.in_drawer else "apple is not in the drawer")
        if self.task == "align":
            for cube in ("red_cube", "green_cube"):
                x = self.bodies[cube].pos[0]
                out.append(f"{cube} is aligned at x = 0" if self._aligned(cube)
                           else f"{cube} is {int(round(abs(x)))} mm from x = 0")
        return out

    def describe(self) -> str:
        """Natural-language state: every object with its position, then the task facts."""
        parts = [f"the {_label(n)} is at ({', '.join(str(v) for v in p)})" for n, p in self.positions().items()]
        s = "; ".join(parts)
        s = s[0].upper() + s[1:] + ". "
        s += f"The gripper is holding the {_label(self.holding)}." if self.holding else "The gripper is empty."
        extras = [r for r in self.relations()[len(self.positions()) + 1:]]
        if extras:
            s += " " + "; ".join(e.replace("_", " ") for e in extras) + "."
        return s

    # ------------------------------------------------------------------ expert

    def expert_actions(self, max_actions: int = 2) -> list[str]:
        """The next primitives of a competent solution, with the true (rounded) coordinates."""
        sim = self.copy()
        out: list[str] = []
        while len(out) < max_actions and not sim.success():
            a = sim._next_expert_action()
            if a is None:
                break
            ok, _, _ = sim.execute(a)
            if not ok:
                break
            out.append(format_action(a))
        return out

    def _free_spot(self, name: str) -> tuple[float, float] | None:
        """A table spot inside the workspace where ``name`` can be put down without collisions."""
        (x0, x1), (y0, y1), _ = WORKSPACES[self.task]
        h = self.bodies[name].half
        for x in np.arange(x1 - h - 5, x0 + h + 5, -20.0):
            for y in np.arange(y0 + h + 5, y1 - h - 5, 20.0):
                if self.task == "drawer" and (self._over_cabinet(x, y, h) or x < -300):
                    continue
                if any(math.hypot(x - tx, y - ty) <= TARGET_R + h for tx, ty in self.targets.values()):
                    continue
                if self.task == "align" and abs(x) <= ALIGN_TOL + h:
                    continue
                if not self._footprint_hits(name, float(x), float(y), 0.0):
                    return float(x), float(y)
        return None

    def _next_expert_action(self) -> Action | None:
        P = {n: [int(round(v)) for v in b.pos] for n, b in self.bodies.items()}
        a = self._task_expert_action(P)
        if a is None and self.holding is not None and not self.success():
            spot = self._free_spot(self.holding)  # holding the wrong object: put it down first
            if spot is not None:
                h = self.bodies[self.holding].half
                return Action("place", (float(round(spot[0])), float(round(spot[1])), h + 10.0))
        return a

    def _task_expert_action(self, P) -> Action | None:

        def pick(n):
            return Action("pick", tuple(float(v) for v in P[n]))

        def place_on(x, y, rest_z):  # integer coordinates, as the prompt asks for
            return Action("place", (float(round(x)), float(round(y)), float(round(rest_z + 10))))

        if self.task == "place":
            plan = [("red_cube", "left_target"), ("green_cube", "right_target")]
            for cube, tgt in plan:
                if not self._in_target(cube, tgt):
                    if self.holding not in (None, cube):
                        return None
                    if self.holding is None:
                        return pick(cube)
                    tx, ty = self.targets[tgt]
                    return place_on(tx, ty, CUBE_HALF)
            return None
        if self.task == "stack":
            for top, bottom in (("red_cube", "green_cube"), ("purple_cube", "red_cube")):
                if not self._on(top, bottom):
                    if self.holding is None:
                        return pick(top)
                    if self.holding != top:
                        return None
                    b = P[bottom]
                    return place_on(b[0], b[1], b[2] + 2 * CUBE_HALF)
            return None
        if self.task == "drawer":
            if "apple" not in self.in_drawer:
                if self.holding is None:
                    return pick("apple")
                d = self.drawer_pos()
                return place_on(d[0], d[1], DRAWER_FLOOR + APPLE_R)
            if self.drawer_open > DRAWER_CLOSED:
                hx, hy, hz = (int(round(v)) for v in self.handle_pos())
                closed_y = int(round(CAB_FRONT_Y + 20.0))
                return Action("push", (hx, hy, hz, hx, closed_y, hz))
            return None
        for cube in ("red_cube", "green_cube"):
            if not self._aligned(cube):
                if self.holding is None:
                    return pick(cube)
                if self.holding != cube:
                    return None
                return place_on(0, P[cube][1], CUBE_HALF)
        return None

    # ------------------------------------------------------------------ rendering (primitive_skill/scene.py)

    def primitives(self) -> list[tuple]:
        """The scene as drawable parts in robot millimetres, for any renderer (:func:`scene.primitives`)."""
        return scene.primitives(self)

    def camera(self) -> tuple[tuple[float, float, float], tuple[float, float, float], float]:
        """(eye, look-at point, field of view in degrees) in robot millimetres (:func:`scene.camera`)."""
        return scene.camera(self)

    def render(self, size: int) -> np.ndarray:
        """Third-person view (numpy ray caster) of :meth:`primitives` from :meth:`camera`."""
        return scene.render(self, size)


def _label(name: str) -> str:
    return name.replace("_", " ")
