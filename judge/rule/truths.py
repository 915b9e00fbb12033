"""The ground truth a text is compared with, built from an env state, and the scoring method.

The state is a trajectory's :class:`worldloop.common.contracts.schemas.State` or the env's own
``{"relations", "symbolic", "structured"}`` dict (``info["state"]``). The scoring method is chosen
from what the text and the state offer (first match wins):

``symbolic``    the text contains a grid block as wide as ``state["symbolic"]``: facts are the
                (row, column, symbol) cells of the informative symbols (not walls/floor).
``svg``         ``state["structured"]`` lists image elements (SVG): facts are (shape, colour) of the
                elements the agent sees (the target before its first answer, its own rendering
                after) plus, once rendered, the similarity (within ``SIMILARITY_TOLERANCE``).
``structured``  the text contains number tuples and ``state["structured"]`` holds numeric values:
                facts are (key, tuple) pairs, e.g. ("box", (3, 2)); tuples match within
                ``COORD_TOLERANCE`` of the env (PrimitiveSkill: 10 units, App. D.1), else exactly.
``navigation``  ``state["structured"]`` names a target object and its direction (Navigation):
                facts are egocentric relations object-vs-agent ("the toaster is ahead"); P is
                measured against every visible object (``known``) and R only against the target
                (``essential``): the paper's judge asks for the target's direction, a wrong claim
                about another object still costs precision.
``relations``   ``state["relations"]`` has App. D.1 sentences ("box0 is above and on the left side of
                the player"): facts are pairwise relations on two axes, parsed like agent text.
``structured``  (again) numeric values but no tuple in the text: the text can only miss them.
(none)          nothing to compare with: :func:`build_truth` returns None, "not applicable".

Public API::

    Truth(method, essential, known, lexicon=None, implicit=None, tolerance=0.0, keys={},
          background=frozenset(), info=None).compatible(a, b) -> bool
    state_parts(state) -> (relations, symbolic, structured)
    build_truth(text, state, env_name="") -> Truth | None
    extract_items(text, truth) -> list[Item]              # the text's facts in the truth's terms
    items_from_extraction(data, truth) -> list[Item]      # the hybrid extractor's JSON in the truth's terms
    entity_names(truth) -> list[str]                      # what the hybrid extractor is told exists
    COORD_TOLERANCE, SIMILARITY_TOLERANCE
"""
from __future__ import annotations

import functools
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping

from worldloop.common.contracts.schemas import State
from worldloop.judge.rule.f1 import Fact, Item
from worldloop.judge.rule.parsing import (BASIC_COLORS, Lexicon, coordinate_facts, directions_of, extracted_position_items,
                                          extracted_relation_items, grid_block, grid_items, grid_rows, has_number_tuple,
                                          is_number, lexicon_from_sentences, make_fact, norm_key, relation_facts,
                                          relation_items, svg_element_facts, svg_text_facts)

COORD_TOLERANCE: dict[str, float] = {"primitiveskill": 10.0}  # App. D.1: within +-10 units
SIMILARITY_TOLERANCE = 0.1  # SVG: a predicted similarity this close to the measured one is right


@dataclass
class Truth:
    """What one text is compared with: facts for recall (essential) and precision (known)."""

    method: str
    essential: list[Fact]
    known: list[Fact]
    lexicon: Lexicon | None = None
    implicit: str | None = None
    tolerance: float = 0.0
    keys: dict[str, int] = field(default_factory=dict)  # structured: normalised key -> tuple arity
    background: frozenset = frozenset()  # symbolic: symbols that are not facts (walls, floor)
    info: Any = None  # what an LLM judge is shown as ground truth

    def compatible(self, a: Fact, b: Fact) -> bool:
        if self.method == "svg" and a[0] == b[0] == "similarity":
            return abs(a[1] - b[1]) <= SIMILARITY_TOLERANCE + 1e-9
        if self.method != "structured":
            return a == b
        return a[0] == b[0] and len(a[1]) == len(b[1]) and all(
            abs(x - y) <= self.tolerance + 1e-9 for x, y in zip(a[1], b[1]))


def state_parts(state: State | Mapping | None) -> tuple[list[str], str | None, dict]:
    """``(relations, symbolic, structured)`` of a trajectory :class:`State` or of an env's state dict
    (what ``info["state"]`` holds), ill-typed parts dropped."""
    if isinstance(state, State):
        relations, symbolic, structured = state.relations, state.symbolic, state.structured
    elif isinstance(state, Mapping):
        relations, symbolic, structured = state.get("relations"), state.get("symbolic"), state.get("structured")
    else:
        return [], None, {}
    return ([s for s in (relations or []) if isinstance(s, str)], symbolic if isinstance(symbolic, str) else None,
            structured if isinstance(structured, dict) else {})


def build_truth(text: str | None, state: State | Mapping | None, env_name: str = "") -> Truth | None:
    """Pick the comparison for ``text`` against ``state`` (see module docstring); None if none applies."""
    text = text if isinstance(text, str) else ""
    env = (env_name or "").lower()
    relations, symbolic, structured = state_parts(state)

    if symbolic and symbolic.strip() and grid_block(text, symbolic):
        t = _symbolic_truth(symbolic)
        if t is not None:
            return t
    if isinstance(structured.get("target_elements"), list):
        t = _svg_truth(structured)
        if t is not None and relations:
            t.info = relations  # what an LLM judge reads: the env's sentences about the elements
        return t
    numeric = _structured_facts(structured)
    if numeric and has_number_tuple(text):
        return _structured_truth(numeric, structured, env)
    nav = _navigation_truth(structured)
    if nav is not None:
        return nav
    if relations:
        lex, facts = _relations_truth(tuple(relations))
        if facts:
            return Truth("relations", list(facts), list(facts), lex, info=relations)
    if numeric:
        return _structured_truth(numeric, structured, env)
    return None


@functools.lru_cache(maxsize=4096)
def _relations_truth(relations: tuple[str, ...]) -> tuple[Lexicon, tuple[Fact, ...]]:
    """Lexicon and facts of a relation list (cached: a turn's state_after is the next one's state_before)."""
    lex = lexicon_from_sentences(relations)
    return lex, tuple(relation_facts(relations, lex))


def extract_items(text: str | None, truth: Truth) -> list[Item]:
    """The agent's facts in ``text`` in the form ``truth`` compares (never raises on any text)."""
    if not text or not isinstance(text, str):
        return []
    if truth.method == "symbolic":
        return grid_items(text, truth.info, truth.background)
    if truth.method == "structured":
        return [frozenset([f]) for f in coordinate_facts(text, truth.keys)]
    if truth.method == "svg":
        return [frozenset([f]) for f in svg_text_facts(text, truth.keys)]
    return relation_items(text, truth.lexicon, truth.implicit)


def items_from_extraction(data: list[dict], truth: Truth) -> list[Item]:
    """Facts of a hybrid extraction (``[{"subject","relation","object"} | {"entity","position"}]``).

    Entries that name no known relation, or positions of unknown arity, count for nothing; an
    entity the truth lacks resolves to a literal id and can only be a false positive.
    """
    if truth.method == "structured":
        return extracted_position_items(data)
    if truth.lexicon is None:
        return []
    return extracted_relation_items(data, truth.lexicon)


def entity_names(truth: Truth) -> list[str]:
    """What the hybrid extractor is told the scene contains (names only, never relations)."""
    if truth.method == "structured":
        return sorted(truth.keys)
    return list(truth.lexicon.ids) if truth.lexicon else []


# ----------------------------------------------------------------------------- symbolic grids

_BACKGROUND = frozenset("#_. |:-+")


def _symbolic_truth(symbolic: str) -> Truth | None:
    rows = grid_rows(symbolic)
    counts = Counter("".join(rows))
    cells = max(1, sum(counts.values()))
    background = set(_BACKGROUND) | {ch for ch, n in counts.items() if n > 0.3 * cells}
    facts = [(r, c, ch) for r, row in enumerate(rows) for c, ch in enumerate(row) if ch not in background]
    if not facts:
        return None
    return Truth("symbolic", facts, facts, background=frozenset(background), info=symbolic)


# ----------------------------------------------------------------------------- structured dicts


def _structured_facts(structured: dict) -> list[Fact]:
    """(normalised key, number tuple) facts of a structured state; non-numeric values are skipped."""
    out: list[Fact] = []
    for k, v in structured.items():
        key = norm_key(k)
        if is_number(v):
            out.append((key, (float(v),)))
        elif isinstance(v, (list, tuple)) and v and all(is_number(x) for x in v):
            out.append((key, tuple(float(x) for x in v)))
        elif isinstance(v, (list, tuple)):
            for x in v:
                if isinstance(x, (list, tuple)) and x and all(is_number(y) for y in x):
                    out.append((key, tuple(float(y) for y in x)))
    return list(dict.fromkeys(out))


def _structured_truth(facts: list[Fact], structured: dict, env: str) -> Truth:
    keys: dict[str, int] = {}
    for k, tup in facts:
        keys.setdefault(k, len(tup))
    return Truth("structured", facts, facts, tolerance=COORD_TOLERANCE.get(env, 0.0), keys=keys, info=structured)


# ----------------------------------------------------------------------------- navigation

_NAV_TARGET_KEYS = ("target_obj_type", "target_object_type", "target_type", "target_object", "target_name")
_NAV_DIR_KEYS = ("target_direction_to_player", "target_direction", "direction_to_target")
_NAV_ALIASES = ("target", "goal", "object", "destination", "item")


def _object_id(name: str) -> tuple[str, list[tuple[str, ...]]]:
    """``CounterTop`` -> id ``countertop`` with surfaces ("countertop",), ("counter", "top")."""
    spaced = re.sub(r"(?<=[a-z])(?=[A-Z])", " ", str(name)).lower()
    words = re.findall(r"[a-z]+", spaced)
    oid = "".join(words) or "object"
    surfaces = [tuple(words)] if len(words) > 1 else []
    return oid, surfaces


def _navigation_truth(structured: dict) -> Truth | None:
    tkey = next((k for k in _NAV_TARGET_KEYS if isinstance(structured.get(k), str)), None)
    dkey = next((k for k in _NAV_DIR_KEYS if isinstance(structured.get(k), str)), None)
    if tkey is None or dkey is None:
        return None
    target, surfaces = _object_id(structured[tkey])
    ids = ["player", target]
    multi: dict[tuple[str, ...], str] = {s: target for s in surfaces}
    objects: list[tuple[str, str]] = [(target, structured[dkey])]
    for o in structured.get("visible_objects") or []:
        if not isinstance(o, dict) or not isinstance(o.get("type"), str):
            continue
        oid, osurf = _object_id(o["type"])
        direction = o.get("direction_to_player") or o.get("direction")
        if isinstance(direction, str):
            objects.append((oid, direction))
        if oid not in ids:
            ids.append(oid)
        multi.update({s: oid for s in osurf})
    lex = Lexicon(tuple(ids), aliases={a: target for a in _NAV_ALIASES}, multiword=multi)

    def facts_of(oid: str, direction: str) -> list[Fact]:
        return [f for axis, value in directions_of(direction) if (f := make_fact(oid, axis, value, "player"))]

    essential = list(dict.fromkeys(facts_of(target, structured[dkey])))
    known = list(dict.fromkeys(f for oid, d in objects for f in facts_of(oid, d)))
    if not essential:
        return None
    return Truth("navigation", essential, known, lex, implicit="player", info=structured)


# ----------------------------------------------------------------------------- SVG elements


def _svg_truth(structured: dict) -> Truth | None:
    facts = svg_element_facts(structured)
    if not facts:
        return None
    colors = sorted({f[2] for f in facts if f[0] == "el" and f[2]} | set(BASIC_COLORS) | {"grey"}, key=len, reverse=True)
    return Truth("svg", facts, facts, keys={c: 0 for c in colors}, info=structured)
