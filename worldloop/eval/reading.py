"""Whether an agent read its board right: the one definition the evaluator and the failure
breakdown share.

Public API::

    observation_score(observation, state, env_name, *, format_rewarded, judge) -> float | None
    reading_right(observation, state, env_name, *, format_rewarded, judge) -> bool | None
    first_turn_reading(trajectories, judge) -> {"rate": {env: x, "all": x}, "right": {...}, "turns": {...}}

A turn's reading is **right** when its ``<observation>`` states at least one relation and every
relation it states is true of the turn's true state (``state_before``), as the judge's ``rule``
scorer finds (:class:`worldloop.judge.scoring.TrajectoryScorer`, the part ``grounding``, with the
run's ``judge.rule_mode``: the verdict ``correct`` that also spares a turn the repetition penalty),
or when that scorer gives it the grounding score 1.0 (``vagen`` mode states no per-relation
verdict). A concise observation (``sft.observation_relations``: the prompt asks for one relation)
that is true is therefore right, although its F1 against every relation of the board is below
1.0. The score is the judge process's own, before the repetition penalty, which depends on the
judge process's history and not on the turn. So a turn that earned no format reward is not right
(the judge pays it nothing), nor is a missing observation. ``None``: the state offers nothing to
compare with (e.g. SVG), or the prompt format asks for no observation; such turns are left out of
the rates.
"""

from __future__ import annotations

import asyncio
from typing import Any, Iterable

from worldloop.common.contracts.config import JudgeConfig


def _scorer(judge: JudgeConfig):
    from worldloop.judge.scoring import TrajectoryScorer

    return TrajectoryScorer(judge)


async def _part(scorer, observation: str | None, state: Any, env_name: str, format_rewarded: bool):
    # the judge's own scoring of one part (format gate, missing text, not applicable, rule or vagen
    # mode); TrajectoryScorer.score would also count these turns in the judge's metrics and
    # repetition history, which the evaluator must not touch: score_part touches neither
    return await scorer.score_part(env_name, "grounding", format_rewarded, observation, state, ["rule"])


def _right(part) -> bool | None:
    return None if part.score is None else bool(part.correct or part.score >= 1.0)


def observation_score(observation: str | None, state: Any, env_name: str, *, format_rewarded: bool,
                      judge: JudgeConfig) -> float | None:
    """The judge's ``rule`` grounding score of ``observation`` against ``state`` (see the module docstring)."""
    return asyncio.run(_part(_scorer(judge), observation, state, env_name, format_rewarded)).score


def reading_right(observation: str | None, state: Any, env_name: str, *, format_rewarded: bool,
                  judge: JudgeConfig) -> bool | None:
    """True when the observation reads right (the module docstring); None when that does not apply."""
    return _right(asyncio.run(_part(_scorer(judge), observation, state, env_name, format_rewarded)))


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
            ok = _right(await _part(scorer, first.observation, first.state_before, traj.env_name,
                                    format_rewarded(first)))
            if ok is None:
                continue
            for key in (traj.env_name, "all"):
                turns[key] += 1
                right[key] += ok

    asyncio.run(score_all())
    return {"rate": {k: (right[k] / n if n else None) for k, n in turns.items()}, "right": right, "turns": turns}
