"""Pillow sprites for the grid envs, drawn once per cell size and cached; frames are numpy gathers.

Public API::

    sprite(name, cell) -> np.ndarray           # uint8 (cell, cell, 3), cached per (name, cell)
    sprite_rgba(name, cell) -> np.ndarray      # uint8 (cell, cell, 4) overlay with alpha, cached
    tile_stack(names, cell) -> np.ndarray      # uint8 (len(names), cell, cell, 3), cached
    compose(codes, tiles, side=None) -> np.ndarray   # (H*cell, W*cell, 3), padded to side x side
    pad_square(img, side) -> np.ndarray        # centre on a black side x side canvas
    overlay(image, rgba, y, x) -> None         # alpha-blend a sprite at pixel (y, x), in place
    cell_size(grid_side, image_size) -> int
    grid_image_shape(rows, cols, side) -> (H, W, 3)   shape of compose(...) padded to side

Sprite names: Sokoban ``wall floor target box box_target player player_target``; FrozenLake
``ice hole goal elf elf_hole elf_goal`` and ``void`` (black: off the board); Maze ``maze_wall
maze_path maze_player maze_goal maze_player_goal``; Taxi overlays ``taxi taxi_full passenger destination`` and tiles ``road
depot_r depot_g depot_y depot_b``. Everything is drawn with ``PIL.ImageDraw`` at 4x and reduced with
a box filter (smooth edges), so nothing is downloaded and each sprite costs ~1 ms once.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFont

_SS = 4  # supersampling factor

Painter = Callable[[ImageDraw.ImageDraw, int], None]


def _rect(d: ImageDraw.ImageDraw, s: int, box: Sequence[float], fill, outline=None, width: float = 0, radius: float = 0):
    x0, y0, x1, y1 = (v * s for v in box)
    w = max(1, int(width * s)) if outline is not None else 0
    if radius:
        d.rounded_rectangle([x0, y0, x1, y1], radius=radius * s, fill=fill, outline=outline, width=w)
    else:
        d.rectangle([x0, y0, x1, y1], fill=fill, outline=outline, width=w)


def _ellipse(d: ImageDraw.ImageDraw, s: int, box: Sequence[float], fill, outline=None, width: float = 0):
    x0, y0, x1, y1 = (v * s for v in box)
    d.ellipse([x0, y0, x1, y1], fill=fill, outline=outline, width=max(1, int(width * s)) if outline else 0)


def _line(d: ImageDraw.ImageDraw, s: int, pts: Sequence[float], fill, width: float):
    d.line([v * s for v in pts], fill=fill, width=max(1, int(width * s)))


def _poly(d: ImageDraw.ImageDraw, s: int, pts: Sequence[float], fill):
    d.polygon([v * s for v in pts], fill=fill)


# ----------------------------------------------------------------- Sokoban (unit square 0..1)

FLOOR = (38, 38, 44)


def _floor(d, s):
    _rect(d, s, (0, 0, 1, 1), FLOOR)
    _rect(d, s, (0, 0, 1, 1), None, outline=(48, 48, 56), width=0.03)


def _wall(d, s):
    _rect(d, s, (0, 0, 1, 1), (120, 62, 38))
    mortar = (190, 170, 150)
    for y in (0.0, 0.33, 0.66):
        _line(d, s, (0, y + 0.01, 1, y + 0.01), mortar, 0.04)
    for i, y in enumerate((0.0, 0.33, 0.66)):
        xs = (0.5,) if i % 2 == 0 else (0.25, 0.75)
        for x in xs:
            _line(d, s, (x, y, x, y + 0.33), mortar, 0.04)


def _target_mark(d, s):
    _rect(d, s, (0.22, 0.22, 0.78, 0.78), None, outline=(220, 40, 40), width=0.07)
    _line(d, s, (0.32, 0.32, 0.68, 0.68), (220, 40, 40), 0.05)
    _line(d, s, (0.68, 0.32, 0.32, 0.68), (220, 40, 40), 0.05)


def _target(d, s):
    _floor(d, s)
    _target_mark(d, s)


def _crate(d, s, body, dark):
    _rect(d, s, (0.08, 0.08, 0.92, 0.92), body, outline=dark, width=0.07)
    _rect(d, s, (0.2, 0.2, 0.8, 0.8), None, outline=dark, width=0.05)
    _line(d, s, (0.2, 0.2, 0.8, 0.8), dark, 0.06)
    _line(d, s, (0.8, 0.2, 0.2, 0.8), dark, 0.06)


def _box(d, s):
    _floor(d, s)
    _crate(d, s, (214, 160, 74), (120, 78, 28))


def _box_target(d, s):
    _floor(d, s)
    _crate(d, s, (96, 190, 96), (30, 100, 40))


def _person(d, s, body=(40, 140, 230), skin=(250, 210, 170), hat=None):
    _ellipse(d, s, (0.36, 0.12, 0.64, 0.40), skin, outline=(60, 40, 30), width=0.03)
    if hat:
        _poly(d, s, (0.34, 0.2, 0.5, 0.0, 0.66, 0.2), hat)
    _poly(d, s, (0.3, 0.42, 0.7, 0.42, 0.76, 0.72, 0.24, 0.72), body)
    _line(d, s, (0.4, 0.72, 0.38, 0.9), (50, 50, 60), 0.08)
    _line(d, s, (0.6, 0.72, 0.62, 0.9), (50, 50, 60), 0.08)


def _player(d, s):
    _floor(d, s)
    _person(d, s, body=(60, 200, 90))


def _player_target(d, s):
    _target(d, s)
    _person(d, s, body=(60, 200, 90))


# ----------------------------------------------------------------- FrozenLake

def _ice(d, s):
    _rect(d, s, (0, 0, 1, 1), (198, 228, 248))
    _rect(d, s, (0, 0, 1, 1), None, outline=(170, 205, 232), width=0.03)
    _line(d, s, (0.15, 0.3, 0.35, 0.15), (245, 252, 255), 0.04)
    _line(d, s, (0.6, 0.85, 0.85, 0.65), (245, 252, 255), 0.04)


def _hole_mark(d, s):
    _ellipse(d, s, (0.1, 0.22, 0.9, 0.82), (24, 48, 96), outline=(90, 130, 180), width=0.05)
    _ellipse(d, s, (0.22, 0.34, 0.78, 0.72), (10, 22, 52))


def _hole(d, s):
    _ice(d, s)
    _hole_mark(d, s)


def _gift(d, s):
    _rect(d, s, (0.2, 0.38, 0.8, 0.88), (220, 50, 60), outline=(140, 20, 30), width=0.04)
    _rect(d, s, (0.16, 0.28, 0.84, 0.4), (235, 70, 80), outline=(140, 20, 30), width=0.04)
    _rect(d, s, (0.44, 0.28, 0.56, 0.88), (250, 210, 60))
    _ellipse(d, s, (0.3, 0.12, 0.5, 0.3), None, outline=(250, 210, 60), width=0.06)
    _ellipse(d, s, (0.5, 0.12, 0.7, 0.3), None, outline=(250, 210, 60), width=0.06)


def _goal(d, s):
    _ice(d, s)
    _gift(d, s)


def _elf(d, s):
    _ice(d, s)
    _person(d, s, body=(40, 150, 60), hat=(200, 30, 40))


def _elf_hole(d, s):
    _hole(d, s)
    _person(d, s, body=(40, 150, 60), hat=(200, 30, 40))
    _line(d, s, (0.15, 0.15, 0.85, 0.85), (230, 30, 30), 0.08)
    _line(d, s, (0.85, 0.15, 0.15, 0.85), (230, 30, 30), 0.08)


def _elf_goal(d, s):
    _goal(d, s)
    _person(d, s, body=(40, 150, 60), hat=(200, 30, 40))


# ----------------------------------------------------------------- Maze

def _maze_wall(d, s):
    _rect(d, s, (0, 0, 1, 1), (52, 56, 72))


def _maze_path(d, s):
    _rect(d, s, (0, 0, 1, 1), (242, 240, 232))


def _maze_player(d, s):
    _maze_path(d, s)
    _ellipse(d, s, (0.15, 0.15, 0.85, 0.85), (40, 110, 230), outline=(20, 50, 120), width=0.06)


def _flag(d, s):
    _line(d, s, (0.3, 0.1, 0.3, 0.92), (60, 40, 30), 0.08)
    _poly(d, s, (0.32, 0.12, 0.85, 0.3, 0.32, 0.5), (230, 40, 40))


def _maze_goal(d, s):
    _maze_path(d, s)
    _flag(d, s)


def _maze_player_goal(d, s):
    _maze_goal(d, s)
    _ellipse(d, s, (0.4, 0.4, 0.9, 0.9), (40, 110, 230), outline=(20, 50, 120), width=0.06)


# ----------------------------------------------------------------- Taxi

def _road(d, s):
    _rect(d, s, (0, 0, 1, 1), (205, 205, 200))
    _rect(d, s, (0, 0, 1, 1), None, outline=(180, 180, 175), width=0.02)


def _depot(color, letter):
    def paint(d, s):
        dark = tuple(int(c * 0.55) for c in color)
        _rect(d, s, (0, 0, 1, 1), color)
        _rect(d, s, (0.06, 0.06, 0.94, 0.94), None, outline=dark, width=0.05)
        try:
            font = ImageFont.load_default(size=max(8, int(0.3 * s)))
        except Exception:  # Pillow without FreeType: the small bitmap font
            font = ImageFont.load_default()
        d.text((0.1 * s, 0.06 * s), letter, fill=dark, font=font)
    return paint


def _taxi(d, s, full=False):
    _rect(d, s, (0.08, 0.3, 0.92, 0.78), (250, 200, 30), outline=(120, 90, 10), width=0.04, radius=0.1)
    _rect(d, s, (0.26, 0.14, 0.74, 0.34), (250, 200, 30), outline=(120, 90, 10), width=0.04, radius=0.06)
    _rect(d, s, (0.32, 0.18, 0.68, 0.32), (130, 190, 230) if not full else (40, 90, 220))
    _rect(d, s, (0.38, 0.42, 0.62, 0.54), (30, 30, 30))  # TAXI sign
    _ellipse(d, s, (0.16, 0.7, 0.36, 0.9), (30, 30, 30))
    _ellipse(d, s, (0.64, 0.7, 0.84, 0.9), (30, 30, 30))


def _taxi_full(d, s):
    _taxi(d, s, full=True)


def _passenger(d, s):
    _person(d, s, body=(40, 90, 220))


def _destination(d, s):
    _rect(d, s, (0.05, 0.05, 0.95, 0.95), None, outline=(200, 30, 200), width=0.08)
    _poly(d, s, (0.5, 0.12, 0.88, 0.42, 0.12, 0.42), (200, 30, 200))
    _rect(d, s, (0.2, 0.42, 0.8, 0.88), None, outline=(200, 30, 200), width=0.06)


_TILES: dict[str, Painter] = {
    "floor": _floor, "wall": _wall, "target": _target, "box": _box, "box_target": _box_target,
    "player": _player, "player_target": _player_target,
    "ice": _ice, "hole": _hole, "goal": _goal, "elf": _elf, "elf_hole": _elf_hole, "elf_goal": _elf_goal,
    "maze_wall": _maze_wall, "maze_path": _maze_path, "maze_player": _maze_player, "maze_goal": _maze_goal,
    "maze_player_goal": _maze_player_goal,
    "void": lambda d, s: None,  # black: off the board (FrozenLake's egocentric view)
    "road": _road, "depot_r": _depot((235, 120, 120), "R"), "depot_g": _depot((120, 210, 120), "G"),
    "depot_y": _depot((240, 225, 110), "Y"), "depot_b": _depot((120, 150, 240), "B"),
}
_OVERLAYS: dict[str, Painter] = {
    "taxi": _taxi, "taxi_full": _taxi_full, "passenger": _passenger, "destination": _destination,
}


def _paint(table: dict[str, Painter], name: str, cell: int, mode: str) -> np.ndarray:
    """Draw sprite ``name`` of ``table`` at 4x and reduce it to cell x cell; read-only array."""
    if name not in table:
        raise KeyError(f"unknown sprite {name!r}")
    big = int(cell) * _SS
    img = Image.new(mode, (big, big), (0, 0, 0, 0) if mode == "RGBA" else (0, 0, 0))
    table[name](ImageDraw.Draw(img), big)
    arr = np.asarray(img.resize((int(cell), int(cell)), Image.Resampling.BOX), dtype=np.uint8)
    arr.setflags(write=False)
    return arr


@lru_cache(maxsize=512)
def sprite(name: str, cell: int) -> np.ndarray:
    """An opaque tile (cell x cell x 3); read-only, cached."""
    return _paint(_TILES, name, cell, "RGB")


@lru_cache(maxsize=256)
def sprite_rgba(name: str, cell: int) -> np.ndarray:
    """A transparent overlay (cell x cell x 4); read-only, cached."""
    return _paint(_OVERLAYS, name, cell, "RGBA")


@lru_cache(maxsize=128)
def tile_stack(names: tuple[str, ...], cell: int) -> np.ndarray:
    """``np.stack([sprite(n, cell) for n in names])``, cached for :func:`compose`."""
    arr = np.stack([sprite(n, cell) for n in names])
    arr.setflags(write=False)
    return arr


def cell_size(grid_side: int, image_size: int) -> int:
    """Pixels per cell so that ``grid_side`` cells fit in ``image_size`` (at least 4)."""
    return max(4, int(image_size) // max(1, int(grid_side)))


def grid_image_shape(rows: int, cols: int, side: int) -> tuple[int, int, int]:
    """The shape of ``compose`` of a ``rows`` x ``cols`` grid at ``cell_size(max(rows, cols), side)``
    padded to ``side``: (side, side, 3) unless the cells (at least 4 px) do not fit."""
    cell = cell_size(max(rows, cols), side)
    return (max(int(side), rows * cell), max(int(side), cols * cell), 3)


def compose(codes: np.ndarray, tiles: np.ndarray, side: int | None = None) -> np.ndarray:
    """Gather ``tiles[codes]`` into one image, centred on a black square of ``side`` if given."""
    h, w = codes.shape
    cell = tiles.shape[1]
    img = tiles[codes].transpose(0, 2, 1, 3, 4).reshape(h * cell, w * cell, 3)
    return pad_square(img, side)


def pad_square(img: np.ndarray, side: int | None) -> np.ndarray:
    """``img`` centred on a black ``side`` x ``side`` canvas (unchanged when it already fits exactly)."""
    if side is None or (img.shape[0] == side and img.shape[1] == side):
        return np.ascontiguousarray(img)
    out = np.zeros((max(side, img.shape[0]), max(side, img.shape[1]), 3), dtype=np.uint8)
    y0, x0 = (out.shape[0] - img.shape[0]) // 2, (out.shape[1] - img.shape[1]) // 2
    out[y0 : y0 + img.shape[0], x0 : x0 + img.shape[1]] = img
    return out


def overlay(image: np.ndarray, rgba: np.ndarray, y: int, x: int) -> None:
    """Alpha-blend ``rgba`` onto ``image`` with its top-left corner at pixel (y, x), in place."""
    h, w = rgba.shape[:2]
    region = image[y : y + h, x : x + w]
    alpha = rgba[..., 3:4].astype(np.uint16)
    region[...] = ((rgba[..., :3] * alpha + region * (255 - alpha)) // 255).astype(np.uint8)
