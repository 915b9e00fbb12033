"""The words of spatial relations and the entity lexicon: what a word means, before any sentence is read.

Directions. ``DIR_PHRASES`` maps a word or phrase to its (axis, value) directions: axis ``v``
(above/below/same row), ``h`` (left/right/same column) or ``d`` (ahead/behind, Navigation);
"northwest" is two of them, "same place" is v=same and h=same. :func:`make_fact` makes the
canonical 4-tuple ``(a, b, axis, value)`` with ``a < b``, so "box is above player" and "player is
below box" give the same fact.

Entities. A :class:`Lexicon` holds the entity ids of one ground truth and maps mentions onto them:
"the box" -> box0 when there is one box and "any box" when there are several (a predicted item is
then a set of alternatives and counts once), "goal"/"target"/"destination" and "me"/"agent"/"player"
are synonyms when the truth lacks the exact word, an entity the truth does not have ("the box" in
FrozenLake) resolves to a literal id and can only be a false positive.

Public API::

    V_UP, V_DOWN, V_SAME, H_LEFT, H_RIGHT, H_SAME, D_AHEAD, D_BEHIND     # (axis, value) directions
    DIR_PHRASES, COPULAS, ARTICLES, singular(word) -> str                 # the vocabulary
    make_fact(subj, axis, value, obj) -> Fact | None    directions_of(text) -> list[(axis, value)]
    Lexicon(ids, aliases={}, multiword={}), lexicon_from_sentences(sentences) -> Lexicon
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable

from worldloop.judge.rule.f1 import Fact

V_UP, V_DOWN, V_SAME = ("v", "above"), ("v", "below"), ("v", "same")
H_LEFT, H_RIGHT, H_SAME = ("h", "left"), ("h", "right"), ("h", "same")
D_AHEAD, D_BEHIND = ("d", "ahead"), ("d", "behind")
_INVERSE = {"above": "below", "below": "above", "left": "right", "right": "left",
            "ahead": "behind", "behind": "ahead", "same": "same"}

DIR_PHRASES: dict[tuple[str, ...], tuple[tuple[str, str], ...]] = {}
for _words, _dirs in [
    (["same row", "same horizontal line", "same horizontal level", "same level", "level with",
      "horizontally aligned", "same y"], (V_SAME,)),
    (["same column", "same col", "same vertical line", "vertically aligned", "same x"], (H_SAME,)),
    (["same place", "same position", "same cell", "same square", "same spot", "same tile", "same location",
      "same grid", "same coordinates", "on top of", "same point"], (V_SAME, H_SAME)),
    (["above", "over", "up", "upward", "upwards", "higher", "upper", "top", "north", "northward"], (V_UP,)),
    (["below", "under", "beneath", "underneath", "down", "downward", "downwards", "lower", "bottom", "south",
      "southward"], (V_DOWN,)),
    (["left", "leftward", "leftwards", "west"], (H_LEFT,)),
    (["right", "rightward", "rightwards", "east"], (H_RIGHT,)),
    (["ahead", "forward", "forwards", "in front", "front"], (D_AHEAD,)),
    (["behind", "backward", "backwards", "back"], (D_BEHIND,)),
    (["northwest"], (V_UP, H_LEFT)), (["northeast"], (V_UP, H_RIGHT)),
    (["southwest"], (V_DOWN, H_LEFT)), (["southeast"], (V_DOWN, H_RIGHT)),
]:
    for _w in _words:
        DIR_PHRASES[tuple(_w.split())] = _dirs

COPULAS = frozenset("is are am be being been was were becomes become remain remains stay stays sit sits "
                    "lie lies located positioned placed situated appears appear seems seem end ends".split())
ARTICLES = frozenset(["the", "a", "an", "this", "that", "each", "every", "one", "both", "all", "some", "another"])

# surface word -> (class, family); families make synonyms interchangeable when the truth lacks a word
_FAMILY_WORDS: dict[str, tuple[str, ...]] = {
    "player": ("player", "players", "agent", "me", "i", "myself", "you", "yourself", "character", "taxi",
               "robot", "avatar", "person", "we", "us"),
    "box": ("box", "boxes", "crate", "crates"),
    "target": ("target", "targets", "goal", "goals", "destination", "destinations", "exit", "flag",
               "storage"),
    "hole": ("hole", "holes", "pit", "pits"),
    "passenger": ("passenger", "passengers"),
}
_PLAYER_SELF = frozenset(["me", "i", "myself", "you", "yourself", "we", "us", "agent", "character", "avatar",
                          "person", "robot"])


def singular(word: str) -> str:
    """The singular of a noun ("boxes" -> "box"); every word for the agent itself is "player"."""
    if word in _PLAYER_SELF:
        return "player"
    for suffix, repl in (("xes", "x"), ("ies", "y"), ("s", "")):
        if word.endswith(suffix) and len(word) > len(suffix) + 2 and not word.endswith("ss"):
            return word[: -len(suffix)] + repl
    return word


_WORD_FAMILY: dict[str, str] = {w: fam for fam, words in _FAMILY_WORDS.items() for w in words}
_CLASS_FAMILY: dict[str, str] = {singular(w): fam for w, fam in _WORD_FAMILY.items()}

# ----------------------------------------------------------------------------- relation facts


def make_fact(subj: str, axis: str, value: str, obj: str) -> Fact | None:
    """Canonical relation fact: "subj is <value> of obj" on ``axis``; None for a self-relation."""
    if subj == obj:
        return None
    if subj < obj:
        return (subj, obj, axis, value)
    return (obj, subj, axis, _INVERSE[value])


def directions_of(text: str) -> list[tuple[str, str]]:
    """The (axis, value) directions of the single direction words in ``text`` ("front-left" ->
    ahead, left)."""
    return [d for tok in re.findall(r"[a-z]+", text.lower()) for d in DIR_PHRASES.get((tok,), ())]


# ----------------------------------------------------------------------------- entity lexicon


@dataclass
class Lexicon:
    """The entity ids of one ground truth and how mentions in free text resolve onto them."""

    ids: tuple[str, ...]
    aliases: dict[str, str] = field(default_factory=dict)  # surface word -> id (Navigation "target")
    multiword: dict[tuple[str, ...], str] = field(default_factory=dict)  # ("counter","top") -> id

    def __post_init__(self) -> None:
        self.by_class: dict[str, list[str]] = {}
        for i in self.ids:
            cls, _ = _split_id(i)
            self.by_class.setdefault(cls, []).append(i)
        self.classes = frozenset(self.by_class) | frozenset(_WORD_FAMILY) | frozenset(self.aliases)
        names = "|".join(sorted((re.escape(c) for c in self.classes if c.isalpha()), key=len, reverse=True))
        # "box 1", "box_1", "box #1", "box-1" -> box1
        self.numbered = re.compile(rf"\b({names})\s*[#_-]?\s*(\d+)\b") if names else None

    def is_entity_word(self, word: str) -> bool:
        cls, _ = _split_id(word)
        return word in self.aliases or word in _WORD_FAMILY or cls in self.by_class \
            or singular(word) in self.by_class

    def resolve(self, word: str) -> tuple[str, ...]:
        """Candidate ids of a mention: exact id, then same class, then same family, else the literal."""
        if word in self.aliases:
            return (self.aliases[word],)
        if word in self.ids:
            return (word,)
        cls, index = _split_id(word)
        cls = singular(cls)
        family = _WORD_FAMILY.get(cls) or _CLASS_FAMILY.get(cls)
        pools = [self.by_class.get(cls, [])]
        if family:
            pools.append([i for c, ids in self.by_class.items() if _CLASS_FAMILY.get(c) == family for i in ids])
        for pool in pools:
            if not pool:
                continue
            if index is None:
                return tuple(pool)
            hit = [i for i in pool if _split_id(i)[1] == index]
            return tuple(hit) if hit else (f"{cls}{index}",)
        return (cls if index is None else f"{cls}{index}",)


def _split_id(word: str) -> tuple[str, str | None]:
    m = re.fullmatch(r"([a-z]+?)(\d+)", word)
    return (m.group(1), m.group(2)) if m else (word, None)


_ID_RE = re.compile(r"\b([a-z]+)(\d+)\b")


def lexicon_from_sentences(sentences: Iterable[str]) -> Lexicon:
    """Entity ids named in ground-truth relation sentences (ids like box0, family words, subjects)."""
    ids: list[str] = []
    for s in sentences:
        low = s.lower()
        found = [m.group(0) for m in _ID_RE.finditer(low) if not m.group(1).isdigit()]
        found += [w for w in re.findall(r"\b[a-z]+\b", low) if w in _WORD_FAMILY and singular(w) == w]
        m = re.match(r"\s*(?:the\s+)?([a-z]+\d*)\s+(?:is|are)\b", low)
        if m:
            found.append(m.group(1))
        m = re.search(r"\b(?:of|as|than|to|from)\s+(?:the\s+)?([a-z]+\d*)\s*\.?\s*$", low)
        if m:
            found.append(m.group(1))
        for w in found:
            if w not in ids and w not in ARTICLES and w not in COPULAS:
                ids.append(w)
    return Lexicon(tuple(ids))
