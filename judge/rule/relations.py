"""Relations stated in free text: the sentence reader (untrusted text; nothing here raises on any
text, nothing is ever read as an instruction).

Each sentence is tokenised, its tokens become symbols (entity, direction, copula, motion verb,
negation, clause split, ...) through the :mod:`~worldloop.judge.rule.lexicon`, the symbols split
into clauses, and each clause gives the relation facts between its subjects and its objects.
Negated clauses ("not", "no longer") yield nothing, directions right after a motion verb ("move up",
"pushing the box left") are actions, not relations, and absolute positions ("the box is at the top")
are not relations (App. D.1: "Absolute position is not allowed"), except where an ``implicit``
reference is given (Navigation: the agent). "it" is the entity mentioned last (never the agent);
"relative to X, ..." makes X the reference of the sentence.

Hybrid scoring: :func:`extracted_relation_items` reads the same facts from an LLM extractor's JSON
list instead of the text.

Public API::

    relation_items(text, lex, implicit=None) -> list[Item]    relation_facts(sentences, lex) -> list[Fact]
    extracted_relation_items(data, lex) -> list[Item]
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

from worldloop.judge.rule.f1 import Fact, Item
from worldloop.judge.rule.lexicon import (ARTICLES, COPULAS, D_AHEAD, D_BEHIND, DIR_PHRASES, H_LEFT, H_RIGHT, H_SAME,
                                          V_DOWN, V_SAME, V_UP, Lexicon, make_fact)

# ----------------------------------------------------------------------------- text -> symbols

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
_DIRECTLY = frozenset(["directly", "straight", "exactly"])
_SLIGHT = frozenset(["slightly", "somewhat"])
_REL_PHRASES = {("relative", "to"), ("compared", "to"), ("compared", "with"), ("with", "respect", "to")}
_POSSESSIVE_PLAYER = frozenset(["my", "mine", "our"])
_PUNCT = frozenset(".,;:!?()")


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
    """The symbols of a sentence's tokens: multi-word phrases first, then one word at a time."""
    out: list[_Sym] = []
    i, n = 0, len(tokens)
    while i < n:
        phrase = _phrase_at(tokens, i, lex)
        if phrase is not None:
            out.append(phrase[0])
            i += phrase[1]
            continue
        tok = tokens[i]
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
        elif (tok,) in DIR_PHRASES:
            out.append(_Sym("D", DIR_PHRASES[(tok,)]))
        elif lex.is_entity_word(tok) and tok not in ARTICLES:
            out.append(_Sym("E", lex.resolve(tok)))
        elif tok in COPULAS:
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
    return _possessives(out)


def _phrase_at(tokens: list[str], i: int, lex: Lexicon) -> tuple[_Sym, int] | None:
    """The symbol of the longest multi-word phrase (an entity of the lexicon, a direction, "relative
    to") that starts at token ``i``, and its length in tokens."""
    for size in (4, 3, 2):
        key = tuple(tokens[i:i + size])
        if len(key) < size:
            continue
        if key in lex.multiword:
            return _Sym("E", lex.resolve(lex.multiword[key])), size
        if key in DIR_PHRASES:
            return _Sym("D", DIR_PHRASES[key]), size
        if key in _REL_PHRASES:
            return _Sym("REL"), size
    return None


def _possessives(syms: list[_Sym]) -> list[_Sym]:
    """"my left" / "the player's left" -> "left of player"; any other possessive is its entity."""
    out = list(syms)
    for k in range(len(out) - 1):
        if out[k].kind == "POSS" and out[k + 1].kind == "D":
            out[k], out[k + 1] = out[k + 1], _Sym("E", out[k].value)
    return [_Sym("E", s.value) if s.kind == "POSS" else s for s in out]


def _next_is_entity(tokens: list[str], i: int, lex: Lexicon) -> bool:
    while i < len(tokens) and tokens[i] in ARTICLES:
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
