"""F1 with a maximum matching, and the repetition tracker (VAGEN App. D.1.2).

Facts are plain tuples; a predicted :data:`Item` is a frozenset of alternative facts (a generic
mention such as "the box" when there are several boxes) and counts once. The score of a text is
F1 = 2PR/(P+R) with P = matched predicted items / predicted items against the truth's ``known``
facts and R = matched truth facts / truth facts against its ``essential`` ones (a maximum
bipartite matching, so an item of alternatives is counted once); both are the same list except
for Navigation (see :mod:`worldloop.judge.rule.truths`). What is compared is anything with the
:class:`Comparison` attributes (a :class:`worldloop.judge.rule.truths.Truth`).

Public API::

    Fact, Item
    max_matching(items, truth, compatible=None) -> int
    f1_from_counts(tp_pred, n_pred, tp_truth, n_truth) -> float
    f1(predicted, truth) -> float
    score_items(items, truth) -> RuleResult(score, method, matched, predicted, truth, all_true)
    RepetitionTracker(top_k=5, threshold=0.7, penalty=0.1).apply(text, score, correct=False) -> penalty
    sentences_of(text) -> list[str], normalise_sentence(s) -> str
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

Fact = tuple
Item = frozenset  # alternatives of one predicted fact


class Comparison(Protocol):
    """What :func:`score_items` compares predicted items with."""

    method: str
    essential: list[Fact]  # recall is measured against these
    known: list[Fact]  # precision is measured against these

    def compatible(self, a: Fact, b: Fact) -> bool: ...


# ----------------------------------------------------------------------------- F1


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


@dataclass
class RuleResult:
    score: float
    method: str
    matched: int
    predicted: int
    truth: int
    all_true: bool = False  # the text stated at least one fact and every one it stated is true (precision 1)

    def to_dict(self) -> dict:
        return {"score": self.score, "method": self.method, "matched": self.matched,
                "predicted": self.predicted, "truth": self.truth, "all_true": self.all_true}


def score_items(items: list[Item], truth: Comparison) -> RuleResult:
    """F1 of predicted items against a truth (precision vs ``known``, recall vs ``essential``)."""
    items = list(dict.fromkeys(items))
    tp_pred = max_matching(items, truth.known, truth.compatible)
    tp_truth = tp_pred if truth.known is truth.essential else max_matching(items, truth.essential, truth.compatible)
    score = f1_from_counts(tp_pred, len(items), tp_truth, len(truth.essential))
    return RuleResult(score, truth.method, tp_truth, len(items), len(truth.essential),
                      all_true=bool(items) and tp_pred == len(items))


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
    threshold is penalised. A correct text is never penalised, however often it recurs: one that
    scores 1.0 (the top score, whatever the threshold), or one the caller marks ``correct`` (every
    fact it states is true: a concise observation that states fewer relations than the truth holds
    scores a low F1 but reads its board right). Counts only grow, so a sentence enters the top-k exactly when its count
    passes the smallest count in it. The history is bounded: past ``max_sentences`` distinct
    sentences the ones seen once are forgotten.
    """

    def __init__(self, top_k: int = 5, threshold: float = 0.7, penalty: float = 0.1, max_sentences: int = 100_000):
        self.top_k, self.threshold, self.penalty, self.max_sentences = top_k, threshold, penalty, max_sentences
        self.counts: Counter[str] = Counter()
        self.top: dict[str, int] = {}

    def observe(self, text: str | None) -> list[str]:
        sents = sentences_of(text)
        if self.top_k <= 0:  # no penalty: nothing to keep
            return sents
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

    def apply(self, text: str | None, score: float | None, correct: bool = False) -> float:
        """Record ``text`` and return its penalty (``-penalty`` or 0.0); None scores are not judged,
        correct texts (``correct``, or a score of 1.0 or more) are never penalised."""
        sents = self.observe(text)
        if score is None or self.top_k <= 0 or correct or score >= 1.0:
            return 0.0
        return -self.penalty if score < self.threshold and self.is_frequent(sents) else 0.0
