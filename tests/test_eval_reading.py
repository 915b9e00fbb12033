"""First-turn reading accuracy (worldloop/eval/reading.py): a turn reads its board right when every
relation its observation states is true (at least one stated) as the judge's rule scorer finds, or
that scorer gives it 1.0; counted by hand on real env episodes, and the same verdict as the judge's
own TrajectoryScorer."""

from __future__ import annotations

import asyncio
import copy

import gymnasium
import pytest

from worldloop import envs  # noqa: F401  (registers the ids)
from worldloop.bootstrap.sft import make_demonstrations
from worldloop.common.contracts.config import JudgeConfig
from worldloop.common.contracts.modeling import ChatCodec
from worldloop.common.contracts.schemas import state_from_info
from worldloop.eval.reading import first_turn_reading, observation_score, reading_right
from worldloop.judge.scoring import TrajectoryScorer

FROZENLAKE = {"size": 4, "render_mode": "vision", "image_size": 56, "prompt_format": "grounding_worldmodeling"}


@pytest.fixture(scope="module")
def demos(shared_tiny_model) -> list:
    """Four expert FrozenLake episodes (full observations: every relation of the board)."""
    codec = ChatCodec(shared_tiny_model(max_image_side=56), max_image_side=56)
    return make_demonstrations([{"id": "worldloop/FrozenLake-v0", "kwargs": FROZENLAKE}], 4, 7_000_000, codec, 2)


def _board(seed: int = 3) -> tuple[str, object]:
    env = gymnasium.make("worldloop/FrozenLake-v0", size=4, render_mode="text")
    _, info = env.reset(seed=seed)
    truth = str(env.unwrapped.describe_state(info["state"]))
    env.close()
    return truth, state_from_info(info)


@pytest.mark.parametrize("mode", ["f1", "vagen"])
def test_the_whole_true_description_reads_right_and_other_texts_do_not(mode: str) -> None:
    truth, state = _board()
    judge = JudgeConfig(rule_mode=mode)

    def right(text, rewarded=True):
        return reading_right(text, state, "frozenlake", format_rewarded=rewarded, judge=judge)

    assert truth.count(".") >= 3  # seed 3: the goal and several holes
    assert right(truth) is True
    assert right("the goal is far away") is False
    assert right(truth, rewarded=False) is False  # no format reward, no reasoning reward: the judge's gate
    assert right(None) is False  # asked for, missing
    # the goal's relation alone leaves the holes out: its score is below 1.0 in both modes
    first = truth.split(". ")[0] + "."
    assert observation_score(first, state, "frozenlake", format_rewarded=True, judge=judge) < 1.0
    if mode == "f1":  # but every relation it states is true: a concise observation reads right
        assert right(first) is True
        # one true relation and one false one: not right
        wrong = "the goal is above the player" if "below" in first else "the goal is below the player"
        assert right(first + " " + wrong + ".") is False


def test_a_state_with_nothing_to_compare_is_not_counted() -> None:
    assert reading_right("a red circle", {}, "svg", format_rewarded=True, judge=JudgeConfig()) is None


def test_first_turn_reading_counts_by_hand(demos: list) -> None:
    trajs = copy.deepcopy(demos)
    trajs[1].turns[0].observation = "the goal is far away"  # well-formed, wrong
    trajs[2].turns[0].format_reward = 0.0  # right words, no format reward
    trajs[3].turns[0].observation = None  # nothing parsed
    if len(trajs[0].turns) > 1:
        trajs[0].turns[1].observation = "wrong"  # a later turn does not count
    out = first_turn_reading(trajs, JudgeConfig())
    assert out["turns"] == {"all": 4, "frozenlake": 4}
    assert out["right"] == {"all": 1, "frozenlake": 1}
    assert out["rate"] == {"all": 0.25, "frozenlake": 0.25}
    # a prompt format without an observation is left out
    trajs[0].prompt_format = "worldmodeling"
    assert first_turn_reading(trajs, JudgeConfig())["turns"]["all"] == 3


def test_the_verdict_is_the_judge_processes_own(demos: list) -> None:
    """Reading right == the verdict a fresh TrajectoryScorer of the judge records for the first turn
    (every stated relation true, or the grounding score 1.0; no repetition history yet: no penalty),
    for right, cut-short, wrong and unrewarded observations."""
    trajs = copy.deepcopy(demos)
    trajs[1].turns[0].observation = trajs[1].turns[0].observation.split(". ")[0] + "."
    trajs[2].turns[0].observation = "hole0 is above the player."
    trajs[3].turns[0].format_reward = 0.0
    for mode in ("f1", "vagen"):
        judge = JudgeConfig(rule_mode=mode)
        scored = [asyncio.run(TrajectoryScorer(judge).score(copy.deepcopy(t))) for t in trajs]
        for t, s in zip(trajs, scored):
            first = t.turns[0]
            mine = reading_right(first.observation, first.state_before, t.env_name,
                                 format_rewarded=first.format_reward > 0, judge=judge)
            rule = s.turns[0].judge["grounding"].get("scorers", {}).get("rule", {})
            assert mine == (bool(rule.get("all_true")) or s.turns[0].grounding_score == 1.0), (mode, s.turns[0].judge)
        verdicts = [reading_right(t.turns[0].observation, t.turns[0].state_before, t.env_name,
                                  format_rewarded=t.turns[0].format_reward > 0, judge=judge) for t in trajs]
        assert verdicts[0] is True and verdicts[3] is False  # the whole truth; no format reward
        assert verdicts[1] is (mode == "f1")  # the first relation alone: true, but vagen mode scores it below 1.0
