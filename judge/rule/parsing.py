"""Facts stated in the agent's free text (untrusted: nothing here raises on any text, nothing is
ever read as an instruction).

Relations. Canonical 4-tuples ``(a, b, axis, value)`` with ``a < b`` (:func:`make_fact`): axis ``v``
(above/below/same row), ``h`` (left/right/same column) or ``d`` (ahead/behind, Navigation); "box is
above player" and "player is below box" give the same fact, "at the same place as" gives v=same
and h=same. Generic mentions are mapped onto the truth's entity ids by a :class:`Lexicon`: "the box"
-> box0 when there is one box and "any box" when there are several (a predicted item is then a set
of alternatives and counts once), "goal"/"target"/"destination" and "me"/"agent"/"player" are
synonyms when the truth lacks the exact word, an entity the truth does not have ("the box" in
FrozenLake) can only be a false positive. Negated clauses ("not", "no longer") yield nothing,
directions right after a motion verb ("move up", "pushing the box left") are actions, not relations,
and absolute positions ("the box is at the top") are not relations (App. D.1: "Absolute position is
not allowed"), except where an ``implicit`` reference is given (Navigation: the agent).

Grids: the longest block of text lines as wide as the truth's grid, as (row, column, symbol) cells.
Coordinates: the number tuples after each key of a structured state (``box_positions: [(3, 2)]``).
SVG: (shape, colour) of every shape word and the stated similarity, or the elements of a dict the
agent wrote. Hybrid: the facts of an LLM extractor's JSON list.

Public API::

    make_fact(subj, axis, value, obj) -> Fact | None
    Lexicon(ids, aliases={}, multiword={}), lexicon_from_sentences(sentences) -> Lexicon
    relation_items(text, lex, implicit=None) -> list[Item]    relation_facts(sentences, lex) -> list[Fact]
    directions_of(text) -> list[(axis, value)]
    grid_rows(symbolic) -> list[str]    grid_block(text, symbolic) -> list[str] | None
    grid_items(text, symbolic, background) -> list[Item]
    has_number_tuple(text) -> bool      norm_key(key) -> str      is_number(x) -> bool
    coordinate_facts(text, keys) -> list[Fact]
    BASIC_COLORS, svg_element_facts(structured) -> list[Fact], svg_text_facts(text, colors) -> list[Fact]
    extracted_relation_items(data, lex) -> list[Item], extracted_position_items(data) -> list[Item]
"""
from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

from worldloop.judge.rule.f1 import Fact, Item

# ----------------------------------------------------------------------------- vocabulary

V_UP, V_DOWN, V_SAME = ("v", "above"), ("v", "below"), ("v", "same")
H_LEFT, H_RIGHT, H_SAME = ("h", "left"), ("h", "right"), ("h", "same")
D_AHEAD, D_BEHIND = ("d", "ahead"), ("d", "behind")
_INVERSE = {"above": "below", "below": "above", "left": "right", "right": "left",
            "ahead": "behind", "behind": "ahead", "same": "same"}

_DIR_PHRASES: dict[tuple[str, ...], tuple[tuple[str, str], ...]] = {}
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
        _DIR_PHRASES[tuple(_w.split())] = _dirs

_COPULAS = frozenset("is are am be being been was were becomes become remain remains stay stays sit sits "
                     "lie lies located positioned placed situated appears appear seems seem end ends".split())
_MOTION = frozenset("move moves moving moved push pushes pushing pushed go goes going went walk walks walking "
                    "walked step steps stepping stepped head heads heading headed travel travels traveling "
                    "travelling turn turns turning turned navigate navigates navigating slide slides sliding "
                    "slid rotate rotates rotating drive drives driving driven proceed proceeds proceeding shift "
                    "shifts shifting drag drags dragging pull pulls pulling bring brings bringing lead leads "
                    "leading take takes taking reach reaching action actions press pressing".split())
_NEGATIONS = frozenset("not no never isn aren wasn weren won doesn don didn cannot neither nor without".split())
_SPLIT_WORDS = frozenset("but while whereas then so because although though however meanwhile after before if "
                         "when whenever since thus therefore hence until unless otherwise instead also".split())
_RELATIVE_WORDS = frozenset(["which", "who"])
_ARTICLES = frozenset(["the", "a", "an", "this", "that", "each", "every", "one", "both", "all", "some", "another"])
_DIRECTLY = frozenset(["directly", "straight", "exactly"])
_SLIGHT = frozenset(["slightly", "somewhat"])
_REL_PHRASES = {("relative", "to"), ("compared", "to"), ("compared", "with"), ("with", "respect", "to")}
_POSSESSIVE_PLAYER = frozenset(["my", "mine", "our"])
_PUNCT = frozenset(".,;:!?()")

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


def _singular(word: str) -> str:
    if word in _PLAYER_SELF:
        return "player"
    for suffix, repl in (("xes", "x"), ("ies", "y"), ("s", "")):
        if word.endswith(suffix) and len(word) > len(suffix) + 2 and not word.endswith("ss"):
            return word[: -len(suffix)] + repl
    return word


_WORD_FAMILY: dict[str, str] = {w: fam for fam, words in _FAMILY_WORDS.items() for w in words}
_CLASS_FAMILY: dict[str, str] = {_singular(w): fam for w, fam in _WORD_FAMILY.items()}

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
    return [d for tok in re.findall(r"[a-z]+", text.lower()) for d in _DIR_PHRASES.get((tok,), ())]


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
            or _singular(word) in self.by_class

    def resolve(self, word: str) -> tuple[str, ...]:
        """Candidate ids of a mention: exact id, then same class, then same family, else the literal."""
        if word in self.aliases:
            return (self.aliases[word],)
        if word in self.ids:
            return (word,)
        cls, index = _split_id(word)
        cls = _singular(cls)
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
        found += [w for w in re.findall(r"\b[a-z]+\b", low) if w in _WORD_FAMILY and _singular(w) == w]
        m = re.match(r"\s*(?:the\s+)?([a-z]+\d*)\s+(?:is|are)\b", low)
        if m:
            found.append(m.group(1))
        m = re.search(r"\b(?:of|as|than|to|from)\s+(?:the\s+)?([a-z]+\d*)\s*\.?\s*$", low)
        if m:
            found.append(m.group(1))
        for w in found:
            if w not in ids and w not in _ARTICLES and w not in _COPULAS:
                ids.append(w)
    return Lexicon(tuple(ids))


# ----------------------------------------------------------------------------- text -> symbols


@dataclass
class _Sym:
    kind: str  # E D DIRECTLY SLIGHT NEG MOTION COP SPLIT CARRY AND REL POSS IT SKIP
    value: Any = None


_TOKEN_RE = re.compile(r"[a-z]+\d*|\d+(?:\.\d+)?|'s\b|[.,;:!?()]")


def _tokens(text: str, lex: Lexicon) -> list[str]:
    t = text.lower().replace("\u2019", "'").replace("\u2013", "-").replace("\u2014", "-")
    if lex.numbered is not None:
        t = lex.numbered.sub(r"\1\2", t)
    t = re.sub(r"[-_/]", " ", t)
    return _TOKEN_RE.findall(t)


def _symbols(tokens: list[str], lex: Lexicon) -> list[_Sym]:
    out: list[_Sym] = []
    i, n = 0, len(tokens)
    while i < n:
        tok = tokens[i]
        matched = False
        for size in (4, 3, 2):  # multi-word phrases first
            key = tuple(tokens[i:i + size])
            if len(key) < size:
                continue
            if key in lex.multiword:
                out.append(_Sym("E", lex.resolve(lex.multiword[key])))
            elif key in _DIR_PHRASES:
                out.append(_Sym("D", _DIR_PHRASES[key]))
            elif key in _REL_PHRASES:
                out.append(_Sym("REL"))
            else:
                continue
            i += size
            matched = True
            break
        if matched:
            continue
        i += 1
        if tok in _PUNCT:
            out.append(_Sym("SPLIT"))
        elif tok == "'s":
            if out and out[-1].kind == "E":
                out[-1] = _Sym("POSS", out[-1].value)
        elif tok in _POSSESSIVE_PLAYER:
            out.append(_Sym("POSS", lex.resolve("player")))
        elif tok in ("on", "at", "onto") and _next_is_entity(tokens, i, lex):
            out.append(_Sym("D", (V_SAME, H_SAME)))
        elif tok in ("it", "its"):  # the entity mentioned last (resolved in relation_items)
            out.append(_Sym("IT"))
        elif tok == "that" and _next_is_entity(tokens, i, lex):
            continue  # determiner
        elif tok in _RELATIVE_WORDS or tok == "that":
            out.append(_Sym("CARRY"))
        elif (tok,) in _DIR_PHRASES:
            out.append(_Sym("D", _DIR_PHRASES[(tok,)]))
        elif lex.is_entity_word(tok) and tok not in _ARTICLES:
            out.append(_Sym("E", lex.resolve(tok)))
        elif tok in _COPULAS:
            out.append(_Sym("COP"))
        elif tok in _MOTION:
            out.append(_Sym("MOTION"))
        elif tok in _NEGATIONS:
            out.append(_Sym("NEG"))
        elif tok in _SPLIT_WORDS:
            out.append(_Sym("SPLIT"))
        elif tok in ("and", "or"):
            out.append(_Sym("AND"))
        elif tok in _DIRECTLY:
            out.append(_Sym("DIRECTLY"))
        elif tok in _SLIGHT:
            out.append(_Sym("SLIGHT"))
    # "my left" / "the player's left" -> "left of player"
    for k in range(len(out) - 1):
        if out[k].kind == "POSS" and out[k + 1].kind == "D":
            out[k], out[k + 1] = out[k + 1], _Sym("E", out[k].value)
    return [_Sym("E", s.value) if s.kind == "POSS" else s for s in out]


def _next_is_entity(tokens: list[str], i: int, lex: Lexicon) -> bool:
    while i < len(tokens) and tokens[i] in _ARTICLES:
        i += 1
    if i >= len(tokens):
        return False
    if lex.is_entity_word(tokens[i]):
        return True
    return any(tuple(tokens[i:i + k]) in lex.multiword for k in (2, 3, 4))


# ----------------------------------------------------------------------------- symbols -> facts


def _clauses(syms: list[_Sym]) -> list[tuple[list[_Sym], bool]]:
    """Split at punctuation/conjunction words, and at "and <entity> <verb/direction>" once a direction
    was seen; the flag says whether the clause's subject is the previous clause's last entity."""
    out: list[tuple[list[_Sym], bool]] = []
    cur: list[_Sym] = []
    carry = False
    k = 0
    while k < len(syms):
        s = syms[k]
        if s.kind in ("SPLIT", "CARRY"):
            out.append((cur, carry))
            cur, carry = [], s.kind == "CARRY"
        elif s.kind == "AND" and any(x.kind == "D" for x in cur):
            j = k + 1
            while j < len(syms) and syms[j].kind in ("E", "AND"):
                j += 1
            if j > k + 1 and j < len(syms) and syms[j].kind in ("COP", "D", "MOTION", "NEG", "DIRECTLY"):
                out.append((cur, carry))
                cur, carry = [], False
            else:
                cur.append(s)
        else:
            cur.append(s)
        k += 1
    out.append((cur, carry))
    return out


def _drop_actions(syms: list[_Sym]) -> list[_Sym]:
    """Remove directions that follow a motion verb (until a copula) and "slightly <dir>"."""
    out: list[_Sym] = []
    in_motion = slight = False
    for s in syms:
        if s.kind == "MOTION":
            in_motion = True
            continue
        if s.kind == "COP":
            in_motion = False
        if s.kind == "SLIGHT":
            slight = True
            continue
        if s.kind == "D" and (in_motion or slight):
            slight = False
            continue
        if s.kind == "DIRECTLY" and in_motion:
            continue
        out.append(s)
    return out


def _clause_facts(syms: list[_Sym], subjects_carry: list[tuple[str, ...]], reference: tuple[str, ...] | None,
                  ) -> tuple[list[Item], list[tuple[str, ...]]]:
    """Facts of one clause and its subjects (carried into the next clause of the sentence)."""
    if any(s.kind == "NEG" for s in syms):
        return [], []
    syms = _drop_actions(syms)
    first_d = next((i for i, s in enumerate(syms) if s.kind == "D"), None)
    subjects = [s.value for s in syms[: first_d if first_d is not None else len(syms)] if s.kind == "E"]
    if first_d is None:
        return [], subjects
    tail = syms[first_d:]
    if not subjects:
        # inverted: "above the player is the box" -> the entities after a copula are the subjects
        cop = next((i for i, s in enumerate(tail) if s.kind == "COP" and any(x.kind == "E" for x in tail[:i])), None)
        if cop is not None and not any(s.kind == "D" for s in tail[cop:]):
            subjects = [s.value for s in tail[cop:] if s.kind == "E"]
            tail = tail[:cop]
        else:
            subjects = subjects_carry
    if not subjects:
        return [], []
    groups: list[tuple[list[tuple[str, str]], list[tuple[str, ...]]]] = []
    dirs: list[tuple[str, str]] = []
    objs: list[tuple[str, ...]] = []
    directly = first_d > 0 and syms[first_d - 1].kind == "DIRECTLY"
    for s in tail:
        if s.kind == "D":
            if objs:
                groups.append((_with_directly(dirs, directly), objs))
                dirs, objs, directly = [], [], False
            dirs.extend(s.value)
        elif s.kind == "DIRECTLY":
            directly = True
        elif s.kind == "E" and dirs:
            objs.append(s.value)
    if dirs and objs:
        groups.append((_with_directly(dirs, directly), objs))
    elif dirs:  # directions without an object: the previous object, the stated reference, or none
        if groups:
            groups.append((_with_directly(dirs, directly), groups[-1][1]))
        elif len(subjects) >= 2 and all(v == "same" for _, v in dirs):  # "A and B are in the same row"
            groups.append((dirs, subjects[1:]))
            subjects = subjects[:1]
        elif reference is not None:
            groups.append((_with_directly(dirs, directly), [reference]))
    items: list[Item] = []
    for gdirs, gobjs in groups:
        for subj in subjects:
            for obj in gobjs:
                for axis, value in dict.fromkeys(gdirs):
                    alts = {make_fact(a, axis, value, b) for a in subj for b in obj} - {None}
                    if alts:
                        items.append(frozenset(alts))
    return items, subjects


def _with_directly(dirs: list[tuple[str, str]], directly: bool) -> list[tuple[str, str]]:
    """"directly above" also means "same column"; "directly left of" also means "same row"."""
    if not directly:
        return dirs
    axes = {a for a, v in dirs}
    if axes == {"v"}:
        return dirs + [H_SAME]
    if axes == {"h"}:
        return dirs + [V_SAME]
    return dirs


_SENTENCE_SPLIT = re.compile(r"(?<!\d)[.!?;\n]+(?!\d)")


def relation_items(text: str | None, lex: Lexicon, implicit: str | None = None) -> list[Item]:
    """Relation facts stated in ``text`` (untrusted; never raises), as deduplicated alternative sets.

    ``implicit``: the id a relation without an object refers to (Navigation: the agent).
    """
    if not text or not isinstance(text, str):
        return []
    text = text[:20000]
    items: list[Item] = []
    last_seen: tuple[str, ...] | None = None  # what "it" refers to, across sentences
    agent = set(lex.resolve("player"))
    for sentence in _SENTENCE_SPLIT.split(text):
        syms = _symbols(_tokens(sentence, lex), lex)
        reference = lex.resolve(implicit) if implicit else None
        for k, s in enumerate(syms):  # "relative to the player, ..." sets the reference of the sentence
            if s.kind == "REL" and k + 1 < len(syms) and syms[k + 1].kind == "E":
                reference = syms[k + 1].value
                syms = syms[:k] + syms[k + 2:]
                break
        for k, s in enumerate(syms):
            if s.kind == "E" and not set(s.value) <= agent:  # "it" is never the agent
                last_seen = s.value
            elif s.kind == "IT":
                syms[k] = _Sym("E", last_seen) if last_seen else _Sym("SKIP")
        carried: list[tuple[str, ...]] = []
        last_entity: list[tuple[str, ...]] = []
        for clause, is_relative in _clauses(syms):
            subjects_in = last_entity if is_relative else carried
            got, subjects = _clause_facts(clause, subjects_in, reference)
            items += got
            carried = subjects or carried
            ents = [s.value for s in clause if s.kind == "E"]
            last_entity = ents[-1:] or last_entity
    return list(dict.fromkeys(items))


def relation_facts(sentences: Iterable[str], lex: Lexicon) -> list[Fact]:
    """Truth facts of App. D.1 relation sentences (each sentence parsed like agent text)."""
    out: list[Fact] = []
    for s in sentences:
        for item in relation_items(s, lex):
            out.extend(sorted(item))
    return list(dict.fromkeys(out))


# ----------------------------------------------------------------------------- symbolic grids


def _norm_row(line: str, keep_spaces: bool) -> str:
    row = line.expandtabs().strip().strip("`").strip()
    return row if keep_spaces else row.replace(" ", "")


def keeps_spaces(symbolic: str) -> bool:
    """Grids whose rows only line up with their spaces (Taxi's wide cells) are compared with them;
    grids whose spaces only separate symbols (Maze's "P o *") without."""
    lines = [ln for ln in symbolic.splitlines() if ln.strip()]
    if len({len(_norm_row(ln, False)) for ln in lines}) <= 1:
        return False
    return len({len(_norm_row(ln, True)) for ln in lines}) == 1


def _grid_rows(s: str, keep_spaces: bool) -> list[str]:
    return [_norm_row(ln, keep_spaces) for ln in s.splitlines() if ln.strip()]


def _grid_like(line: str) -> bool:
    return not re.search(r"[A-Za-z]{2,}\s+[A-Za-z]{2,}", line) and not line.strip().endswith(":")


def grid_block(text: str, symbolic: str) -> list[str] | None:
    """The longest run of consecutive text lines as wide as the truth grid."""
    keep = keeps_spaces(symbolic)
    truth_rows = _grid_rows(symbolic, keep)
    if not truth_rows:
        return None
    width = max(len(r) for r in truth_rows)
    charset = set("".join(truth_rows))
    best: list[str] = []
    run: list[str] = []
    for line in text.splitlines():
        row = _norm_row(line, keep)
        if len(row) == width and _grid_like(line) and sum(ch in charset for ch in row) >= 0.5 * width:
            run.append(row)
            if len(run) > len(best):
                best = list(run)
        else:
            run = []
    need = 2 if len(truth_rows) >= 2 else 1
    return best[: len(truth_rows)] if len(best) >= need else None


def grid_rows(symbolic: str) -> list[str]:
    """The rows of a grid (spaces kept only where the rows need them to line up)."""
    return _grid_rows(symbolic, keeps_spaces(symbolic))


def grid_items(text: str, symbolic: str, background: Iterable[str]) -> list[Item]:
    """The (row, column, symbol) cells of the grid block of ``text`` (see :func:`grid_block`),
    ``background`` symbols (walls, floor) left out."""
    skip = set(background)
    block = grid_block(text, symbolic) or []
    return [frozenset([(r, c, ch)]) for r, row in enumerate(block) for c, ch in enumerate(row) if ch not in skip]


# ----------------------------------------------------------------------------- structured dicts / coordinates

_NUM = r"-?\d+(?:\.\d+)?"
_TUPLE_RE = re.compile(rf"[\(\[]\s*({_NUM}(?:\s*,\s*{_NUM})+)\s*[\)\]]")
_KEY_SUFFIX = re.compile(r"(?:_(?:positions?|pos|coordinates?|coords?|locations?|xyz|xy))+$")


def norm_key(key: str) -> str:
    """``box_positions`` -> ``box``, ``red_cube_position`` -> ``red_cube``, ``Grid Size`` -> ``grid_size``."""
    k = re.sub(r"[^a-z0-9]+", "_", str(key).lower()).strip("_")
    k = _KEY_SUFFIX.sub("", k) or k
    parts = k.split("_")
    parts[-1] = _singular(parts[-1]) if parts[-1] not in ("size",) else parts[-1]
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


# ----------------------------------------------------------------------------- SVG elements

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


# ----------------------------------------------------------------------------- hybrid: extracted JSON -> facts

_RELATION_DIRS: dict[str, tuple[tuple[str, str], ...]] = {
    "above": (V_UP,), "below": (V_DOWN,), "left": (H_LEFT,), "right": (H_RIGHT,),
    "same_row": (V_SAME,), "same_column": (H_SAME,), "same_place": (V_SAME, H_SAME),
    "ahead": (D_AHEAD,), "behind": (D_BEHIND,),
}


def _entity_word(name: Any) -> str | None:
    if not isinstance(name, str):
        return None
    n = re.sub(r"^\s*(?:the|a|an)\s+", "", name.lower())
    n = re.sub(r"[^a-z0-9]", "", n)
    return n or None


def extracted_relation_items(data: list, lex: Lexicon) -> list[Item]:
    """Relation facts of a hybrid extraction (``[{"subject", "relation", "object"}, ...]``).

    Entries that name no known relation count for nothing; an entity the lexicon lacks resolves to
    a literal id and can only be a false positive.
    """
    items: list[Item] = []
    for entry in data[:500]:
        if not isinstance(entry, dict):
            continue
        rel = str(entry.get("relation", "")).lower().strip().replace(" ", "_")
        dirs = _RELATION_DIRS.get(rel)
        subj, obj = _entity_word(entry.get("subject")), _entity_word(entry.get("object"))
        if not dirs or not subj or not obj:
            continue
        s_ids = lex.resolve(subj)
        o_ids = lex.resolve(obj)
        for axis, value in dirs:
            alts = {make_fact(a, axis, value, b) for a in s_ids for b in o_ids} - {None}
            if alts:
                items.append(frozenset(alts))
    return list(dict.fromkeys(items))


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
