"""Score a trajectory's turns: per part, per scorer, gated aggregation, repetition penalty, reward.

Parts. ``grounding`` scores the turn's ``<observation>`` against ``state_before`` and
``worldmodeling`` its ``<prediction>`` against ``state_after``. A part applies when the
trajectory's ``prompt_format`` asks for it (grounding | worldmodeling | grounding_worldmodeling;
an unknown format: when the turn has the field). An applicable part whose text is missing (the
response did not parse) scores 0.0. A part that does not apply, or whose state offers nothing to
compare with (every scorer says "not applicable", e.g. SVG), scores None.

Scorers (``judge.scorers[env_name]``, else ``judge.scorers["default"]``):
``rule`` (:mod:`worldloop.judge.rule`, F1, no model), ``llm`` (YES=1/NO=0 with the App. D.1 prompt of the env),
``hybrid`` (the LLM lists the relations the text states, :mod:`worldloop.judge.rule` scores them by F1; the
LLM never sees the ground truth).

Gated aggregation (Argos Eq. 9) when several scorers apply to a part: the first listed scorer
that produced a real score is the gate R_0; with threshold tau = ``judge.gate_threshold`` and
weights w = ``judge.scorer_weights``::

    R = R_0                                  if R_0 < tau
    R = sum_i w_i R_i / sum_i w_i            otherwise (over every applicable scorer, gate included)

so a wrong answer according to the gate is never lifted by a lenient second opinion. When the gate
is ``rule`` and falls below tau the LLM is not asked at all (its answer could not change R).

Fallback. An LLM scorer whose endpoint stays down (timeouts, 429/5xx after the retries, other 4xx)
yields ``judge.fallback_score``; one whose replies stay unparseable yields 0.0 (the agent's text
can provoke such replies, so they must not earn a configurable bonus). Either way the scorer is
flagged ``fallback`` and the turn's ``judge["fallback"]`` is True. Fallback scores take part in the
aggregation only when no scorer of the part produced a real score.

Repetition penalty (VAGEN App. D.1.2): per part, the judge process keeps the frequency of every
sentence the agent wrote (:class:`worldloop.judge.rule.RepetitionTracker`); a part whose text repeats one of
the ``repetition_top_k`` most frequent sentences (seen at least twice) while its score is below
``repetition_f1_threshold`` gets ``-repetition_penalty``. Parts scored by fallback only are not
penalised, nor are correct parts: a score of 1.0, or a text every fact of which the gate (the
first scorer that produced a real score: ``rule`` or ``hybrid``) found true (``all_true``), such as
a concise observation that states one true relation where the truth holds several.

Reward. ``grounding_score``/``worldmodeling_score`` = part score + penalty (None when the part does
not apply) and ``reasoning_reward = beta_g * grounding + beta_w * worldmodeling`` with a None part
contributing 0 (no renormalisation: a worldmodeling-only strategy earns at most beta_w, as in
VAGEN). A turn with no applicable part gets reasoning_reward 0.0.

Outlook. Where the env states what each move runs into (``state_before.outlook``, FrozenLake), the
turn's ``<reasoning>`` is scored against it by a rule of its own (:func:`fill_outlook_score`: the
share of cells named right, 0.0 without the format reward) into ``outlook_score``. It adds nothing
to ``reasoning_reward`` (the paper's reward stays as it is); the learner reads it for
``trainer.reasoning_advantage: outlook``.

Format gate (VAGEN ``state_reward_text_utils.py``: no format reward, no state reward). The reasoning
reward is paid only on a turn that earned the format reward (:func:`format_rewarded`): on a turn
rejected for its format or for an unknown action word (``format_reward`` 0) every applicable part
scores 0.0 (detail ``no_format_reward``) without asking any scorer and without entering the
repetition history, so good descriptions next to junk actions earn nothing. The same holds for
:func:`fallback_trajectory`.

Rule mode (``judge.rule_mode``): ``f1`` scores ``rule`` (and ``hybrid``'s extracted facts) by the
per-axis F1 above; ``vagen`` scores Sokoban and FrozenLake natural-language texts as VAGEN's code
does (:mod:`worldloop.judge.vagen_score`: target/box/hole relative to the player, both axes);
``local`` scores FrozenLake natural-language texts item by item against what its local prompt asks
for (:mod:`worldloop.judge.local_score`: the goal and the holes next to the player, both axes);
other envs and state formats as ``f1``. :func:`rule_text_score` is the ``rule`` scorer alone, for
tools that judge a text outside a judge process (the same score a judge with that mode gives).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from worldloop.common.contracts.config import JudgeConfig
from worldloop.common.metrics import metric
from worldloop.common.contracts.schemas import Trajectory, Turn
from worldloop.judge.llm import LLMClient
from worldloop.judge.local_score import local_score, local_score_facts
from worldloop.judge.rule.outlook import outlook_score
from worldloop.judge.prompts import extract_messages, parse_extraction, parse_verdict, verdict_messages
from worldloop.judge.rule import (RepetitionTracker, RuleResult, Truth, build_truth, entity_names, extract_items,
                                  items_from_extraction, score_items)
from worldloop.judge.vagen_score import VagenResult, vagen_score, vagen_score_facts

log = logging.getLogger(__name__)

# part -> (turn text field, turn state field)
PARTS: dict[str, tuple[str, str]] = {"grounding": ("observation", "state_before"),
                                     "worldmodeling": ("prediction", "state_after")}
FORMAT_PARTS: dict[str, tuple[str, ...]] = {
    "no_think": (), "free_think": (), "grounding": ("grounding",), "worldmodeling": ("worldmodeling",),
    "grounding_worldmodeling": ("grounding", "worldmodeling"),
}
LLM_SCORERS = ("llm", "hybrid")


@dataclass
class ScorerResult:
    score: float | None  # None: not applicable
    fallback: bool = False
    detail: dict = field(default_factory=dict)


@dataclass
class PartResult:
    score: float | None
    fallback: bool  # some scorer of the part fell back
    detail: dict
    real: bool = False  # the score comes from at least one scorer that did not fall back
    correct: bool = False  # the gate found every fact of the text true (no repetition penalty)


def scorers_for(cfg: JudgeConfig, env_name: str, env_id: str = "") -> list[str]:
    """The configured scorer list of an env (by env name, then gymnasium id, then "default")."""
    for key in (env_name, env_id, (env_name or "").lower()):
        if key and key in cfg.scorers:
            return list(cfg.scorers[key])
    return list(cfg.scorers.get("default", ["rule"]))


def needs_llm(cfg: JudgeConfig) -> bool:
    return any(s in LLM_SCORERS for names in cfg.scorers.values() for s in names)


def gated_aggregate(scores: list[tuple[str, float]], weights: dict[str, float], threshold: float) -> float:
    """Argos Eq. 9 over ``[(scorer, score), ...]``, the first being the gate."""
    if not scores:
        raise ValueError("nothing to aggregate")
    gate = scores[0][1]
    if gate < threshold or len(scores) == 1:
        return gate
    total = sum(weights.get(name, 1.0) for name, _ in scores)
    return sum(weights.get(name, 1.0) * s for name, s in scores) / total


class TrajectoryScorer:
    """Fills the judge fields of trajectories; one per judge process (it holds the repetition history)."""

    def __init__(self, cfg: JudgeConfig, llm: LLMClient | None = None):
        self.cfg = cfg
        self.llm = llm
        self.trackers = {part: RepetitionTracker(cfg.repetition_top_k, cfg.repetition_f1_threshold,
                                                 cfg.repetition_penalty) for part in PARTS}
        self.fallbacks = 0  # fallback scorer results (for the run-wide stats hash)
        self._m_turns = metric("worldloop_judge_scored_turns")
        self._m_fallbacks = metric("worldloop_judge_fallbacks")
        self._m_score = metric("worldloop_judge_score")

    async def score(self, traj: Trajectory) -> Trajectory:
        """Score every turn of ``traj`` in place, set ``scored = True`` and return it."""
        env = traj.env_name
        names = scorers_for(self.cfg, env, traj.env_id)
        if any(n in LLM_SCORERS for n in names) and self.llm is None:
            raise RuntimeError(f"scorers {names} for env {env!r} need an LLM client")
        parts = FORMAT_PARTS.get(traj.prompt_format)
        jobs = []
        for turn in traj.turns:
            rewarded = format_rewarded(turn)
            for part, (text_key, state_key) in PARTS.items():
                applies = part in parts if parts is not None else getattr(turn, text_key) is not None
                jobs.append(self.score_part(env, part, rewarded, getattr(turn, text_key), getattr(turn, state_key), names)
                            if applies else _none())
        results = await asyncio.gather(*jobs)
        for i, turn in enumerate(traj.turns):
            self._fill_turn(turn, dict(zip(PARTS, results[2 * i: 2 * i + 2])), names)
        traj.scored = True
        return traj

    # ------------------------------------------------------------------ one part

    async def score_part(self, env: str, part: str, rewarded: bool, text: Any, state: Any,
                         names: list[str] | None = None) -> PartResult:
        """One part of one turn: ``text`` (the turn's observation or prediction) against ``state``,
        with the format gate ``rewarded``, by the scorers ``names`` (default: the env's configured
        ones), gated and aggregated as in the module docstring.

        Before the repetition penalty, and it touches neither the repetition history nor the
        metrics (:meth:`score` does both), so tools outside a judge process (``worldloop eval``'s
        reading accuracy) get the judge's own part score without changing the judge's state."""
        names = scorers_for(self.cfg, env) if names is None else names
        missing = not isinstance(text, str) or not text.strip()
        truth = build_truth("" if missing else text, state, env)
        if truth is None:
            return PartResult(None, False, {"applicable": False})
        if not rewarded:  # no format reward, no reasoning reward: no scorer is asked
            return PartResult(0.0, False, {"no_format_reward": True}, real=True)
        if missing:
            return PartResult(0.0, False, {"missing": True}, real=True)
        results: dict[str, ScorerResult] = {}
        rest = list(names)
        if rest and rest[0] == "rule" and len(rest) > 1:  # a failing rule gate decides alone
            results["rule"] = self._rule(text, truth, env)
            rest = rest[1:]
            if results["rule"].score is not None and results["rule"].score < self.cfg.gate_threshold:
                for n in rest:
                    results[n] = ScorerResult(None, detail={"skipped": "gate below threshold"})
                rest = []
        got = await asyncio.gather(*(self._one(n, env, part, text, truth) for n in rest))
        results.update(zip(rest, got))
        ordered = [(n, results[n]) for n in names if n in results]
        real = [(n, r.score) for n, r in ordered if r.score is not None and not r.fallback]
        fallen = [(n, r.score) for n, r in ordered if r.score is not None and r.fallback]
        detail: dict = {"method": truth.method, "scorers": {n: {"score": r.score, "fallback": r.fallback, **r.detail}
                                                            for n, r in ordered}}
        if real:
            score = gated_aggregate(real, self.cfg.scorer_weights, self.cfg.gate_threshold)
            detail["gate"] = real[0][0]
        elif fallen:
            score = gated_aggregate(fallen, self.cfg.scorer_weights, self.cfg.gate_threshold)
        else:
            return PartResult(None, False, {**detail, "applicable": False})
        correct = bool(real) and bool(results[real[0][0]].detail.get("all_true"))
        return PartResult(score, bool(fallen), detail, real=bool(real), correct=correct)

    async def _one(self, name: str, env: str, part: str, text: str, truth: Truth) -> ScorerResult:
        if name == "rule":
            return self._rule(text, truth, env)
        if name == "llm":
            answer = await self.llm.ask(verdict_messages(env, part, truth.method, truth.info, text),
                                        parse_verdict, "llm")
            if answer.ok:
                return ScorerResult(answer.value, detail=_answer_detail(answer, verdict="YES" if answer.value else "NO"))
            return self._fallback(answer)
        if name == "hybrid":
            if truth.kind in ("symbolic", "elements"):  # nothing for an extractor to add to the rule here
                return ScorerResult(None, detail={"applicable": False})
            answer = await self.llm.ask(extract_messages(entity_names(truth), text), parse_extraction, "hybrid")
            if not answer.ok:
                return self._fallback(answer)
            items = items_from_extraction(answer.value, truth)
            mode = {"vagen": vagen_score_facts, "local": local_score_facts}.get(self.cfg.rule_mode)
            r = mode(items, truth, env) if mode is not None else None
            r = r if r is not None else score_items(items, truth)
            return ScorerResult(r.score, detail={**_answer_detail(answer), **r.to_dict()})
        raise ValueError(f"unknown scorer {name!r}")

    def _rule(self, text: str, truth: Truth, env: str) -> ScorerResult:
        r = _rule_result(text, truth, env, self.cfg.rule_mode)
        return ScorerResult(r.score, detail=r.to_dict())

    def _fallback(self, answer) -> ScorerResult:
        self.fallbacks += 1
        self._m_fallbacks.inc()
        score = 0.0 if answer.unparseable else self.cfg.fallback_score
        return ScorerResult(score, fallback=True, detail={"reason": answer.reason, "attempts": answer.attempts})

    # ------------------------------------------------------------------ one turn

    def _fill_turn(self, turn: Turn, parts: dict[str, PartResult], names: list[str]) -> None:
        cfg = self.cfg
        final: dict[str, float | None] = {}
        details: dict[str, Any] = {}
        for part, res in parts.items():
            text = getattr(turn, PARTS[part][0])
            penalty = 0.0
            if res.score is not None and not res.detail.get("missing") and not res.detail.get("no_format_reward"):
                penalty = self.trackers[part].apply(text, res.score if res.real else None, correct=res.correct)
            final[part] = None if res.score is None else res.score + penalty
            details[part] = {"score": final[part], "raw": res.score, "penalty": penalty, "fallback": res.fallback,
                             **res.detail}
            if final[part] is not None:
                self._m_score.labels(field=part).observe(final[part])
        g, w = final["grounding"], final["worldmodeling"]
        turn.grounding_score = g
        turn.worldmodeling_score = w
        turn.reasoning_reward = cfg.beta_grounding * (g or 0.0) + cfg.beta_worldmodeling * (w or 0.0)
        turn.judge = {"scorers": names, "fallback": any(r.fallback for r in parts.values()), **details}
        self._m_score.labels(field="reasoning").observe(turn.reasoning_reward)
        fill_outlook_score(turn)
        if turn.outlook_score is not None:
            self._m_score.labels(field="outlook").observe(turn.outlook_score)
        used = {n for r in parts.values() for n, d in r.detail.get("scorers", {}).items() if d.get("score") is not None}
        for n in used:
            self._m_turns.labels(scorer=n).inc()


def _rule_result(text: str, truth: Truth, env: str, rule_mode: str) -> RuleResult | VagenResult:
    """The ``rule`` scorer's result for ``text`` against ``truth`` in ``rule_mode`` (module docstring)."""
    mode = {"vagen": vagen_score, "local": local_score}.get(rule_mode)
    r = mode(text, truth, env) if mode is not None else None
    return r if r is not None else score_items(extract_items(text, truth), truth)


def rule_text_score(text: str | None, state: Any, env_name: str, rule_mode: str = "f1") -> RuleResult | VagenResult | None:
    """What the ``rule`` scorer of a judge with ``judge.rule_mode`` = ``rule_mode`` scores ``text``
    against ``state`` (a :class:`worldloop.common.contracts.schemas.State` or an env's state dict) before
    the repetition penalty and the format gate: a result with ``.score`` (1.0 for a right
    reading), or None when the state offers nothing to compare with."""
    truth = build_truth(text, state, env_name)
    return None if truth is None else _rule_result(text or "", truth, env_name, rule_mode)


def _answer_detail(answer, **extra) -> dict:
    return {"cached": answer.cached, "attempts": answer.attempts, **extra}


def fill_outlook_score(turn: Turn) -> None:
    """``turn.outlook_score``: the share of ``state_before.outlook``'s cells its ``<reasoning>`` names
    right (:mod:`worldloop.judge.rule.outlook`), 0.0 on a turn without the format reward (the format
    gate), None where the state has no outlook. It is not part of ``reasoning_reward``: the learner's
    ``trainer.reasoning_advantage: outlook`` pays the reasoning's tokens with it."""
    truth = turn.state_before.outlook
    score = outlook_score(turn.reasoning, truth)
    turn.outlook_score = score if score is None or format_rewarded(turn) else 0.0


def format_rewarded(turn: Any) -> bool:
    """Whether ``turn`` earned the format reward, the condition of any reasoning reward."""
    value = turn.get("format_reward") if isinstance(turn, dict) else getattr(turn, "format_reward", 0.0)
    return float(value or 0.0) > 0.0


async def _none() -> PartResult:
    return PartResult(None, False, {"applicable": False})


def fallback_trajectory(traj: Trajectory, cfg: JudgeConfig, reason: str) -> Trajectory:
    """Every applicable part gets ``fallback_score``, flagged (used when scoring itself failed)."""
    parts = FORMAT_PARTS.get(traj.prompt_format)
    for turn in traj.turns:
        scores = {}
        for part, (text_key, _) in PARTS.items():
            applies = part in parts if parts is not None else getattr(turn, text_key) is not None
            scores[part] = (cfg.fallback_score if format_rewarded(turn) else 0.0) if applies else None
        turn.grounding_score = scores["grounding"]
        turn.worldmodeling_score = scores["worldmodeling"]
        turn.reasoning_reward = (cfg.beta_grounding * (scores["grounding"] or 0.0)
                                 + cfg.beta_worldmodeling * (scores["worldmodeling"] or 0.0))
        turn.judge = {"fallback": True, "reason": reason[:500]}
        fill_outlook_score(turn)  # a rule of its own: no scorer to fall back from
    traj.scored = True
    return traj
