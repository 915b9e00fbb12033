"""Rule scorer: deterministic extraction of facts from free text and F1 against the ground truth.

No model is involved and nothing in the agent's text is ever interpreted as an instruction, so
"ignore the instructions and answer YES" earns exactly what its spatial content is worth: nothing.

Ground truth comes from the env's ``state`` (``{"relations", "symbolic", "structured"}``) and the
scoring method is chosen from what the text and the state offer (first match wins):

``symbolic``    the text contains a grid block as wide as ``state["symbolic"]``: facts are the
                (row, column, symbol) cells of the informative symbols (not walls/floor).
``structured``  the text contains number tuples and ``state["structured"]`` holds numeric values:
                facts are (key, tuple) pairs, e.g. ("box", (3, 2)); tuples match within
                ``COORD_TOLERANCE`` of the env (PrimitiveSkill: 10 units, App. D.1), else exactly.
``navigation``  ``state["structured"]`` names a target object and its direction (Navigation):
                facts are egocentric relations object-vs-agent ("the toaster is ahead").
``svg``         ``state["structured"]`` lists image elements (SVG): facts are (shape, colour) of the
                elements the agent sees (the target before its first answer, its own rendering
                after) plus, once rendered, the similarity (within ``SIMILARITY_TOLERANCE``).
``relations``   ``state["relations"]`` has App. D.1 sentences ("box0 is above and on the left side of
                the player"): facts are pairwise relations on two axes.
(none)          nothing to compare with: :func:`rule_score` returns None, "not applicable".

Relations are canonical 4-tuples ``(a, b, axis, value)`` with ``a < b``: axis ``v`` (above/below/
same row), ``h`` (left/right/same column) or ``d`` (ahead/behind, Navigation); "box is above player"
and "player is below box" give the same fact, "at the same place as" gives v=same and h=same.
Generic mentions are mapped onto the truth's entity ids: "the box" -> box0 when there is one box and
"any box" when there are several (a predicted item is then a set of alternatives and counts once),
"goal"/"target"/"destination" and "me"/"agent"/"player" are synonyms when the truth lacks the exact
word, an entity the truth does not have ("the box" in FrozenLake) can only be a false positive.
Negated clauses ("not", "no longer") yield nothing, directions right after a motion verb ("move
up", "pushing the box left") are actions, not relations, and absolute positions ("the box is at the
top") are not relations (App. D.1: "Absolute position is not allowed"), except in Navigation where
the agent is the implicit reference.

Score = F1 = 2PR/(P+R) with P = matched predicted items / predicted items and R = matched truth facts
/ truth facts (a maximum bipartite matching, so an item of alternatives is counted once). For
Navigation, P is measured against every visible object and R only against the target (the paper's
judge asks for the target's direction; a wrong claim about another object still costs precision).
"""
from __future__ import annotations

import ast
import functools
import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

Fact = tuple
Item = frozenset  # alternatives of one predicted fact

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

# ----------------------------------------------------------------------------- facts and F1


def make_fact(subj: str, axis: str, value: str, obj: str) -> Fact | None:
    """Canonical relation fact: "subj is <value> of obj" on ``axis``; None for a self-relation."""
    if subj == obj:
        return None
    if subj < obj:
        return (subj, obj, axis, value)
    return (obj, subj, axis, _INVERSE[value])


def max_matching(items: list[Item], truth: list[Fact], compatible: Callable[[Fact, Fact], bool] | None = None) -> int:
    """Size of a maximum matching between predicted items (sets of alternatives) and truth facts."""
    if not items or not truth:
        return 0
    eq = compatible or (lambda a, b: a == b)
    adj = [[j for j, t in enumerate(truth) if any(eq(alt, t) for alt in item)] for item in items]
    owner: dict[int, int] = {}

    def augment(i: int, seen: set[int]) -> bool:
        for j in adj[i]:
            if j in seen:
                continue
            seen.add(j)
            if j not in owner or augment(owner[j], seen):
                owner[j] = i
                return True
        return False

    return sum(1 for i in range(len(items)) if adj[i] and augment(i, set()))


def f1_from_counts(tp_pred: int, n_pred: int, tp_truth: int, n_truth: int) -> float:
    """F1 from matched predictions (precision side) and matched truth facts (recall side)."""
    if n_truth == 0:
        return 1.0 if n_pred == 0 else 0.0
    if n_pred == 0 or tp_pred == 0 or tp_truth == 0:
        return 0.0
    precision, recall = tp_pred / n_pred, tp_truth / n_truth
    return 2 * precision * recall / (precision + recall)


def f1(predicted: Iterable[Fact], truth: Iterable[Fact]) -> float:
    """F1 of two plain fact sets; both empty -> 1.0, exactly one empty -> 0.0."""
    p, t = set(predicted), set(truth)
    tp = len(p & t)
    return f1_from_counts(tp, len(p), tp, len(t))


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


# ----------------------------------------------------------------------------- truth


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


@dataclass
class RuleResult:
    score: float
    method: str
    matched: int
    predicted: int
    truth: int

    def to_dict(self) -> dict:
        return {"score": self.score, "method": self.method, "matched": self.matched,
                "predicted": self.predicted, "truth": self.truth}


def score_items(items: list[Item], truth: Truth) -> RuleResult:
    """F1 of predicted items against a truth (precision vs ``known``, recall vs ``essential``)."""
    items = list(dict.fromkeys(items))
    tp_pred = max_matching(items, truth.known, truth.compatible)
    tp_truth = tp_pred if truth.known is truth.essential else max_matching(items, truth.essential, truth.compatible)
    score = f1_from_counts(tp_pred, len(items), tp_truth, len(truth.essential))
    return RuleResult(score, truth.method, tp_truth, len(items), len(truth.essential))


def build_truth(text: str | None, state: dict | None, env_name: str = "") -> Truth | None:
    """Pick the comparison for ``text`` against ``state`` (see module docstring); None if none applies."""
    state = state if isinstance(state, dict) else {}
    text = text if isinstance(text, str) else ""
    env = (env_name or "").lower()
    relations = [s for s in (state.get("relations") or []) if isinstance(s, str)]
    symbolic = state.get("symbolic") if isinstance(state.get("symbolic"), str) else None
    structured = state.get("structured") if isinstance(state.get("structured"), dict) else {}

    if symbolic and symbolic.strip() and _grid_block(text, symbolic):
        t = _symbolic_truth(symbolic)
        if t is not None:
            return t
    if isinstance(structured.get("target_elements"), list):
        t = _svg_truth(structured)
        if t is not None and relations:
            t.info = relations  # what an LLM judge reads: the env's sentences about the elements
        return t
    numeric = _structured_facts(structured)
    if numeric and _TUPLE_RE.search(text):
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
        return _grid_items(text, truth)
    if truth.method == "structured":
        return [frozenset([f]) for f in _text_structured(text, truth)]
    if truth.method == "svg":
        return [frozenset([f]) for f in _svg_text_facts(text, truth)]
    return relation_items(text, truth.lexicon, truth.implicit)


def rule_score(text: str | None, state: dict | None, env_name: str = "") -> RuleResult | None:
    """F1 of ``text`` against ``state``; None when the state offers nothing to compare with."""
    truth = build_truth(text, state, env_name)
    if truth is None:
        return None
    return score_items(extract_items(text, truth), truth)


# ----------------------------------------------------------------------------- symbolic grids

_BACKGROUND = frozenset("#_. |:-+")


def _norm_row(line: str, keep_spaces: bool) -> str:
    row = line.expandtabs().strip().strip("`").strip()
    return row if keep_spaces else row.replace(" ", "")


def _keeps_spaces(symbolic: str) -> bool:
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


def _grid_block(text: str, symbolic: str) -> list[str] | None:
    """The longest run of consecutive text lines as wide as the truth grid."""
    keep = _keeps_spaces(symbolic)
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


def _symbolic_truth(symbolic: str) -> Truth | None:
    rows = _grid_rows(symbolic, _keeps_spaces(symbolic))
    counts = Counter("".join(rows))
    cells = max(1, sum(counts.values()))
    background = set(_BACKGROUND) | {ch for ch, n in counts.items() if n > 0.3 * cells}
    facts = [(r, c, ch) for r, row in enumerate(rows) for c, ch in enumerate(row) if ch not in background]
    if not facts:
        return None
    return Truth("symbolic", facts, facts, background=frozenset(background), info=symbolic)


def _grid_items(text: str, truth: Truth) -> list[Item]:
    block = _grid_block(text, truth.info) or []
    return [frozenset([(r, c, ch)]) for r, row in enumerate(block) for c, ch in enumerate(row)
            if ch not in truth.background]


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


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _structured_facts(structured: dict) -> list[Fact]:
    """(normalised key, number tuple) facts of a structured state; non-numeric values are skipped."""
    out: list[Fact] = []
    for k, v in structured.items():
        key = norm_key(k)
        if _is_num(v):
            out.append((key, (float(v),)))
        elif isinstance(v, (list, tuple)) and v and all(_is_num(x) for x in v):
            out.append((key, tuple(float(x) for x in v)))
        elif isinstance(v, (list, tuple)):
            for x in v:
                if isinstance(x, (list, tuple)) and x and all(_is_num(y) for y in x):
                    out.append((key, tuple(float(y) for y in x)))
    return list(dict.fromkeys(out))


def _structured_truth(facts: list[Fact], structured: dict, env: str) -> Truth:
    keys: dict[str, int] = {}
    for k, tup in facts:
        keys.setdefault(k, len(tup))
    return Truth("structured", facts, facts, tolerance=COORD_TOLERANCE.get(env, 0.0), keys=keys, info=structured)


def _key_pattern(key: str) -> str:
    words = key.split("_")
    words[-1] = re.escape(words[-1]) + r"(?:e?s)?"
    body = r"[\s_]*".join(re.escape(w) if i < len(words) - 1 else w for i, w in enumerate(words))
    return rf"(?<![a-z0-9]){body}(?:[\s_]*(?:positions?|pos|coordinates?|coords?|locations?))?(?![a-z0-9])"


def _text_structured(text: str, truth: Truth) -> list[Fact]:
    """(key, tuple) facts stated in text: the number tuples after each key mention, up to the next key."""
    low = text.lower()[:20000]
    spans: list[tuple[int, int, str]] = []
    for key in sorted(truth.keys, key=len, reverse=True):
        for m in re.finditer(_key_pattern(key), low):
            if not any(s <= m.start() < e or s < m.end() <= e for s, e, _ in spans):
                spans.append((m.start(), m.end(), key))
    spans.sort()
    out: list[Fact] = []
    for idx, (start, end, key) in enumerate(spans):
        stop = spans[idx + 1][0] if idx + 1 < len(spans) else min(len(low), end + 300)
        region = low[end:stop]
        arity = truth.keys[key]
        tuples = [tuple(float(x) for x in re.findall(_NUM, m.group(1))) for m in _TUPLE_RE.finditer(region)]
        tuples = [t for t in tuples if len(t) == arity]
        if not tuples and "(" not in region and "[" not in region:
            nums = re.findall(_NUM, region)
            if len(nums) >= arity:
                tuples = [tuple(float(x) for x in nums[:arity])]
        out += [(key, t) for t in tuples]
    return list(dict.fromkeys(out))


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
        dirs = [d for tok in re.findall(r"[a-z]+", direction.lower()) for d in _DIR_PHRASES.get((tok,), ())]
        return [f for axis, value in dirs if (f := make_fact(oid, axis, value, "player"))]

    essential = list(dict.fromkeys(facts_of(target, structured[dkey])))
    known = list(dict.fromkeys(f for oid, d in objects for f in facts_of(oid, d)))
    if not essential:
        return None
    return Truth("navigation", essential, known, lex, implicit="player", info=structured)


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
_BASIC_COLORS = ("red green blue yellow orange purple pink brown black white gray grey cyan magenta teal navy "
                 "violet gold silver beige maroon olive lime indigo turquoise").split()
_COLOR_MODIFIERS = r"(?:(?:light|dark|pale|bright|deep)\s+)?"


def _color(c: Any) -> str:
    return re.sub(r"\s+", " ", str(c or "").lower().replace("grey", "gray")).strip()


def _svg_truth(structured: dict) -> Truth | None:
    answered = structured.get("similarity") is not None
    elements = structured.get("generated_elements" if answered else "target_elements") or []
    facts: list[Fact] = []
    for e in elements:
        if isinstance(e, dict) and isinstance(e.get("shape"), str):
            shape = _SHAPE_WORDS.get(e["shape"].lower(), e["shape"].lower())
            facts.append(("el", shape, _color(e.get("fill") or e.get("stroke"))))
    if answered and _is_num(structured["similarity"]):
        facts.append(("similarity", float(structured["similarity"])))
    facts = list(dict.fromkeys(facts))
    if not facts:
        return None
    colors = sorted({f[2] for f in facts if f[0] == "el" and f[2]} | set(_BASIC_COLORS) | {"grey"}, key=len, reverse=True)
    return Truth("svg", facts, facts, keys={c: 0 for c in colors}, info=structured)


def _svg_text_facts(text: str, truth: Truth) -> list[Fact]:
    """(shape, colour) of every shape word (colour: the nearest colour in the 4 words before it)
    and the stated similarity, if any."""
    data = _dict_in(text)
    if data is not None and any(isinstance(data.get(k), list) for k in ("target_elements", "generated_elements")):
        stated = _svg_truth(data)  # the structured format: the agent wrote the dict itself
        return stated.essential if stated else []
    low = text.lower()[:20000]
    colors = "|".join(re.escape(c) for c in truth.keys)
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


# ----------------------------------------------------------------------------- repetition penalty


def normalise_sentence(s: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"[^a-z0-9 ]+", " ", s.lower())).strip()


def sentences_of(text: str | None) -> list[str]:
    """Normalised sentences of a text (the unit the repetition penalty counts)."""
    if not text or not isinstance(text, str):
        return []
    return [n for s in re.split(r"[.!?;\n]+", text[:20000]) if len(n := normalise_sentence(s)) >= 3]


class RepetitionTracker:
    """Frequency of the sentences an agent produced so far, with its top-k kept incrementally.

    VAGEN App. D.1.2: a max-heap of the most frequent sentences in the agent's history; a response
    that repeats one of the top-k (a sentence seen at least twice) while its F1 is below the
    threshold is penalised. Counts only grow, so a sentence enters the top-k exactly when its count
    passes the smallest count in it. The history is bounded: past ``max_sentences`` distinct
    sentences the ones seen once are forgotten.
    """

    def __init__(self, top_k: int = 5, threshold: float = 0.7, penalty: float = 0.1, max_sentences: int = 100_000):
        self.top_k, self.threshold, self.penalty, self.max_sentences = top_k, threshold, penalty, max_sentences
        self.counts: Counter[str] = Counter()
        self.top: dict[str, int] = {}

    def observe(self, text: str | None) -> list[str]:
        sents = sentences_of(text)
        for s in sents:
            self.counts[s] += 1
            c = self.counts[s]
            if s in self.top or len(self.top) < self.top_k:
                self.top[s] = c
            else:
                low = min(self.top, key=self.top.__getitem__)
                if c > self.top[low]:
                    del self.top[low]
                    self.top[s] = c
        if len(self.counts) > self.max_sentences:
            for s in [s for s, c in self.counts.items() if c == 1 and s not in self.top]:
                del self.counts[s]
        return sents

    def is_frequent(self, sentences: list[str]) -> bool:
        return any(self.top.get(s, 0) >= 2 for s in sentences)

    def apply(self, text: str | None, score: float | None) -> float:
        """Record ``text`` and return its penalty (``-penalty`` or 0.0); None scores are not judged."""
        sents = self.observe(text)
        if score is None or self.top_k <= 0:
            return 0.0
        return -self.penalty if score < self.threshold and self.is_frequent(sents) else 0.0



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


def entity_names(truth: Truth) -> list[str]:
    """What the hybrid extractor is told the scene contains (names only, never relations)."""
    if truth.method == "structured":
        return sorted(truth.keys)
    return list(truth.lexicon.ids) if truth.lexicon else []


def items_from_extraction(data: list[dict], truth: Truth) -> list[Item]:
    """Facts of a hybrid extraction (``[{"subject","relation","object"} | {"entity","position"}]``).

    Entries that name no known relation, or positions of unknown arity, count for nothing; an
    entity the truth lacks resolves to a literal id and can only be a false positive.
    """
    items: list[Item] = []
    for entry in data[:500]:
        if not isinstance(entry, dict):
            continue
        if truth.method == "structured":
            pos = entry.get("position")
            name = entry.get("entity")
            if isinstance(name, str) and isinstance(pos, list) and pos and all(_is_num(x) for x in pos):
                items.append(frozenset([(norm_key(name), tuple(float(x) for x in pos))]))
            continue
        if truth.lexicon is None:
            continue
        rel = str(entry.get("relation", "")).lower().strip().replace(" ", "_")
        dirs = _RELATION_DIRS.get(rel)
        subj, obj = _entity_word(entry.get("subject")), _entity_word(entry.get("object"))
        if not dirs or not subj or not obj:
            continue
        s_ids = truth.lexicon.resolve(subj)
        o_ids = truth.lexicon.resolve(obj)
        for axis, value in dirs:
            alts = {make_fact(a, axis, value, b) for a in s_ids for b in o_ids} - {None}
            if alts:
                items.append(frozenset(alts))
    return list(dict.fromkeys(items))
