"""Per-turn inputs of the learner's credit assignment, read from the trajectories of a batch.

Public API::

    turn_anchor(state) -> str                         # GiGPO's anchor: the state before a turn, hashed
    trajectory_anchors(trajectories) -> list[list[str]]
    step_group_stats(trajectories) -> dict            # turns, shared (step group > 1), shared_fraction
    observation_char_span(text) -> (start, end) | None
    observation_token_span(response_ids, tokenizer) -> (start, end) | None
    tag_token_span(response_ids, tokenizer, tags=OBSERVATION) -> (start, end) | None
    observation_advantages(trajectories, rows, codec, shape, *, baseline="group", coef=1.0)
        -> (mask [B, L], values [B, L], stats)
    reasoning_advantages(trajectories, rows, codec, shape, *, baseline="group", coef=1.0)
        -> (mask [B, L], values [B, L], stats)

**Anchors** (``trainer.estimator: gigpo``): turns of one GRPO group whose environment state before
the turn is identical form a step group. The state is the turn's ``state_before``: its symbolic
grid, structured dict and relation sentences, serialised canonically (sorted keys) and hashed
(SHA-1), so two turns share an anchor exactly when the env reported the same state.

**Observation advantage** (``trainer.observation_advantage: grounding``): the tokens inside each
turn's ``<observation>...</observation>`` get ``coef * (g_t - mean g)`` instead of the task
advantage, where g_t is the turn's ``grounding_score`` (the judge's, repetition penalty included)
and the mean runs over the turns of the same baseline (``group``: every scored turn of its GRPO
group; ``step``: those of its GiGPO step group) in the WHOLE batch, so every rank computes the same
values (:func:`worldloop.learner.advantages.grounding_turn_advantages`). A turn takes part when it
earned the format reward (its observation parsed) and the judge scored its grounding; the other
turns keep the task advantage on every token. The observation's tokens are found by decoding the
turn's ``response_ids`` with the model's tokenizer (no field on the wire, so trajectories of any
age work): every token whose text overlaps the characters between the first ``<observation>`` and
the ``</observation>`` after it (the tags themselves, when a token of their own, keep the task
advantage).

**Reasoning advantage** (``trainer.reasoning_advantage: outlook``): the same for the tokens inside
each turn's ``<reasoning>...</reasoning>``, with the judge's ``outlook_score`` (the share of the
cells around the player that the reasoning names right, ``worldloop.judge.rule.outlook``) in place
of the grounding score; turns whose state has no outlook keep the task advantage.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Sequence

import torch

from worldloop.common.contracts.schemas import State, Trajectory
from worldloop.learner.advantages import grounding_turn_advantages, step_group_sizes

OPEN, CLOSE = "<observation>", "</observation>"
OBSERVATION, REASONING = (OPEN, CLOSE), ("<reasoning>", "</reasoning>")
BASELINES = ("group", "step")


def turn_anchor(state: State) -> str:
    """SHA-1 of the state's symbolic grid, structured dict and relations (canonical JSON)."""
    data = [state.symbolic, state.structured, list(state.relations)]
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha1(text.encode()).hexdigest()


def trajectory_anchors(trajectories: Sequence[Trajectory]) -> list[list[str]]:
    """The anchor of every turn, row by row (the ``anchors`` of :func:`worldloop.learner.advantages.gigpo`)."""
    return [[turn_anchor(t.state_before) for t in traj.turns] for traj in trajectories]


def step_group_stats(trajectories: Sequence[Trajectory], anchors: list[list[str]] | None = None) -> dict:
    """How many turns the batch has and how many of them share their step group with another turn."""
    anchors = trajectory_anchors(trajectories) if anchors is None else anchors
    sizes = [s for row in step_group_sizes([x.group_id for x in trajectories], anchors) for s in row]
    shared = sum(1 for s in sizes if s > 1)
    return {"turns": len(sizes), "shared": shared, "shared_fraction": shared / len(sizes) if sizes else 0.0}


def observation_char_span(text: str, tags: tuple[str, str] = OBSERVATION) -> tuple[int, int] | None:
    """Character range of the content of the first ``<observation>...</observation>`` (or of the
    first pair of ``tags``), or None."""
    opening, closing = tags
    start = text.find(opening)
    if start < 0:
        return None
    start += len(opening)
    end = text.find(closing, start)
    return None if end < 0 else (start, end)


def _token_ends(ids: list[int], backend: Any) -> tuple[str, list[int]]:
    """The decoded text and the character offset where each token's text ends."""
    text = backend.decode(ids, skip_special_tokens=True)
    pieces = backend.decode_batch([[i] for i in ids], skip_special_tokens=True)
    if "".join(pieces) == text:
        ends, n = [], 0
        for p in pieces:
            n += len(p)
            ends.append(n)
        return text, ends
    # a character split over several byte-level tokens: measure prefixes instead (rare, quadratic)
    return text, [len(backend.decode(ids[: i + 1], skip_special_tokens=True)) for i in range(len(ids))]


def observation_token_span(response_ids: Sequence[int], tokenizer: Any) -> tuple[int, int] | None:
    """[start, end) of the response tokens that overlap the observation's content; None if there is
    none. ``tokenizer``: a Hugging Face fast tokenizer (``ChatCodec.tokenizer``)."""
    return tag_token_span(response_ids, tokenizer, OBSERVATION)


def tag_token_span(response_ids: Sequence[int], tokenizer: Any,
                   tags: tuple[str, str] = OBSERVATION) -> tuple[int, int] | None:
    """[start, end) of the response tokens that overlap the content of the first pair of ``tags``."""
    ids = [int(i) for i in response_ids]
    if not ids:
        return None
    text, ends = _token_ends(ids, tokenizer.backend_tokenizer)
    span = observation_char_span(text, tags)
    if span is None or span[0] == span[1]:
        return None
    a, b = span
    starts = [0] + ends[:-1]
    inside = [i for i in range(len(ids)) if starts[i] < b and ends[i] > a and ends[i] > starts[i]]
    return (inside[0], inside[-1] + 1) if inside else None


def _turn_scores(traj: Trajectory, field: str = "grounding_score") -> list[float | None]:
    return [float(getattr(t, field)) if getattr(t, field) is not None and float(t.format_reward) > 0 else None
            for t in traj.turns]


def observation_advantages(trajectories: Sequence[Trajectory], rows: range, codec: Any, shape: tuple[int, int], *,
                           baseline: str = "group", coef: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``(mask, values, stats)`` for the local ``rows`` of the batch ``trajectories`` laid out as
    :func:`worldloop.common.contracts.modeling.build_sequence` does, padded to ``shape``: ``mask`` is 1 on the
    observation tokens of the turns that take part, ``values`` their advantage (module docstring)."""
    return _span_advantages(trajectories, rows, codec, shape, "grounding_score", OBSERVATION, baseline, coef)


def reasoning_advantages(trajectories: Sequence[Trajectory], rows: range, codec: Any, shape: tuple[int, int], *,
                         baseline: str = "group", coef: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """As :func:`observation_advantages` for the ``<reasoning>`` tokens, with the turns' ``outlook_score``."""
    return _span_advantages(trajectories, rows, codec, shape, "outlook_score", REASONING, baseline, coef)


def _span_advantages(trajectories: Sequence[Trajectory], rows: range, codec: Any, shape: tuple[int, int], field: str,
                     tags: tuple[str, str], baseline: str, coef: float) -> tuple[torch.Tensor, torch.Tensor, dict]:
    if baseline not in BASELINES:
        raise ValueError(f"baseline: expected one of {', '.join(BASELINES)}, got {baseline!r}")
    if baseline == "step":
        keys = [[(x.group_id, a) for a in row] for x, row in zip(trajectories, trajectory_anchors(trajectories))]
    else:
        keys = [[x.group_id] * len(x.turns) for x in trajectories]
    adv = grounding_turn_advantages([_turn_scores(x, field) for x in trajectories], keys, coef)
    mask, values = torch.zeros(shape), torch.zeros(shape)
    tokens = 0
    for b, r in enumerate(rows):
        pos = 0
        for turn, a in zip(trajectories[r].turns, adv[r]):
            pos += len(turn.obs_ids)
            span = None if a is None else tag_token_span(turn.response_ids, codec.tokenizer, tags)
            if span is not None:
                mask[b, pos + span[0] : pos + span[1]] = 1.0
                values[b, pos + span[0] : pos + span[1]] = float(a)
                tokens += span[1] - span[0]
            pos += len(turn.response_ids)
    taking_part = sum(a is not None for row in adv for a in row)
    return mask, values, {"turns": taking_part, "local_tokens": tokens}
