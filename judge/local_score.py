"""The ``local`` scoring mode (``judge.rule_mode: local``): what the next move depends on, item by item.

With ``judge.rule_mode: local`` the config gives FrozenLake ``relation_prompt: local``
(:mod:`worldloop.envs.grid.grid_env`): its prompt asks for the goal's relation to the player and
for every hole in the player's 8-neighbourhood (Chebyshev distance <= 1, the player's own cell
included), with generic names ("hole is at the same row and to the left of the player"), and the
env's ``state["relations"]`` are exactly those sentences, goal first, then the holes in reading
order. The truth of this mode is therefore the state's relation sentences, one item each.

Items are ``(type, vertical, horizontal)`` relative to the player (types ``target``, ``hole``,
``box``), read by the same extractor as the ``vagen`` mode
(:func:`worldloop.judge.vagen_score.text_items`; the hybrid scorer's facts by
:func:`~worldloop.judge.vagen_score.items_from_facts`). A predicted item matches a truth item only
when the type and **both** relations are equal (a relation the text leaves open never matches), so
the maximum matching is the multiset intersection. With m matched items, p predicted and n true::

    F1 = 2 * (m/p) * (m/n) / (m/p + m/n)          (0 when m = 0)

A correct local observation scores exactly 1.0; ``all_true`` says that every predicted item
matched (the repetition penalty spares such a text, :mod:`worldloop.judge.scoring`). Other envs
and state formats (grids, JSON) are scored as ``f1``: :func:`local_score` returns None there. Which
envs offer the local prompt is their family's knowledge (``EnvFamily.local_envs``, asked through
:mod:`worldloop.envs.family`; the grid family lists FrozenLake).

Public API::

    local_kind(env_name) -> "frozenlake" | None      # an env whose family lists it in local_envs
    local_truth_items(truth) -> list[VItem]
    score_local_items(predicted, truth_items) -> RuleResult
    local_score(text, truth, env_name) -> RuleResult | None
    local_score_facts(items, truth, env_name) -> RuleResult | None   # hybrid's extracted facts
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable

from worldloop.envs.family import env_name_of, family_of
from worldloop.judge.rule import Item, RuleResult, Truth, f1_from_counts
from worldloop.judge.vagen_score import VItem, items_from_facts, text_items


def local_kind(env_name: str | None) -> str | None:
    """The env's short name (``"frozenlake"``) when its family scores it locally (name or gymnasium id), else None."""
    family, name = family_of(env_name), env_name_of(env_name)
    return name if family is not None and name in family.local_envs else None


def local_truth_items(truth: Truth) -> list[VItem]:
    """One item per relation sentence of the truth (the env writes exactly the local ones)."""
    sentences = truth.info if isinstance(truth.info, list) else []
    return [item for s in sentences for item in text_items(str(s), truth)[:1]]


def score_local_items(predicted: list[VItem], truth: list[VItem]) -> RuleResult:
    """F1 over items matched on type and both relations (see the module docstring)."""
    pred, true = Counter(predicted), Counter(truth)
    matched = sum(min(n, true[item]) for item, n in pred.items() if None not in item)
    n_pred = len(predicted)
    score = f1_from_counts(matched, n_pred, matched, len(truth))
    return RuleResult(score, "local", matched, n_pred, len(truth), all_true=n_pred > 0 and matched == n_pred)


def _applies(truth: Truth | None, env_name: str) -> bool:
    return (local_kind(env_name) is not None and truth is not None and truth.method == "relations"
            and truth.lexicon is not None)


def local_score(text: str | None, truth: Truth | None, env_name: str) -> RuleResult | None:
    """The ``local`` score of ``text``; None where the mode does not apply (another env, or a truth
    that is not the board's relation sentences)."""
    if not _applies(truth, env_name):
        return None
    return score_local_items(text_items(text, truth), local_truth_items(truth))


def local_score_facts(items: Iterable[Item], truth: Truth | None, env_name: str) -> RuleResult | None:
    """As :func:`local_score` for relation facts an extractor already produced (``hybrid``)."""
    if not _applies(truth, env_name):
        return None
    return score_local_items(items_from_facts(items, truth), local_truth_items(truth))
