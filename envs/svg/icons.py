"""SVG targets for the SVG reconstruction env: a procedural icon generator and a local dataset loader.

The generator draws simple flat icons on a ``0 0 100 100`` canvas from 1-4 primitives (circle,
ring, rectangle, rounded rectangle, ellipse, triangle, regular polygon, star, line, quadratic curve),
optionally on a coloured background square, with named colours from a fixed palette and integer
coordinates. No text (fonts differ between machines, which would make targets machine-dependent).

The loader reads a local copy of an SVG icon dataset such as ``starvector/svg-icons-simple``:
a directory of ``*.svg`` files, or ``*.jsonl`` / ``*.json`` files whose records carry the code in
``Svg`` / ``svg`` (and a name in ``Filename`` / ``filename``). Parquet needs ``pyarrow`` (not a
dependency): export to JSONL first. Entries that fail :func:`worldloop.envs.svg.render.validate_svg` are
skipped and counted.

Public API::

    PALETTE: dict[str, str]                    # colour word -> hex
    generate_icon(rng) -> str                  # SVG code
    load_svg_dataset(path, limit=None) -> SVGDataset  (.items: list[(name, svg)], .skipped: int)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from worldloop.envs.svg.render import SVGRejected, validate_svg

PALETTE = {
    "red": "#e53935", "orange": "#fb8c00", "yellow": "#fdd835", "green": "#43a047", "cyan": "#00acc1",
    "blue": "#1e88e5", "purple": "#8e24aa", "pink": "#f06292", "brown": "#795548", "black": "#212121",
    "gray": "#9e9e9e",
}
_BACKGROUNDS = {"white": "#ffffff", "gray": "#eeeeee", "yellow": "#fff59d", "blue": "#bbdefb",
                "green": "#c8e6c9", "pink": "#f8bbd0"}


def _pick(rng: np.random.Generator, seq):
    return seq[int(rng.integers(len(seq)))]


def _shape(rng: np.random.Generator, color: str) -> str:
    kind = _pick(rng, ("circle", "ring", "rect", "roundrect", "ellipse", "triangle", "polygon", "star",
                       "line", "curve"))
    cx, cy = int(rng.integers(25, 76)), int(rng.integers(25, 76))
    size = int(rng.integers(10, 26))
    if kind == "circle":
        return f'<circle cx="{cx}" cy="{cy}" r="{size}" fill="{color}" />'
    if kind == "ring":
        w = int(rng.integers(3, 8))
        return f'<circle cx="{cx}" cy="{cy}" r="{size}" fill="none" stroke="{color}" stroke-width="{w}" />'
    if kind in ("rect", "roundrect"):
        w, h = int(rng.integers(12, 46)), int(rng.integers(12, 46))
        x, y = max(2, min(98 - w, cx - w // 2)), max(2, min(98 - h, cy - h // 2))
        rx = f' rx="{int(rng.integers(3, 9))}"' if kind == "roundrect" else ""
        return f'<rect x="{x}" y="{y}" width="{w}" height="{h}"{rx} fill="{color}" />'
    if kind == "ellipse":
        rx, ry = int(rng.integers(8, 28)), int(rng.integers(6, 20))
        return f'<ellipse cx="{cx}" cy="{cy}" rx="{rx}" ry="{ry}" fill="{color}" />'
    if kind in ("triangle", "polygon", "star"):
        n = 3 if kind == "triangle" else int(rng.integers(5, 9)) if kind == "polygon" else int(rng.integers(5, 7))
        rot = float(rng.uniform(0, 2 * math.pi / n))
        pts = []
        for i in range(n * (2 if kind == "star" else 1)):
            r = size if kind != "star" or i % 2 == 0 else size * 0.45
            a = rot + i * math.pi * 2 / (n * (2 if kind == "star" else 1)) - math.pi / 2
            pts.append(f"{round(cx + r * math.cos(a))},{round(cy + r * math.sin(a))}")
        return f'<polygon points="{" ".join(pts)}" fill="{color}" />'
    w = int(rng.integers(3, 8))
    x1, y1 = int(rng.integers(10, 91)), int(rng.integers(10, 91))
    x2, y2 = int(rng.integers(10, 91)), int(rng.integers(10, 91))
    if kind == "line":
        return (f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="{color}" stroke-width="{w}" '
                f'stroke-linecap="round" />')
    qx, qy = int(rng.integers(0, 101)), int(rng.integers(0, 101))
    return (f'<path d="M{x1} {y1} Q{qx} {qy} {x2} {y2}" fill="none" stroke="{color}" stroke-width="{w}" '
            f'stroke-linecap="round" />')


def generate_icon(rng: np.random.Generator) -> str:
    """A simple flat icon as SVG code (deterministic given ``rng``)."""
    n = int(rng.integers(1, 5))
    colors = list(PALETTE)
    rng.shuffle(colors)
    lines = ['<svg viewBox="0 0 100 100" xmlns="http://www.w3.org/2000/svg">']
    if rng.random() < 0.35:
        bg = _pick(rng, tuple(_BACKGROUNDS))
        if bg != "white":
            rx = ' rx="12"' if rng.random() < 0.5 else ""
            lines.append(f'  <rect x="0" y="0" width="100" height="100"{rx} fill="{_BACKGROUNDS[bg]}" />')
    for i in range(n):
        lines.append("  " + _shape(rng, PALETTE[colors[i % len(colors)]]))
    lines.append("</svg>")
    return "\n".join(lines)


@dataclass
class SVGDataset:
    items: list[tuple[str, str]] = field(default_factory=list)
    skipped: int = 0
    path: str = ""


def load_svg_dataset(path: str | Path, limit: int | None = None) -> SVGDataset:
    """Load (name, svg code) pairs from a local directory or JSON/JSONL file; see module docstring."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"SVG dataset path {str(p)!r} does not exist")
    files: list[Path]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.suffix.lower() in (".svg", ".jsonl", ".json"))
        if not files:
            if any(p.rglob("*.parquet")):
                raise RuntimeError(f"{p} holds only parquet files; reading them needs pyarrow "
                                   "(pip install pyarrow) or export the dataset to JSONL with fields "
                                   "'Filename' and 'Svg'")
            raise FileNotFoundError(f"no *.svg, *.jsonl or *.json files under {p}")
    else:
        files = [p]
    ds = SVGDataset(path=str(p))
    for f in files:
        for name, svg in _records(f):
            if limit is not None and len(ds.items) >= limit:
                return ds
            try:
                validate_svg(svg)
            except SVGRejected:
                ds.skipped += 1
                continue
            ds.items.append((name, svg))
    if not ds.items:
        raise ValueError(f"no usable SVG in {p} ({ds.skipped} entries rejected by validation)")
    return ds


def _records(f: Path):
    suffix = f.suffix.lower()
    if suffix == ".svg":
        yield f.stem, f.read_text(encoding="utf-8", errors="replace")
        return
    if suffix == ".parquet":
        raise RuntimeError("reading parquet needs pyarrow; export the dataset to JSONL")
    text = f.read_text(encoding="utf-8", errors="replace")
    if suffix == ".jsonl":
        rows = (json.loads(line) for line in text.splitlines() if line.strip())
    else:
        data = json.loads(text)
        rows = data if isinstance(data, list) else data.get("data", [])
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            continue
        svg = row.get("Svg") or row.get("svg")
        if isinstance(svg, str):
            name = row.get("Filename") or row.get("filename") or f"{f.stem}-{i}"
            yield str(name), svg
