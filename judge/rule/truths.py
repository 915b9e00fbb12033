"""The ground truth a text is compared with, built from an env state, and the scoring method.

The state is a trajectory's :class:`worldloop.common.contracts.schemas.State` or the env's own
``{"relations", "symbolic", "structured"}`` dict (``info["state"]``). The shared formats of the env
contract are read here; a state only its env family understands (Navigation's target, SVG's image
elements) is read by the family (:meth:`worldloop.envs.family.EnvFamily.truth`, asked through the
registry, the env's own family first) and turned into facts here. The scoring method is chosen from
what the text and the state offer (first match wins):

``symbolic``    the text contains a grid block as wide as ``state["symbolic"]``: facts are the
                (row, column, symbol) cells of the informative symbols (not walls/floor).
(family, first) a family truth that wins over coordinates (``FamilyTruth.before_coordinates``), and
                then is final, e.g. ``svg``: ``state["structured"]`` lists image elements: facts are
                (shape, colour) of the elements the agent sees (the target before its first answer,
                its own rendering after) plus, once rendered, the similarity (within the family's
                ``tolerance``).
``structured``  the text contains number tuples and ``state["structured"]`` holds numeric values:
                facts are (key, tuple) pairs, e.g. ("box", (3, 2)); tuples match within the env
                family's ``coord_tolerance`` (PrimitiveSkill: 10 units, App. D.1), else exactly.
(family)        any other family truth, e.g. ``navigation``: egocentric relations object-vs-agent
                ("the toaster is ahead"); P is measured against every relation the family lists
                (``known``) and R only against the ``essential`` ones (the target's).
``relations``   ``state["relations"]`` has App. D.1 sentences ("box0 is above and on the left side of
                the player"): facts are pairwise relations on two axes, parsed like agent text.
``structured``  (again) numeric values but no tuple in the text: the text can only miss them.
(none)          nothing to compare with: :func:`build_truth` returns None, "not applicable".

Public API::

    Truth(method, essential, known, lexicon=None, implicit=None, tolerance=0.0, keys={},
          background=frozenset(), info=None, kind="relations").compatible(a, b) -> bool
    state_parts(state) -> (relations, symbolic, structured)
    build_truth(text, state, env_name="") -> Truth | None
    extract_items(text, truth) -> list[Item]              # the text's facts in the truth's terms
    items_from_extraction(data, truth) -> list[Item]      # the hybrid extractor's JSON in the truth's terms
    entity_names(truth) -> list[str]                      # what the hybrid extractor is told exists
"""
from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping

from worldloop.common.contracts.schemas import State
from worldloop.envs.family import FamilyTruth, families, family_of
from worldloop.judge.rule.f1 import Fact, Item
from worldloop.judge.rule.parsing import (BASIC_COLORS, Lexicon, coordinate_facts, directions_of, extracted_position_items,
                                          extracted_relation_items, grid_block, grid_items, grid_rows, has_number_tuple,
                                          is_number, lexicon_from_sentences, make_fact, norm_key, relation_facts,
                                          relation_items, svg_element_facts, svg_text_facts)

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
    # how facts are read and compared: relations (a lexicon: relations, navigation, any family's
    # directions) | symbolic | structured | elements (image elements: svg)
    kind: str = "relations"

    def compatible(self, a: Fact, b: Fact) -> bool:
        if self.kind == "elements" and a[0] == b[0] == "similarity":
            return abs(a[1] - b[1]) <= self.tolerance + 1e-9
        if self.kind != "structured":
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
    relations, symbolic, structured = state_parts(state)

    if symbolic and symbolic.strip() and grid_block(text, symbolic):
        t = _symbolic_truth(symbolic)
        if t is not None:
            return t
    own = _family_truth(env_name, relations, symbolic, structured)
    if own is not None and own.before_coordinates:
        return _from_family(own)
    numeric = _structured_facts(structured)
    if numeric and has_number_tuple(text):
        return _structured_truth(numeric, structured, env_name)
    if own is not None:
        t = _from_family(own)
        if t is not None:
            return t
    if relations:
        lex, facts = _relations_truth(tuple(relations))
        if facts:
            return Truth("relations", list(facts), list(facts), lex, info=relations)
    if numeric:
        return _structured_truth(numeric, structured, env_name)
    return None


def _family_truth(env_name: str, relations: list[str], symbolic: str | None, structured: dict) -> FamilyTruth | None:
    """The first family truth of the state, the env's own family asked first."""
    own = family_of(env_name)
    for family in ([own] if own is not None else []) + [f for f in families() if f is not own]:
        t = family.truth(relations, symbolic, structured)
        if t is not None:
            return t
    return None


def _from_family(t: FamilyTruth) -> Truth | None:
    """A family's plain-data truth as facts (None when it holds none)."""
    if t.kind == "elements":
        return _elements_truth(t)
    if t.kind == "directions":
        return _directions_truth(t)
    raise ValueError(f"FamilyTruth.kind must be 'directions' or 'elements', got {t.kind!r}")


@functools.lru_cache(maxsize=4096)
def _relations_truth(relations: tuple[str, ...]) -> tuple[Lexicon, tuple[Fact, ...]]:
    """Lexicon and facts of a relation list (cached: a turn's state_after is the next one's state_before)."""
    lex = lexicon_from_sentences(relations)
    return lex, tuple(relation_facts(relations, lex))


def extract_items(text: str | None, truth: Truth) -> list[Item]:
    """The agent's facts in ``text`` in the form ``truth`` compares (never raises on any text)."""
    if not text or not isinstance(text, str):
        return []
    if truth.kind == "symbolic":
        return grid_items(text, truth.info, truth.background)
    if truth.kind == "structured":
        return [frozenset([f]) for f in coordinate_facts(text, truth.keys)]
    if truth.kind == "elements":
        return [frozenset([f]) for f in svg_text_facts(text, truth.keys)]
    return relation_items(text, truth.lexicon, truth.implicit)


def items_from_extraction(data: list[dict], truth: Truth) -> list[Item]:
    """Facts of a hybrid extraction (``[{"subject","relation","object"} | {"entity","position"}]``).

    Entries that name no known relation, or positions of unknown arity, count for nothing; an
    entity the truth lacks resolves to a literal id and can only be a false positive.
    """
    if truth.kind == "structured":
        return extracted_position_items(data)
    if truth.lexicon is None:
        return []
    return extracted_relation_items(data, truth.lexicon)


def entity_names(truth: Truth) -> list[str]:
    """What the hybrid extractor is told the scene contains (names only, never relations)."""
    if truth.kind == "structured":
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
    return Truth("symbolic", facts, facts, background=frozenset(background), info=symbolic,
                 kind="symbolic")


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


def _structured_truth(facts: list[Fact], structured: dict, env_name: str) -> Truth:
    keys: dict[str, int] = {}
    for k, tup in facts:
        keys.setdefault(k, len(tup))
    family = family_of(env_name)
    tolerance = family.coord_tolerance if family is not None else 0.0
    return Truth("structured", facts, facts, tolerance=tolerance, keys=keys, info=structured,
                 kind="structured")


# ----------------------------------------------------------------------------- family truths


def _directions_truth(t: FamilyTruth) -> Truth | None:
    """Relations of entities to a reference (Navigation: objects vs the agent), per axis."""
    lex = Lexicon(tuple(t.entities), aliases=dict(t.aliases), multiword=dict(t.surfaces))

    def facts_of(entity: str, direction: str, reference: str) -> list[Fact]:
        return [f for axis, value in directions_of(direction) if (f := make_fact(entity, axis, value, reference))]

    essential = list(dict.fromkeys(f for d in t.essential for f in facts_of(*d)))
    known = list(dict.fromkeys(f for d in t.known for f in facts_of(*d)))
    if not essential:
        return None
    return Truth(t.method, essential, known, lex, implicit=t.implicit, info=t.info)


def _elements_truth(t: FamilyTruth) -> Truth | None:
    """Image elements (SVG): (shape, colour) facts and, once rendered, the similarity."""
    facts = svg_element_facts(t.elements)
    if not facts:
        return None
    colors = sorted({f[2] for f in facts if f[0] == "el" and f[2]} | set(BASIC_COLORS) | {"grey"}, key=len, reverse=True)
    return Truth(t.method, facts, facts, keys={c: 0 for c in colors}, tolerance=t.tolerance, info=t.info,
                 kind="elements")
