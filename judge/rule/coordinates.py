"""Coordinates stated in free text: the number tuples after each key of a structured state
(``box_positions: [(3, 2)]``, "the player is at (4, 2)"), as (normalised key, tuple) facts
(untrusted text; nothing here raises on any text).

Keys are normalised so that the text's wording and the state's keys meet: ``box_positions`` ->
``box``, ``red_cube_position`` -> ``red_cube``. Hybrid scoring: :func:`extracted_position_items`
reads the same facts from an LLM extractor's JSON list.

Public API::

    norm_key(key) -> str    is_number(x) -> bool    has_number_tuple(text) -> bool
    coordinate_facts(text, keys) -> list[Fact]
    extracted_position_items(data) -> list[Item]
"""
from __future__ import annotations

import math
import re
from typing import Any

from worldloop.judge.rule.f1 import Fact, Item
from worldloop.judge.rule.lexicon import singular

_NUM = r"-?\d+(?:\.\d+)?"
_TUPLE_RE = re.compile(rf"[\(\[]\s*({_NUM}(?:\s*,\s*{_NUM})+)\s*[\)\]]")
_KEY_SUFFIX = re.compile(r"(?:_(?:positions?|pos|coordinates?|coords?|locations?|xyz|xy))+$")


def norm_key(key: str) -> str:
    """``box_positions`` -> ``box``, ``red_cube_position`` -> ``red_cube``, ``Grid Size`` -> ``grid_size``."""
    k = re.sub(r"[^a-z0-9]+", "_", str(key).lower()).strip("_")
    k = _KEY_SUFFIX.sub("", k) or k
    parts = k.split("_")
    parts[-1] = singular(parts[-1]) if parts[-1] not in ("size",) else parts[-1]
    return "_".join(parts)


def is_number(x: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _key_pattern(key: str) -> str:
    words = key.split("_")
    words[-1] = re.escape(words[-1]) + r"(?:e?s)?"
    body = r"[\s_]*".join(re.escape(w) if i < len(words) - 1 else w for i, w in enumerate(words))
    return rf"(?<![a-z0-9]){body}(?:[\s_]*(?:positions?|pos|coordinates?|coords?|locations?))?(?![a-z0-9])"


def coordinate_facts(text: str, keys: dict[str, int]) -> list[Fact]:
    """(key, tuple) facts stated in text: the number tuples after each mention of a key of ``keys``
    (normalised key -> tuple arity), up to the next key."""
    low = text.lower()[:20000]
    spans: list[tuple[int, int, str]] = []
    for key in sorted(keys, key=len, reverse=True):
        for m in re.finditer(_key_pattern(key), low):
            if not any(s <= m.start() < e or s < m.end() <= e for s, e, _ in spans):
                spans.append((m.start(), m.end(), key))
    spans.sort()
    out: list[Fact] = []
    for idx, (start, end, key) in enumerate(spans):
        stop = spans[idx + 1][0] if idx + 1 < len(spans) else min(len(low), end + 300)
        region = low[end:stop]
        arity = keys[key]
        tuples = [tuple(float(x) for x in re.findall(_NUM, m.group(1))) for m in _TUPLE_RE.finditer(region)]
        tuples = [t for t in tuples if len(t) == arity]
        if not tuples and "(" not in region and "[" not in region:
            nums = re.findall(_NUM, region)
            if len(nums) >= arity:
                tuples = [tuple(float(x) for x in nums[:arity])]
        out += [(key, t) for t in tuples]
    return list(dict.fromkeys(out))


def has_number_tuple(text: str) -> bool:
    """Whether ``text`` holds a tuple of numbers such as ``(3, 2)`` or ``[1.5, -2, 0]``."""
    return _TUPLE_RE.search(text) is not None


def extracted_position_items(data: list) -> list[Item]:
    """(normalised key, tuple) facts of a hybrid extraction (``[{"entity", "position"}, ...]``)."""
    items: list[Item] = []
    for entry in data[:500]:
        if not isinstance(entry, dict):
            continue
        pos = entry.get("position")
        name = entry.get("entity")
        if isinstance(name, str) and isinstance(pos, list) and pos and all(is_number(x) for x in pos):
            items.append(frozenset([(norm_key(name), tuple(float(x) for x in pos))]))
    return list(dict.fromkeys(items))
