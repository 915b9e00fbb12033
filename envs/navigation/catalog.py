"""What the Navigation rooms are furnished with: object types, each room's furniture, colours, shapes.

Public API::

    ROOM_TYPES = ("kitchen", "living room", "bedroom")
    ObjType(name, label, rooms, size, recipe, color, place="wall", supports=(), target=True,
            common_sense=())                 # one object type
    CATALOG: dict[str, ObjType]              # AI2-THOR type name -> type
    ROOM_FURNITURE: dict[str, tuple[(type name, probability), ...]]   # what a room may hold, in order
    WALL_COLORS / FLOOR_COLORS: dict[str, ...]                        # per room type
    base_instruction(label) -> str           # the base split's instruction
    type_label(type_name) -> str             # "GarbageCan" -> "garbage can"
    build_parts(recipe, color, cx, cz, y0, w, d, h, facing) -> list[(lo, hi, rgb)]   # the boxes of one object

An object is drawn from boxes by its type's ``recipe`` (a sofa is a seat, a back and two arms; a
table a top and four legs ...), in a local frame turned to face into the room; the ray caster
(:mod:`worldloop.envs.navigation.raycast`) draws the boxes and the world
(:mod:`worldloop.envs.navigation.world`) places the objects.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ROOM_TYPES = ("kitchen", "living room", "bedroom")


@dataclass(frozen=True)
class ObjType:
    """One object type: where it goes, how big it is, how it looks, how to ask for it."""

    name: str  # AI2-THOR style type name, e.g. "GarbageCan"
    label: str  # lower-case words, e.g. "garbage can"
    rooms: tuple[str, ...]
    size: tuple[float, float, float]  # width (along the wall), depth, height in metres
    recipe: str
    color: tuple[int, int, int]
    place: str = "wall"  # "wall", "free" or "on"
    supports: tuple[str, ...] = ()  # for place == "on": the types it may stand on
    target: bool = True
    common_sense: tuple[str, ...] = ()


CATALOG: dict[str, ObjType] = {t.name: t for t in (
    ObjType("CounterTop", "countertop", ("kitchen",), (1.8, 0.6, 0.9), "counter", (170, 160, 150),
            target=False),
    ObjType("Fridge", "fridge", ("kitchen",), (0.8, 0.7, 1.8), "fridge", (225, 228, 232),
            common_sense=("I want to keep my drinks cold. Please navigate to the appliance that does "
                          "that and stay near it.",
                          "The milk should be stored somewhere cold. Can you go to that object and "
                          "stay close?")),
    ObjType("Toaster", "toaster", ("kitchen",), (0.32, 0.22, 0.22), "toaster", (200, 40, 40),
            place="on", supports=("CounterTop", "DiningTable"),
            common_sense=("I want some crispy bread for breakfast. Please navigate to the appliance "
                          "that can do that and stay near it.",)),
    ObjType("Microwave", "microwave", ("kitchen",), (0.55, 0.4, 0.32), "microwave", (45, 45, 50),
            place="on", supports=("CounterTop",),
            common_sense=("I need to heat up my leftovers quickly. Please navigate to that appliance "
                          "and stay near it.",)),
    ObjType("CoffeeMachine", "coffee machine", ("kitchen",), (0.3, 0.3, 0.4), "block",
            (120, 70, 40), place="on", supports=("CounterTop",),
            common_sense=("I need a cup of freshly brewed coffee to wake up. Can you navigate to the "
                          "machine that makes it and stay close?",)),
    ObjType("DiningTable", "dining table", ("kitchen",), (1.2, 0.8, 0.75), "table", (140, 90, 50),
            place="free", target=False),
    ObjType("GarbageCan", "garbage can", ("kitchen", "living room", "bedroom"), (0.36, 0.36, 0.6),
            "garbage", (40, 110, 60),
            common_sense=("I need to dispose of some trash properly. Please navigate to that object "
                          "and stay near it.",)),
    ObjType("Sofa", "sofa", ("living room",), (2.0, 0.9, 0.85), "sofa", (60, 90, 160), target=False),
    ObjType("ArmChair", "armchair", ("living room",), (0.85, 0.85, 0.9), "sofa", (150, 60, 90),
            common_sense=("I would like a comfortable seat just for one person. Please navigate to it "
                          "and stay close.",)),
    ObjType("CoffeeTable", "coffee table", ("living room",), (1.0, 0.6, 0.45), "table",
            (110, 75, 45), place="free", target=False),
    ObjType("TVStand", "TV stand", ("living room",), (1.2, 0.45, 0.5), "block", (90, 60, 40),
            target=False),
    ObjType("Television", "television", ("living room",), (1.0, 0.08, 0.6), "tv", (20, 20, 25),
            place="on", supports=("TVStand",),
            common_sense=("I want to watch the evening news. Please navigate to the device that shows "
                          "it and stay near it.",)),
    ObjType("FloorLamp", "floor lamp", ("living room", "bedroom"), (0.4, 0.4, 1.6), "lamp",
            (250, 220, 120),
            common_sense=("The corner is too dark; I am looking for a tall standing light. Please "
                          "navigate to it and stay close.",)),
    ObjType("HousePlant", "house plant", ("living room", "bedroom", "kitchen"), (0.45, 0.45, 1.0),
            "plant", (50, 150, 60),
            common_sense=("Something green in this room needs watering. Please navigate to it and "
                          "stay near it.",)),
    ObjType("Laptop", "laptop", ("living room", "bedroom"), (0.36, 0.26, 0.24), "laptop",
            (170, 175, 185), place="on", supports=("CoffeeTable", "Desk"),
            common_sense=("I need to check my emails on a portable computer. Please navigate to it "
                          "and stay close.",)),
    ObjType("Bed", "bed", ("bedroom",), (1.6, 2.0, 0.5), "bed", (235, 235, 245), target=False),
    ObjType("Desk", "desk", ("bedroom",), (1.2, 0.6, 0.75), "table", (160, 120, 80), target=False),
    ObjType("DeskLamp", "desk lamp", ("bedroom",), (0.25, 0.25, 0.45), "lamp", (255, 230, 90),
            place="on", supports=("Desk", "Dresser"),
            common_sense=("I am looking for a luminous device on my desk to read books at night. Can "
                          "you navigate to that object and stay close?",)),
    ObjType("Dresser", "dresser", ("bedroom",), (1.0, 0.5, 0.9), "dresser", (120, 80, 110),
            common_sense=("I need to put away my folded clothes in drawers. Please navigate to that "
                          "piece of furniture and stay near it.",)),
    ObjType("AlarmClock", "alarm clock", ("bedroom",), (0.2, 0.12, 0.15), "block", (240, 120, 20),
            place="on", supports=("Dresser", "Desk"),
            common_sense=("Something in this room rings to wake me up in the morning. Please navigate "
                          "to it and stay close.",)),
)}

ROOM_FURNITURE = {
    "kitchen": (("CounterTop", 1.0), ("Fridge", 1.0), ("DiningTable", 0.7), ("GarbageCan", 0.8),
                ("HousePlant", 0.4), ("Toaster", 0.8), ("Microwave", 0.7), ("CoffeeMachine", 0.6)),
    "living room": (("Sofa", 1.0), ("TVStand", 0.9), ("Television", 0.9), ("ArmChair", 0.7),
                    ("CoffeeTable", 0.8), ("FloorLamp", 0.7), ("HousePlant", 0.7),
                    ("GarbageCan", 0.5), ("Laptop", 0.6)),
    "bedroom": (("Bed", 1.0), ("Desk", 1.0), ("DeskLamp", 0.9), ("Dresser", 0.8),
                ("FloorLamp", 0.4), ("HousePlant", 0.5), ("GarbageCan", 0.6), ("Laptop", 0.6),
                ("AlarmClock", 0.6)),
}
WALL_COLORS = {
    "kitchen": ((215, 210, 190), (205, 200, 180), (210, 205, 185), (200, 195, 175)),
    "living room": ((190, 200, 215), (180, 190, 205), (185, 195, 210), (175, 185, 200)),
    "bedroom": ((220, 200, 200), (210, 190, 190), (215, 195, 195), (205, 185, 185)),
}
FLOOR_COLORS = {"kitchen": (170, 170, 165), "living room": (150, 110, 75), "bedroom": (165, 125, 90)}


def base_instruction(label: str) -> str:
    """The base split's instruction (EmbodiedBench/VAGEN "base" style)."""
    return f"Navigate to the {label} in the room and be as close as possible to it."


def type_label(type_name: str) -> str:
    """Lower-case words of an object type: the catalog's label, else the CamelCase split."""
    spec = CATALOG.get(type_name)
    if spec is not None:
        return spec.label
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", " ", type_name).lower()


# ----------------------------------------------------------------------------- shapes


def _shade(color, f: float) -> tuple[int, int, int]:
    return tuple(int(max(0, min(255, c * f))) for c in color)


def build_parts(kind: str, color, cx: float, cz: float, y0: float, w: float, d: float, h: float,
                facing: tuple[int, int]):
    """The boxes ``(lo, hi, rgb)`` of one object whose footprint is centred at (cx, cz), standing at
    height y0 and facing ``facing`` (a unit (dx, dz)). The recipes of ``_RECIPES`` give them in a local
    frame: u along the width, v from back (-d/2) to front (+d/2), y up from y0."""
    fx, fz = facing
    ux, uz = fz, -fx  # perpendicular to the facing direction

    def box(u0, u1, v0, v1, y_lo, y_hi, col):
        xs = [cx + u * ux + v * fx for u in (u0, u1) for v in (v0, v1)]
        zs = [cz + u * uz + v * fz for u in (u0, u1) for v in (v0, v1)]
        return ((min(xs), y0 + y_lo, min(zs)), (max(xs), y0 + y_hi, max(zs)), tuple(col))

    return [box(*b) for b in _RECIPES.get(kind, _block)(color, w / 2, d / 2, w, d, h)]


# Each recipe: (color, hw, hd, w, d, h) -> local boxes (u0, u1, v0, v1, y_lo, y_hi, rgb), hw = w/2, hd = d/2.


def _table(color, hw, hd, w, d, h):
    leg = 0.06
    dark = _shade(color, 0.55)
    parts = [(-hw, hw, -hd, hd, h - 0.05, h, color)]
    for su in (-1, 1):
        for sv in (-1, 1):
            u = su * (hw - leg)
            v = sv * (hd - leg)
            parts.append((u - leg / 2, u + leg / 2, v - leg / 2, v + leg / 2, 0, h - 0.05, dark))
    return parts


def _sofa(color, hw, hd, w, d, h):
    seat = 0.45 * h
    arm = min(0.18, w * 0.15)
    return [(-hw, hw, -hd, hd, 0, seat, color),
            (-hw, hw, -hd, -hd + 0.22, seat, h, _shade(color, 0.85)),
            (-hw, -hw + arm, -hd + 0.22, hd, seat, seat + 0.2, _shade(color, 0.9)),
            (hw - arm, hw, -hd + 0.22, hd, seat, seat + 0.2, _shade(color, 0.9))]


def _bed(color, hw, hd, w, d, h):
    return [(-hw, hw, -hd, hd, 0, h, color),
            (-hw, hw, -hd, -hd + 0.08, 0, h + 0.6, (120, 85, 60)),
            (-hw + 0.15, hw - 0.15, -hd + 0.12, -hd + 0.45, h, h + 0.12, (250, 250, 250)),
            (-hw, hw, -hd + 0.6, hd, h, h + 0.04, (90, 120, 170))]


def _lamp(color, hw, hd, w, d, h):
    pole = max(0.03, w * 0.12)
    return [(-w * 0.3, w * 0.3, -d * 0.3, d * 0.3, 0, 0.04, (60, 60, 60)),
            (-pole / 2, pole / 2, -pole / 2, pole / 2, 0.04, h * 0.7, (70, 70, 70)),
            (-hw, hw, -hd, hd, h * 0.7, h, color)]


def _plant(color, hw, hd, w, d, h):
    return [(-hw * 0.6, hw * 0.6, -hd * 0.6, hd * 0.6, 0, h * 0.35, (150, 90, 60)),
            (-hw, hw, -hd, hd, h * 0.35, h, color)]


def _tv(color, hw, hd, w, d, h):
    return [(-hw, hw, -hd, hd, 0.05, h, color),
            (-0.1, 0.1, -0.06, 0.06, 0, 0.05, (60, 60, 60))]


def _counter(color, hw, hd, w, d, h):
    return [(-hw, hw, -hd, hd, 0, h - 0.04, color),
            (-hw, hw, -hd, hd + 0.02, h - 0.04, h, (90, 90, 95))]


def _fridge(color, hw, hd, w, d, h):
    return [(-hw, hw, -hd, hd, 0, h, color),
            (hw - 0.12, hw - 0.08, hd, hd + 0.03, h * 0.35, h * 0.85, (80, 80, 80)),
            (-hw, hw, hd, hd + 0.005, h * 0.62, h * 0.64, (150, 150, 155))]


def _garbage(color, hw, hd, w, d, h):
    return [(-hw, hw, -hd, hd, 0, h * 0.92, color),
            (-hw - 0.01, hw + 0.01, -hd - 0.01, hd + 0.01, h * 0.92, h, _shade(color, 0.55))]


def _laptop(color, hw, hd, w, d, h):
    return [(-hw, hw, -hd, hd, 0, 0.025, color),
            (-hw, hw, -hd, -hd + 0.02, 0.025, h, (30, 30, 40))]


def _toaster(color, hw, hd, w, d, h):
    return [(-hw, hw, -hd, hd, 0, h, color),
            (-hw * 0.7, hw * 0.7, -hd * 0.5, -hd * 0.2, h, h + 0.005, (30, 30, 30)),
            (-hw * 0.7, hw * 0.7, hd * 0.2, hd * 0.5, h, h + 0.005, (30, 30, 30))]


def _microwave(color, hw, hd, w, d, h):
    return [(-hw, hw, -hd, hd, 0, h, color),
            (-hw * 0.85, hw * 0.3, hd, hd + 0.005, h * 0.15, h * 0.85, (110, 140, 150))]


def _dresser(color, hw, hd, w, d, h):
    parts = [(-hw, hw, -hd, hd, 0, h, color)]
    for i in range(3):
        y = h * (0.25 + 0.28 * i)
        parts.append((-0.08, 0.08, hd, hd + 0.02, y, y + 0.03, (230, 200, 120)))
    return parts


def _block(color, hw, hd, w, d, h):
    return [(-hw, hw, -hd, hd, 0, h, color)]


_RECIPES = {"table": _table, "sofa": _sofa, "bed": _bed, "lamp": _lamp, "plant": _plant, "tv": _tv,
            "counter": _counter, "fridge": _fridge, "garbage": _garbage, "laptop": _laptop, "toaster": _toaster,
            "microwave": _microwave, "dresser": _dresser, "block": _block}
