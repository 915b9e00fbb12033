"""The response parser and the action vocabulary shared by every worldloop environment.

Public API (stable; later changes only add)::

    PROMPT_FORMATS = ("no_think", "free_think", "grounding", "worldmodeling", "grounding_worldmodeling")
    THINK_FIELDS: dict[str, tuple[str, ...] | None]   # the <think> children of each format (None: free text)
    MAX_RESPONSE_CHARS = 65536             # longer responses are rejected unread
    uses_observation(prompt_format) -> bool ; uses_prediction(prompt_format) -> bool

    parse_response(text, prompt_format) -> ParsedResponse
        ParsedResponse(format_ok, think, observation, reasoning, prediction, answer, reason)
    ActionVocab(words, aliases=None)       # canonical action words + extra spellings
        .parse(answer, max_actions) -> ActionParse
        .canonical(word) -> str | None
    parse_actions(answer, vocab, max_actions) -> ActionParse
        ActionParse(actions, values, unknown, dropped, reason); .ok
    normalise_action_word(word) -> str     # "Move  Up." -> "moveup"

Response formats (VAGEN Table 5). Tags are matched exactly (lower case, no spaces inside the
brackets); the response may have white space around and between the structural tags but no other
text outside them; every tag of the format must occur exactly once and in order, and no tag of
another format may appear (in ``free_think`` the ``<think>`` body is free text and may contain any
tag but think/answer). The answer must be non-empty. Anything else gives ``format_ok=False`` with a
``reason`` such as ``"missing <answer>"``, ``"duplicated <think>"``, ``"unexpected <prediction>"``,
``"text outside the tags"``, ``"empty answer"``. The parser is one regex scan over at most
``MAX_RESPONSE_CHARS`` characters (it stops early once more tags than the format has are seen) and
never raises on any text (None and bytes included).

Action words: an answer is split on ``,`` / ``;`` / newlines; each item is normalised (lower case,
everything but letters and digits removed, so ``" move  UP."`` -> ``"moveup"``) and looked up among
the env's canonical words and aliases. Only the first ``max_actions_per_step`` items are considered
(the rest are dropped, VAGEN truncates the same way). Any unknown word among them rejects the whole
turn (what a rejected turn means for the env: :mod:`worldloop.envs.base`).

This module imports nothing of worldloop; :mod:`worldloop.envs.prompts` and :mod:`worldloop.envs.base`
build on it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

PROMPT_FORMATS: tuple[str, ...] = ("no_think", "free_think", "grounding", "worldmodeling", "grounding_worldmodeling")
MAX_RESPONSE_CHARS = 65536

# the think-children of each format (None: free text inside <think>; () : no <think> at all)
THINK_FIELDS: dict[str, tuple[str, ...] | None] = {
    "no_think": (),
    "free_think": None,
    "grounding": ("observation", "reasoning"),
    "worldmodeling": ("reasoning", "prediction"),
    "grounding_worldmodeling": ("observation", "reasoning", "prediction"),
}

_TAG_RE = re.compile(r"<(/?)(think|observation|reasoning|prediction|answer)>")
_FREE_TAG_RE = re.compile(r"<(/?)(think|answer)>")
_SPLIT_RE = re.compile(r"[,;\n]")
_NON_ALNUM_RE = re.compile(r"[^0-9a-z]+")


def uses_observation(prompt_format: str) -> bool:
    """True when the format has an ``<observation>`` field (grounding, grounding_worldmodeling)."""
    return "observation" in (THINK_FIELDS.get(prompt_format) or ())


def uses_prediction(prompt_format: str) -> bool:
    """True when the format has a ``<prediction>`` field (worldmodeling, grounding_worldmodeling)."""
    return "prediction" in (THINK_FIELDS.get(prompt_format) or ())


# --------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class ParsedResponse:
    """The fields of one response; ``reason`` says why ``format_ok`` is False ("" when ok)."""

    format_ok: bool
    think: str | None = None
    observation: str | None = None
    reasoning: str | None = None
    prediction: str | None = None
    answer: str | None = None
    reason: str = ""


def _expected_tags(prompt_format: str) -> list[str]:
    children = THINK_FIELDS[prompt_format]
    seq: list[str] = []
    if children is None:
        seq += ["<think>", "</think>"]
    elif children:
        seq.append("<think>")
        for c in children:
            seq += [f"<{c}>", f"</{c}>"]
        seq.append("</think>")
    return seq + ["<answer>", "</answer>"]


def _mismatch_reason(found: list[str], expected: list[str]) -> str:
    for tag in found:
        if tag not in expected:
            return f"unexpected {tag}"
    for tag in expected:
        if found.count(tag) > 1:
            return f"duplicated {tag}"
    for tag in expected:
        if tag not in found:
            return f"missing {tag}"
    return "tags out of order"


def _fail(reason: str) -> ParsedResponse:
    return ParsedResponse(format_ok=False, reason=reason)


def parse_response(text: Any, prompt_format: str) -> ParsedResponse:
    """Parse a raw model response in ``prompt_format`` (one of PROMPT_FORMATS); never raises on text.

    Raises ValueError only for an unknown ``prompt_format`` (a caller bug, not model output).
    """
    if prompt_format not in THINK_FIELDS:
        raise ValueError(f"prompt_format must be one of {PROMPT_FORMATS}, got {prompt_format!r}")
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text[: MAX_RESPONSE_CHARS * 4 + 4]).decode("utf-8", errors="replace")
    if not isinstance(text, str):
        return _fail(f"response is {type(text).__name__}, not text")
    if len(text) > MAX_RESPONSE_CHARS:
        return _fail(f"response has {len(text)} characters, more than {MAX_RESPONSE_CHARS}")
    expected = _expected_tags(prompt_format)
    tag_re = _FREE_TAG_RE if THINK_FIELDS[prompt_format] is None else _TAG_RE
    found: list[str] = []
    spans: list[tuple[int, int]] = []
    for m in tag_re.finditer(text):
        found.append(m.group(0))
        spans.append(m.span())
        if len(found) > len(expected):
            break
    if found != expected:
        return _fail(_mismatch_reason(found, expected) if found else "no tags")
    # white space only before the first tag, after the last, and between structural tags
    content: dict[str, str] = {}
    gaps = [text[: spans[0][0]], text[spans[-1][1] :]]
    for i in range(len(found) - 1):
        inner = text[spans[i][1] : spans[i + 1][0]]
        a, b = found[i], found[i + 1]
        if not a.startswith("</") and b == "</" + a[1:]:
            content[a[1:-1]] = inner.strip()  # a leaf: <x> ... </x>
        else:
            gaps.append(inner)
    if any(g.strip() for g in gaps):
        return _fail("text outside the tags")
    answer = content.get("answer", "")
    if not answer:
        return ParsedResponse(False, content.get("think"), content.get("observation"), content.get("reasoning"),
                              content.get("prediction"), answer, "empty answer")
    think = content.get("think")
    if think is None and THINK_FIELDS[prompt_format]:
        # the structured formats: the think text is the span between <think> and </think>
        s, e = spans[0][1], spans[found.index("</think>")][0]
        think = text[s:e].strip()
    return ParsedResponse(True, think, content.get("observation"), content.get("reasoning"),
                          content.get("prediction"), answer, "")


# --------------------------------------------------------------------------- actions


def normalise_action_word(word: str) -> str:
    """Lower case with everything but letters and digits removed: ``" Move  UP."`` -> ``"moveup"``."""
    return _NON_ALNUM_RE.sub("", word.lower())


@dataclass(frozen=True)
class ActionParse:
    """Result of splitting an answer into actions.

    ``actions``: canonical spellings of the accepted actions (at most max_actions);
    ``values``: what ``_apply_action`` receives (None: the canonical strings themselves);
    ``unknown``: items that are not actions (as written); ``dropped``: items beyond max_actions;
    ``reason``: "" when ok, else why the answer is rejected.
    """

    actions: list[str] = field(default_factory=list)
    values: list[Any] | None = None
    unknown: list[str] = field(default_factory=list)
    dropped: int = 0
    reason: str = ""

    @property
    def ok(self) -> bool:
        return not self.reason and bool(self.actions)


class ActionVocab:
    """Canonical action words plus extra spellings, matched by :func:`normalise_action_word`."""

    def __init__(self, words: Sequence[str], aliases: Mapping[str, str] | None = None) -> None:
        self.words = tuple(words)
        self._lookup: dict[str, str] = {}
        for w in self.words:
            self._lookup[normalise_action_word(w)] = w
        for alias, canon in (aliases or {}).items():
            if canon not in self.words:
                raise ValueError(f"alias {alias!r} maps to {canon!r}, which is not an action")
            self._lookup.setdefault(normalise_action_word(alias), canon)

    def canonical(self, word: str) -> str | None:
        return self._lookup.get(normalise_action_word(word))

    def parse(self, answer: str | None, max_actions: int) -> ActionParse:
        items = [s.strip() for s in _SPLIT_RE.split(answer or "")]
        items = [s for s in items if s]
        if not items:
            return ActionParse(reason="no action in the answer")
        kept, dropped = items[:max_actions], max(0, len(items) - max_actions)
        actions: list[str] = []
        unknown: list[str] = []
        for item in kept:
            canon = self.canonical(item)
            if canon is None:
                unknown.append(item[:80])
            else:
                actions.append(canon)
        if unknown:
            return ActionParse(actions, None, unknown, dropped, f"unknown action {unknown[0]!r}")
        return ActionParse(actions, None, [], dropped, "")


def parse_actions(answer: str | None, vocab: ActionVocab | Sequence[str], max_actions: int) -> ActionParse:
    """Split ``answer`` into at most ``max_actions`` canonical actions of ``vocab``."""
    if not isinstance(vocab, ActionVocab):
        vocab = ActionVocab(vocab)
    return vocab.parse(answer, max_actions)
