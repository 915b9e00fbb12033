"""What the next move depends on: FrozenLake's ``relation_prompt="local"``, the judge's ``local`` rule
mode, and a repetition penalty that spares correct (concise) observations. Values by hand."""

from __future__ import annotations

import asyncio

import gymnasium
import pytest

from worldloop import envs  # noqa: F401  (registers worldloop/* ids)
from worldloop.common.contracts.config import ConfigError, JudgeConfig, config_from_dict
from worldloop.common.contracts.schemas import State
from worldloop.envs.grid.frozenlake import frozenlake_state
from worldloop.envs.parsing import parse_response
from worldloop.judge.local_score import local_score, local_truth_items
from worldloop.judge.rule import RepetitionTracker, build_truth
from worldloop.judge.scoring import TrajectoryScorer, rule_text_score
from worldloop.testing.trajectories import make_trajectory

DESC = ["SFFF",
        "FHFF",
        "FFFH",
        "HFFG"]  # holes (1,1) (2,3) (3,0), goal (3,3)


def _local(player: tuple[int, int]) -> list[str]:
    return frozenlake_state(DESC, player, local=True)["relations"]


# ----------------------------------------------------------------------------- the env's truth


def test_local_relations_are_the_goal_and_the_holes_next_to_the_player() -> None:
    # (0,0): the hole at (1,1) is diagonal (distance 1); (2,3) and (3,0) are further
    assert _local((0, 0)) == ["goal is below and on the right side of the player",
                              "hole is below and on the right side of the player"]
    # (2,2): (1,1) above-left and (2,3) right are next to it, (3,0) is two columns away; reading order
    assert _local((2, 2)) == ["goal is below and on the right side of the player",
                              "hole is above and on the left side of the player",
                              "hole is at the same row and to the right of the player"]
    # (0,3): no hole within one cell
    assert _local((0, 3)) == ["goal is below and at the same column as the player"]
    # after a fall into (1,1): that hole is at the player's own cell; (2,3) is two columns away
    assert _local((1, 1)) == ["goal is below and on the right side of the player",
                              "hole is at the same place as the player"]
    # (3,1): (3,0) left; (2,3)? two columns away; (1,1)? two rows away
    assert _local((3, 1)) == ["goal is at the same row and to the right of the player",
                              "hole is at the same row and to the left of the player"]
    # the default relations are untouched: the goal and every hole by index
    assert frozenlake_state(DESC, (0, 0))["relations"][1] == "hole0 is below and on the right side of the player"
    assert len(frozenlake_state(DESC, (0, 0))["relations"]) == 4


def test_the_local_prompt_asks_for_it_and_the_expert_writes_exactly_it() -> None:
    env = gymnasium.make("worldloop/FrozenLake-v0", desc=DESC, relation_prompt="local", render_mode="text")
    try:
        _, info = env.reset(seed=0)
        u = env.unwrapped
        assert info["state"]["relations"] == _local((0, 0))
        prompt = u.system_prompt()
        assert "every hole next to the player" in prompt and 'calling every hole "hole"' in prompt
        # the prompt's example is local too: (1,3) of its board has the hole right below it
        assert "<observation>goal is below and at the same column as the player. hole is below and at the same " \
               "column as the player.</observation>" in prompt
        parsed = parse_response(u.expert_response(), "grounding_worldmodeling")
        assert parsed.observation == ". ".join(_local((0, 0))) + "."
        _, _, _, _, info = env.step(u.expert_response())
        assert parsed.prediction == ". ".join(info["state"]["relations"]) + "."
    finally:
        env.close()
    with pytest.raises(ValueError, match="relation_prompt"):
        gymnasium.make("worldloop/Sokoban-v0", relation_prompt="local")  # Sokoban keeps its relations


# ----------------------------------------------------------------------------- the judge's local mode


def _state(player: tuple[int, int], local: bool = True) -> dict:
    return frozenlake_state(DESC, player, local=local)


def test_local_mode_scores_a_correct_observation_one_and_wrong_ones_by_hand() -> None:
    s = _state((2, 2))  # truth: target(below,right), hole(above,left), hole(same,right)
    truth = build_truth("x", s, "frozenlake")
    assert local_truth_items(truth) == [("target", "below", "right"), ("hole", "above", "left"),
                                        ("hole", "same", "right")]
    right = ". ".join(s["relations"]) + "."
    r = local_score(right, truth, "frozenlake")
    assert (r.score, r.matched, r.predicted, r.truth, r.all_true) == (1.0, 3, 3, 3, True)
    # free wording, another order: the same items
    assert local_score("A hole is in the same row, to my right. The goal is below me and to my right. There is a hole "
                       "above and to the left of me.", truth, "frozenlake").score == 1.0
    # goal only: m=1, p=1, n=3 -> P=1, R=1/3, F1 = 2*(1/3)/(4/3) = 0.5, every stated item true
    r = local_score("goal is below and on the right side of the player", truth, "frozenlake")
    assert r.score == pytest.approx(0.5) and r.all_true
    # goal wrong (left), the upper hole right, a hole that is not there: m=1, p=3, n=3 -> F1 = 1/3
    wrong = ("goal is below and on the left side of the player. hole is above and on the left side of the player. "
             "hole is below and at the same column as the player.")
    r = local_score(wrong, truth, "frozenlake")
    assert r.score == pytest.approx(1 / 3) and not r.all_true
    # an axis right is not an item right: goal (below, same) matches nothing -> 0
    assert local_score("goal is below and at the same column as the player", truth, "frozenlake").score == 0.0
    # a repeated sentence counts once
    assert local_score(right + " " + right, truth, "frozenlake").score == 1.0
    # an indexed name (the default prompt's) still names a hole: 1 of 3 items -> 0.5
    assert local_score("hole0 is above and on the left side of the player", truth, "frozenlake").score == pytest.approx(0.5)
    # other envs are not scored by this mode
    assert local_score(right, truth, "sokoban") is None


def test_rule_text_score_follows_the_rule_mode() -> None:
    s = State(**_state((0, 3)))  # truth: the goal below, same column (no hole next to it)
    text = "goal is below and at the same column as the player."
    assert rule_text_score(text, s, "frozenlake", "local").score == 1.0
    assert rule_text_score(text, s, "frozenlake", "f1").score == 1.0
    assert rule_text_score("hole is above the player", s, "frozenlake", "local").score == 0.0
    assert rule_text_score(text, State(relations=[], symbolic=None, structured={}), "frozenlake", "local") is None


def _fl_trajectory(tid: str, observation: str, before: dict) -> object:
    traj = make_trajectory(tid, turns=1)
    traj.env_name, traj.env_id, traj.prompt_format = "frozenlake", "worldloop/FrozenLake-v0", "grounding"
    turn = traj.turns[0]
    turn.observation, turn.prediction = observation, None
    turn.state_before = turn.state_after = State(**before)
    return traj


def _grounding(scorer: TrajectoryScorer, tid: str, observation: str, before: dict) -> tuple[float, float]:
    t = asyncio.run(scorer.score(_fl_trajectory(tid, observation, before))).turns[0]
    return t.grounding_score, t.judge["grounding"]["penalty"]


def test_repetition_penalty_never_fires_on_a_correct_concise_observation() -> None:
    """The preset's case: one true relation (the goal's) scored against every relation (f1 mode)."""
    full = _state((2, 2), local=False)  # goal + 3 holes: 4 sentences, 8 per-axis facts
    scorer = TrajectoryScorer(JudgeConfig(repetition_top_k=2))
    concise = "goal is below and on the right side of the player."
    # 2 of 8 facts, precision 1: F1 = 2*1*(1/4)/(5/4) = 0.4 < 0.7, frequent from the second time on
    assert _grounding(scorer, "c1", concise, full) == (pytest.approx(0.4), 0.0)
    assert _grounding(scorer, "c2", concise, full) == (pytest.approx(0.4), 0.0)
    assert _grounding(scorer, "c3", concise, full) == (pytest.approx(0.4), 0.0)
    # a wrong sentence repeated still pays: "goal is above ..." is 1 of 2 stated facts true
    # (the column, right): P = 1/2, R = 1/8 -> F1 = 2*(1/16)/(5/8) = 0.2; the second time - 0.1
    wrong = "goal is above and on the right side of the player."
    assert _grounding(scorer, "w1", wrong, full) == (pytest.approx(0.2), 0.0)
    assert _grounding(scorer, "w2", wrong, full) == (pytest.approx(0.2 - 0.1), pytest.approx(-0.1))
    # local mode: the goal alone where a hole is next to the player is incomplete but true: 0.5, no penalty
    local = TrajectoryScorer(JudgeConfig(repetition_top_k=2, rule_mode="local"))
    for tid in ("l1", "l2"):
        assert _grounding(local, tid, concise, _state((2, 2))) == (pytest.approx(0.5), 0.0)
    # a correct local observation scores 1.0, however often it recurs
    right = ". ".join(_state((2, 2))["relations"]) + "."
    for tid in ("r1", "r2", "r3"):
        assert _grounding(local, tid, right, _state((2, 2))) == (1.0, 0.0)


def test_repetition_tracker_spares_correct_texts() -> None:
    tr = RepetitionTracker(top_k=1, threshold=1.0, penalty=0.1)
    assert tr.apply("goal is below.", 1.0) == 0.0
    assert tr.apply("goal is below.", 1.0) == 0.0  # frequent, at the threshold, but the top score
    assert tr.apply("goal is below.", 0.3, correct=True) == 0.0  # every stated fact true
    assert tr.apply("goal is below.", 0.3) == -0.1


# ----------------------------------------------------------------------------- the config


def test_rule_mode_local_gives_frozenlake_the_local_prompt_only() -> None:
    cfg = config_from_dict({"judge": {"rule_mode": "local"},
                            "actor": {"envs": [{"id": "worldloop/FrozenLake-v0"}, {"id": "worldloop/Sokoban-v0"}]}})
    assert [e.kwargs for e in cfg.actor.envs] == [{"relation_prompt": "local"}, {}]
    with pytest.raises(ConfigError, match=r"actor\.envs\[0\]\.kwargs\.relation_prompt"):
        config_from_dict({"actor": {"envs": [{"id": "worldloop/FrozenLake-v0", "kwargs": {"relation_prompt": "local"}}]}})
    with pytest.raises(ConfigError, match="repetition_f1_threshold"):
        config_from_dict({"judge": {"repetition_f1_threshold": 1.5}})
