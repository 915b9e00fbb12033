"""SVG facts stated in free text: (shape, colour) of every shape word and the stated similarity, or
the elements of a dict the agent wrote (untrusted text; nothing here raises on any text, and a dict
in it is parsed as data only: JSON, else a Python literal, never evaluated).

Public API::

    BASIC_COLORS
    svg_element_facts(structured) -> list[Fact]     # the truth: an SVG state's elements
    svg_text_facts(text, colors) -> list[Fact]      # what the text states
"""
from __future__ import annotations

import ast
import json
import re
from typing import Any, Iterable

from worldloop.judge.rule.coordinates import is_number
from worldloop.judge.rule.f1 import Fact

_SHAPE_WORDS: dict[str, str] = {}
for _shape, _words in {"rectangle": "rectangle rectangles rect rects square squares",
                       "circle": "circle circles dot dots disc disk",
                       "ellipse": "ellipse ellipses oval ovals",
                       "line": "line lines", "polyline": "polyline polylines zigzag",
                       "polygon": "polygon polygons triangle triangles star stars hexagon pentagon diamond",
                       "path": "path paths curve curves arc", "text": "text label letters"}.items():
    for _w in _words.split():
        _SHAPE_WORDS[_w] = _shape
BASIC_COLORS = ("red green blue yellow orange purple pink brown black white gray grey cyan magenta teal navy "
                 "violet gold silver beige maroon olive lime indigo turquoise").split()
_COLOR_MODIFIERS = r"(?:(?:light|dark|pale|bright|deep)\s+)?"


def _color(c: Any) -> str:
    return re.sub(r"\s+", " ", str(c or "").lower().replace("grey", "gray")).strip()


def svg_element_facts(structured: dict) -> list[Fact]:
    """("el", shape, colour) of the elements of an SVG state (the generated ones once the agent
    answered, else the target's) plus ("similarity", value) once measured."""
    answered = structured.get("similarity") is not None
    elements = structured.get("generated_elements" if answered else "target_elements") or []
    facts: list[Fact] = []
    for e in elements:
        if isinstance(e, dict) and isinstance(e.get("shape"), str):
            shape = _SHAPE_WORDS.get(e["shape"].lower(), e["shape"].lower())
            facts.append(("el", shape, _color(e.get("fill") or e.get("stroke"))))
    if answered and is_number(structured["similarity"]):
        facts.append(("similarity", float(structured["similarity"])))
    return list(dict.fromkeys(facts))


def svg_text_facts(text: str, colors: Iterable[str]) -> list[Fact]:
    """(shape, colour) of every shape word (colour: the nearest of ``colors`` in the 4 words before
    it) and the stated similarity, if any."""
    data = _dict_in(text)
    if data is not None and any(isinstance(data.get(k), list) for k in ("target_elements", "generated_elements")):
        return svg_element_facts(data)  # the structured format: the agent wrote the dict itself
    low = text.lower()[:20000]
    colors = "|".join(re.escape(c) for c in colors)
    out: list[Fact] = []
    for m in re.finditer(r"[a-z]+", low):
        shape = _SHAPE_WORDS.get(m.group(0))
        if shape is None:
            continue
        window = " ".join(re.findall(r"[a-z]+", low[max(0, m.start() - 60):m.start()])[-4:])
        found = re.findall(rf"{_COLOR_MODIFIERS}(?:{colors})", window) if colors else []
        out.append(("el", shape, _color(found[-1]) if found else ""))
    sim = re.search(r"similarity[^0-9.]{0,25}(\d+(?:\.\d+)?|\.\d+)\s*(%?)", low)
    if sim:
        v = float(sim.group(1))
        out.append(("similarity", v / 100 if sim.group(2) or v > 1 else v))
    return list(dict.fromkeys(out))


def _dict_in(text: str) -> dict | None:
    """The JSON (or Python-literal) dict spanning the text's outermost braces, if it parses."""
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end <= start or end - start > 50_000:
        return None
    body = text[start:end + 1]
    try:
        data = json.loads(body)
    except ValueError:
        try:
            data = ast.literal_eval(body)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return None
    return data if isinstance(data, dict) else None
