"""The ``vagen`` scoring mode (``judge.rule_mode: vagen``): Sokoban and FrozenLake scored as VAGEN's code does.

What VAGEN-Full trains with (RAGEN-AI/VAGEN @ d2b8b30; see ``VAGEN_REFERENCE_NOTES.md`` J1): the text is
turned into a list of items ``(object, vertical, horizontal)``, each relative to the **player**, with
generic object ids (every box is "box", every hole is "hole", the goal is "target"); the ground truth
is the same list built from the board (``get_relative_relation``: a smaller row is "above", a smaller
column is "left", equal is "same"). Then:

* **Sokoban** (``vagen/env/sokoban/service.py`` ``calculate_visual_reasoning_reward``, wrapper v3):
  an item matches a truth item only when **both** relations are equal; the matching is VAGEN's
  greedy ``calculate_f1_with_max_matching`` (``state_matching.py``), which is a maximum matching
  here because "equal on both axes" is an equivalence relation. F1 per type (``target``, ``box``)
  with F1 = 0 when nothing matched (also when both lists are empty), score = 0.5*F1_target +
  0.5*F1_box.
* **FrozenLake** (``vagen/env/frozenlake/service.py``, wrapper v2, ``calculate_visual_reasoning_reward
  _bipartite``): a maximum-weight **bipartite** matching per type where a pair is worth
  (vertical equal + horizontal equal) / 2, so one right axis is half credit (a relation the text
  leaves open never matches); F1 per type from the matched weight; weights target 0.7, hole 0.3,
  normalised over the types present in the text or the truth (a type in neither is left out, a
  type in both lists empty counts 1.0); no item of either type anywhere: 1.0 if both whole lists
  are empty, else 0.0.

Items the text states about other objects (Sokoban holes, FrozenLake boxes) count for nothing, as
VAGEN's filters drop them. Relations between two non-player objects ("the target is below the
box") are not items: VAGEN's extractor only reports positions relative to the player.

The extractor. VAGEN asks GPT-4.1-nano for the list; here it is deterministic: the sentences are
parsed by :func:`worldloop.judge.rule.relation_items` (the same parser as the per-axis F1 mode:
"player is above the box" = "box is below the player", negations and motion phrases dropped; a
direction with no object refers to the player, which the mode's prompt asks every relation to be
relative to), and each object mention's vertical and horizontal relation to the player are paired
into one item.
A clause names one object ("the box is below and to the right of me and the goal is above me"
gives two items); mentions of one specific object (``box0``, or "the box" on a one-box board) that
state one axis each are merged into one item; two generic mentions of the same type in one clause
("a box is below me and another left of me") are paired in order. The truth comes from the env's
own relation sentences (``state["relations"]``, every object relative to the player), so it needs
no positions.

Not reproduced (deliberately): VAGEN's Sokoban repetition rule (the score is *replaced* by -0.1 when
the whole text is among the top-5 strings, the current batch counted, and F1_target + F1_box < 0.7,
notes J2/J3). The judge's own repetition penalty (:mod:`worldloop.judge.scoring`) applies in both
modes. Nor is VAGEN's LLM: the extraction above is rule-based.

What is env-specific comes from the env's family through :mod:`worldloop.envs.family`: which envs
this mode scores and how (:class:`~worldloop.envs.family.VagenRule`: the object types, their weights,
``greedy`` or ``bipartite`` matching; the grid family declares Sokoban's and FrozenLake's above) and
the words objects go by (``EnvFamily.object_types``: "crate" is a box, "goal" a target). This module
holds the extractor and the two matchings.

Used by :mod:`worldloop.judge.scoring` for the ``rule`` scorer (and ``hybrid``'s extracted facts) of
the envs a family gives a VAGEN rule when the text is natural language (``Truth.method ==
"relations"``); other envs and state formats keep the per-axis F1. Public API::

    vagen_kind(env_name) -> "sokoban" | "frozenlake" | None     # an env with a family VagenRule
    truth_items(truth) -> list[VItem]            # VItem = (type, vertical, horizontal)
    text_items(text, truth) -> list[VItem]
    items_from_facts(items, truth) -> list[VItem]
    score_vitems(kind, predicted, truth_items) -> VagenResult
    vagen_score(text, truth, env_name) -> VagenResult | None
    vagen_score_facts(items, truth, env_name) -> VagenResult | None   # hybrid's extracted facts
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from typing import Iterable

from worldloop.envs.family import VagenRule, env_name_of, family_of, object_types
from worldloop.judge.rule import Item, Truth, relation_items

VItem = tuple  # (type, vertical | None, horizontal | None)

_INVERSE = {"above": "below", "below": "above", "left": "right", "right": "left", "same": "same"}
_SENTENCE = re.compile(r"(?<!\d)[.!?;\n]+(?!\d)")
# a new clause starts where an object or the player is the subject of a verb (the grid family's object
# words as VAGEN's prompts use them)
_CLAUSE = re.compile(
    r"(?:,\s*|\s+)(?:(?:and|but|while|whereas)\s+)?(?=(?:(?:the|a|an|another|one|each)\s+)?"
    r"(?:box(?:es)?|crates?|targets?|goals?|destinations?|holes?|pits?|player|agent|i|you)\s*[#_-]?\s*\d*\s+"
    r"(?:is|are|am|will|was|were|would|should|sits|lies|appears|remains|stays|can|must)\b)",
    re.IGNORECASE)
MAX_ITEMS = 256  # predicted items per type considered (the text is capped at 20000 characters anyway)


def vagen_rule(env_name: str | None) -> VagenRule | None:
    """The VAGEN rule the env's family gives the env (name or gymnasium id), else None."""
    family = family_of(env_name)
    return None if family is None else family.vagen.get(env_name_of(env_name))


def vagen_kind(env_name: str | None) -> str | None:
    """The env's short name (``"sokoban"``, ``"frozenlake"``) when its family gives it a VAGEN rule, else None."""
    return env_name_of(env_name) if vagen_rule(env_name) is not None else None


def _type_of(entity: str, words: dict[str, str] | None = None) -> str | None:
    m = re.fullmatch(r"([a-z]+?)\d*", entity)
    return (words if words is not None else object_types()).get(m.group(1)) if m else None


def _player_facts(item: Item, player: frozenset) -> tuple | None:
    """``(key, axis, value)`` of one relation item about an object relative to the player, else None.

    ``key`` = (type, the ids the mention may mean); value is the object's relation to the player."""
    ents, rel = set(), None
    words = object_types()
    for a, b, axis, value in item:
        if axis not in ("v", "h"):
            continue
        if b in player and a not in player:
            ent, val = a, value
        elif a in player and b not in player:
            ent, val = b, _INVERSE.get(value)
        else:
            continue
        if val is None:
            continue
        ents.add(ent)
        rel = rel or (axis, val)
    if not ents or rel is None:
        return None
    types = {_type_of(e, words) for e in ents}
    if len(types) != 1 or None in types:
        return None
    return ((types.pop(), frozenset(ents)), rel[0], rel[1])


def _group(facts: Iterable[tuple]) -> list[tuple]:
    """Pair the vertical and horizontal relations of each mention key, in order: [(key, v, h)]."""
    by_key: dict = {}
    for key, axis, value in facts:
        axes = by_key.setdefault(key, {"v": [], "h": []})
        if value not in axes[axis]:
            axes[axis].append(value)
    return [(key, v, h) for key, axes in by_key.items() for v, h in itertools.zip_longest(axes["v"], axes["h"])]


def _facts(text: str, truth: Truth, player: frozenset) -> list[tuple]:
    # a direction with no object at all refers to the player ("box and target below, same column as
    # the player"): the mode's prompt asks for every relation relative to the player
    return [f for f in (_player_facts(i, player) for i in relation_items(text, truth.lexicon, "player")) if f]


def _merge(grouped: list[tuple]) -> list[tuple]:
    """Mentions of one specific object: complementary halves become one item, repeats count once."""
    out: list[list] = []
    for key, v, h in grouped:
        if len(key[1]) == 1:
            if any(o[0] == key and o[1] == v and o[2] == h for o in out):
                continue
            half = next((o for o in out if o[0] == key and _complementary(o[1], o[2], v, h)), None)
            if half is not None:
                half[1] = half[1] if half[1] is not None else v
                half[2] = half[2] if half[2] is not None else h
                continue
        out.append([key, v, h])
    return [(k, v, h) for k, v, h in out]


def _complementary(v1, h1, v2, h2) -> bool:
    """One mention states only the vertical relation and the other only the horizontal one."""
    return (v1 is not None and h1 is None and v2 is None and h2 is not None) or \
        (v1 is None and h1 is not None and v2 is not None and h2 is None)


def text_items(text: str | None, truth: Truth) -> list[VItem]:
    """The ``(type, vertical, horizontal)`` items ``text`` states relative to the player (never raises)."""
    if not text or not isinstance(text, str) or truth.lexicon is None:
        return []
    text = text[:20000]
    player = frozenset(truth.lexicon.resolve("player"))
    whole = _facts(text, truth, player)
    if not whole:
        return []
    clauses = [c for s in _SENTENCE.split(text) for c in _CLAUSE.split(s) if c.strip()]
    fine = [_facts(c, truth, player) for c in clauses]
    if set(whole) <= {f for group in fine for f in group}:
        grouped = [g for group in fine for g in _group(group)]
    else:  # a clause needs its context (a carried subject, "relative to X, ...", "it"): one group
        grouped = _group(whole)
    return [(key[0], v, h) for key, v, h in _merge(grouped)]


def items_from_facts(items: Iterable[Item], truth: Truth) -> list[VItem]:
    """VAGEN items of already extracted relation facts (``hybrid``'s LLM extraction), one group."""
    if truth.lexicon is None:
        return []
    player = frozenset(truth.lexicon.resolve("player"))
    facts = [f for f in (_player_facts(i, player) for i in items) if f]
    return [(key[0], v, h) for key, v, h in _merge(_group(facts))]


def truth_items(truth: Truth) -> list[VItem]:
    """The truth as VAGEN builds it: every object's (vertical, horizontal) relation to the player."""
    if truth.lexicon is None:
        return []
    player = frozenset(truth.lexicon.resolve("player"))
    rel: dict[str, dict[str, str]] = {}
    for fact in truth.essential:
        f = _player_facts(frozenset([fact]), player)
        if f is not None:
            (_, ents), axis, value = f
            rel.setdefault(next(iter(ents)), {})[axis] = value
    return [(_type_of(e), r.get("v"), r.get("h")) for e, r in rel.items()]


# ----------------------------------------------------------------------------- scores


@dataclass
class VagenResult:
    score: float
    f1: dict[str, float]  # per type that took part
    predicted: int  # items of the env's types in the text
    truth: int
    method: str = "vagen"
    matching: str = ""
    detail: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"score": self.score, "method": self.method, "mode": "vagen", "matching": self.matching,
                "f1": dict(self.f1), "predicted": self.predicted, "truth": self.truth}


def greedy_matches(predicted: list[VItem], truth: list[VItem]) -> int:
    """VAGEN's ``calculate_f1_with_max_matching``: each truth item takes the first unused equal item."""
    used: set[int] = set()
    n = 0
    for t in truth:
        for j, p in enumerate(predicted):
            if j not in used and p[1] == t[1] and p[2] == t[2]:
                used.add(j)
                n += 1
                break
    return n


def _similarity(p: VItem, t: VItem) -> float:
    return ((p[1] is not None and p[1] == t[1]) + (p[2] is not None and p[2] == t[2])) / 2.0


def assignment_weight(weights: list[list[float]]) -> float:
    """Maximum total weight of a matching in a dense non-negative [n][m] matrix (Hungarian method).

    The same optimum as scipy's ``linear_sum_assignment(-w)`` that VAGEN calls (weights >= 0, so a
    full assignment of the smaller side is a maximum-weight matching)."""
    if not weights or not weights[0]:
        return 0.0
    if len(weights) > len(weights[0]):
        weights = [list(col) for col in zip(*weights)]
    n, m = len(weights), len(weights[0])
    inf = float("inf")
    u, v = [0.0] * (n + 1), [0.0] * (m + 1)
    owner, way = [0] * (m + 1), [0] * (m + 1)  # owner[j]: row matched to column j (1-based, 0 = none)
    for i in range(1, n + 1):
        owner[0], j0 = i, 0
        minv, used = [inf] * (m + 1), [False] * (m + 1)
        while True:
            used[j0] = True
            i0, delta, j1 = owner[j0], inf, 0
            for j in range(1, m + 1):
                if not used[j]:
                    cur = -weights[i0 - 1][j - 1] - u[i0] - v[j]
                    if cur < minv[j]:
                        minv[j], way[j] = cur, j0
                    if minv[j] < delta:
                        delta, j1 = minv[j], j
            for j in range(m + 1):
                if used[j]:
                    u[owner[j]] += delta
                    v[j] -= delta
                else:
                    minv[j] -= delta
            j0 = j1
            if owner[j0] == 0:
                break
        while j0:
            j1 = way[j0]
            owner[j0] = owner[j1]
            j0 = j1
    return float(sum(weights[owner[j] - 1][j - 1] for j in range(1, m + 1) if owner[j]))


def _f1(matched: float, n_pred: int, n_truth: int, both_empty: float) -> float:
    if n_pred == 0 and n_truth == 0:
        return both_empty
    p = matched / n_pred if n_pred else 0.0
    r = matched / n_truth if n_truth else 0.0
    return 2 * p * r / (p + r) if p + r > 0 else 0.0


def score_vitems(kind: str, predicted: list[VItem], truth: list[VItem]) -> VagenResult:
    """VAGEN's score of ``predicted`` against ``truth`` for env ``kind`` (see the module docstring)."""
    rule = vagen_rule(kind)
    if rule is None:
        raise ValueError(f"kind: no env family gives {kind!r} a VAGEN rule")
    weights = rule.weights
    pred = {t: [p for p in predicted if p[0] == t][:MAX_ITEMS] for t in weights}
    true = {t: [x for x in truth if x[0] == t] for t in weights}
    n_pred, n_true = sum(map(len, pred.values())), sum(map(len, true.values()))
    f1: dict[str, float] = {}
    if rule.matching == "greedy":
        for t in weights:
            f1[t] = _f1(greedy_matches(pred[t], true[t]), len(pred[t]), len(true[t]), 0.0)
        score = sum(weights[t] * f1[t] for t in weights)
        return VagenResult(score, f1, n_pred, n_true, matching="greedy, both axes")
    present = [t for t in weights if pred[t] or true[t]]
    if not present:
        score = 1.0 if not predicted and not truth else 0.0
        return VagenResult(score, f1, n_pred, n_true, matching="bipartite, half credit per axis")
    for t in present:
        matched = assignment_weight([[_similarity(p, x) for x in true[t]] for p in pred[t]]) if pred[t] and true[t] else 0.0
        f1[t] = _f1(matched, len(pred[t]), len(true[t]), 1.0)
    score = sum(weights[t] * f1[t] for t in present) / sum(weights[t] for t in present)
    return VagenResult(score, f1, n_pred, n_true, matching="bipartite, half credit per axis")


def _applies(truth: Truth | None, env_name: str) -> str | None:
    kind = vagen_kind(env_name)
    if kind is None or truth is None or truth.method != "relations" or truth.lexicon is None:
        return None
    return kind


def vagen_score(text: str | None, truth: Truth | None, env_name: str) -> VagenResult | None:
    """The ``vagen`` score of ``text``; None where the mode does not apply (another env, or a truth
    that is not the natural-language relations of the board: the per-axis F1 scores those)."""
    kind = _applies(truth, env_name)
    return None if kind is None else score_vitems(kind, text_items(text, truth), truth_items(truth))


def vagen_score_facts(items: Iterable[Item], truth: Truth | None, env_name: str) -> VagenResult | None:
    """As :func:`vagen_score` for relation facts an extractor already produced (``hybrid``)."""
    kind = _applies(truth, env_name)
    return None if kind is None else score_vitems(kind, items_from_facts(items, truth), truth_items(truth))
