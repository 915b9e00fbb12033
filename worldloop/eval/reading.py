"""Whether an agent read its board right: the one definition the evaluator and the failure
breakdown share.

Public API::

    observation_score(observation, state, env_name, *, format_rewarded, judge) -> float | None
    reading_right(observation, state, env_name, *, format_rewarded, judge) -> bool | None
    first_turn_reading(trajectories, judge) -> {"rate": {env: x, "all": x}, "right": {...}, "turns": {...}}

A turn's reading is **right** when the judge's ``rule`` scorer gives its ``<observation>`` the
grounding score 1.0 against the turn's true state (``state_before``): the score the judge
process itself computes for the ``rule`` scorer (:class:`worldloop.judge.scoring.TrajectoryScorer`,
the part ``grounding``, with the run's ``judge.rule_mode``), before the repetition penalty, which
depends on the judge process's history and not on the turn. So a turn that earned no format reward
is not right (the judge pays it nothing), nor is a missing observation. ``None``: the state offers
nothing to compare with (e.g. SVG), or the prompt format asks for no observation; such turns are
left out of the rates.
"""

from __future__ import annotations

import asyncio
from typing import Any, Iterable

from worldloop.common.config import JudgeConfig


def _scorer(judge: JudgeConfig):
    from worldloop.judge.scoring import TrajectoryScorer

    return TrajectoryScorer(judge)


async def _score(scorer, observation: str | None, state: Any, env_name: str, format_rewarded: bool) -> float | None:
    # the judge's own scoring of one part (format gate, missing text, not applicable, rule or vagen
    # mode); TrajectoryScorer.score would also count these turns in the judge's metrics and
    # repetition history, which the evaluator must not touch
    part = await scorer._score_part(env_name, "grounding", format_rewarded, observation, state, ["rule"])
    return part.score


def observation_score(observation: str | None, state: Any, env_name: str, *, format_rewarded: bool,
                      judge: JudgeConfig) -> float | None:
    """The judge's ``rule`` grounding score of ``observation`` against ``state`` (see the module docstring)."""
    return asyncio.run(_score(_scorer(judge), observation, state, env_name, format_rewarded))


def reading_right(observation: str | None, state: Any, env_name: str, *, format_rewarded: bool,
                  judge: JudgeConfig) -> bool | None:
    """True when :func:`observation_score` is 1.0; None when it does not apply."""
    score = observation_score(observation, state, env_name, format_rewarded=format_rewarded, judge=judge)
    return None if score is None else score >= 1.0


def _applies(traj: Any) -> bool:
    from worldloop.judge.scoring import FORMAT_PARTS

    parts = FORMAT_PARTS.get(traj.prompt_format)
    return "grounding" in parts if parts is not None else traj.turns[0].observation is not None


def first_turn_reading(trajectories: Iterable[Any], judge: JudgeConfig) -> dict:
    """Per env name and over ``all``: how many first turns were scored (``turns``), how many read
    right (``right``) and the ``rate`` (None where no first turn applies)."""
    from worldloop.judge.scoring import format_rewarded

    scorer = _scorer(judge)
    right: dict[str, int] = {"all": 0}
    turns: dict[str, int] = {"all": 0}

    async def score_all() -> None:
        for traj in trajectories:
            right.setdefault(traj.env_name, 0)
            turns.setdefault(traj.env_name, 0)
            if not traj.turns or not _applies(traj):
                continue
            first = traj.turns[0]
            score = await _score(scorer, first.observation, first.state_before, traj.env_name, format_rewarded(first))
            if score is None:
                continue
            for key in (traj.env_name, "all"):
                turns[key] += 1
                right[key] += score >= 1.0

    asyncio.run(score_all())
    return {"rate": {k: (right[k] / n if n else None) for k, n in turns.items()}, "right": right, "turns": turns}
