"""Per-turn credit inputs (worldloop.learner.credit): GiGPO's anchors and step-group stats, the observation's
token span found with the real tokenizer, and the observation advantage of a small batch by hand."""

from __future__ import annotations

import pytest
import torch

from worldloop.bootstrap.tiny_model import fallback_corpus
from worldloop.common.contracts.modeling import ChatCodec, build_sequence, collate
from worldloop.common.contracts.schemas import State, decode_trajectory, encode_trajectory
from worldloop.learner.credit import (REASONING, observation_advantages, observation_char_span, observation_token_span,
                                      reasoning_advantages, step_group_stats, tag_token_span, trajectory_anchors,
                                      turn_anchor)
from worldloop.testing.trajectories import synthetic_trajectory


@pytest.fixture(scope="module")
def codec(shared_tiny_model) -> ChatCodec:
    model = shared_tiny_model(seed=0, max_image_side=112, corpus=fallback_corpus())
    return ChatCodec(model, max_image_side=112)


def _grid(player: int) -> State:
    rows = ["____", "____"]
    rows[0] = rows[0][:player] + "P" + rows[0][player + 1 :]
    return State(relations=["goal is below the player"], symbolic="\n".join(rows), structured={"player": [0, player]})


def test_anchors_are_equal_exactly_for_equal_states() -> None:
    assert turn_anchor(_grid(1)) == turn_anchor(_grid(1))
    assert turn_anchor(_grid(1)) != turn_anchor(_grid(2))
    # key order of the structured dict does not matter; any field that differs does
    a = State(relations=["x"], symbolic=None, structured={"a": 1, "b": [2, 3]})
    b = State(relations=["x"], symbolic=None, structured={"b": [2, 3], "a": 1})
    assert turn_anchor(a) == turn_anchor(b)
    assert turn_anchor(a) != turn_anchor(State(relations=["y"], symbolic=None, structured={"a": 1, "b": [2, 3]}))


def test_step_group_stats_count_shared_turns(codec: ChatCodec) -> None:
    trajs = [synthetic_trajectory(codec, trajectory_id=f"t{i}", turns=2, response_tokens=3, group_id=g)
             for i, g in enumerate(["g", "g", "h"])]
    # synthetic states depend on the turn index only: g's two rows share both turns, h's row is alone
    trajs[1].turns[1].state_before = _grid(3)
    anchors = trajectory_anchors(trajs)
    assert anchors[0][0] == anchors[1][0] == anchors[2][0] and anchors[0][1] != anchors[1][1]
    assert step_group_stats(trajs) == {"turns": 6, "shared": 2, "shared_fraction": pytest.approx(2 / 6)}


def test_observation_token_span_covers_exactly_the_observation(codec: ChatCodec) -> None:
    text = ("<think><observation>goal is below and on the left side of the player.</observation><reasoning>"
            "</reasoning><prediction>goal is below the player.</prediction></think><answer>Left</answer>")
    ids = codec.encode_response(text)
    assert observation_char_span(text) == (len("<think><observation>"), text.index("</observation>"))
    s, e = observation_token_span(ids, codec.tokenizer)
    inner = codec.decode(ids[s:e])
    assert "goal is below and on the left side of the player." in inner
    assert "reasoning" not in inner and "think" not in inner
    # one token fewer on either side no longer covers the observation
    assert "goal is below and on the left side of the player." not in codec.decode(ids[s + 1 : e])
    assert "goal is below and on the left side of the player." not in codec.decode(ids[s : e - 1])
    assert observation_token_span(codec.encode_response("<think></think><answer>Up</answer>"), codec.tokenizer) is None
    assert observation_token_span(codec.encode_response("<observation>open</observation"), codec.tokenizer) is None
    assert observation_token_span([], codec.tokenizer) is None


OBS_TEXT = "<think><observation>goal is left of the player.</observation><reasoning></reasoning></think><answer>Left</answer>"
# Two groups: g = rows 0, 1 (2 turns each), h = row 2 (1 turn); per turn (grounding score, format reward)
OBS_PLAN = [("g", [(1.0, 0.5), (0.5, 0.5)]), ("g", [(0.0, 0.5), (0.7, 0.0)]), ("h", [(0.8, 0.5)])]


def _batch(codec: ChatCodec, text: str = OBS_TEXT, plan: list = OBS_PLAN, field: str = "grounding_score") -> list:
    """Trajectories of ``plan``: per row its group and per turn (score, format reward), the score in
    ``field``; every response is ``text``. The default: grounding scores row 0: 1.0, 0.5; row 1: 0.0,
    unscored (format failed); row 2: 0.8."""
    out = []
    for i, (group, turns) in enumerate(plan):
        traj = synthetic_trajectory(codec, trajectory_id=f"o{i}", turns=len(turns), response_tokens=3, group_id=group)
        for turn, (g, fmt) in zip(traj.turns, turns):
            turn.response_ids = codec.encode_response(text)
            turn.logprobs = [-1.0] * len(turn.response_ids)
            turn.format_reward = fmt
            setattr(turn, field, g)
        out.append(decode_trajectory(encode_trajectory(traj)))  # what the learner reads off the wire
    return out


def _expected(want: dict, layouts: list, span: tuple[int, int], shape: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """The mask and values with ``want[(row, turn)]`` on the ``span`` of that turn's response."""
    mask, values = torch.zeros(shape), torch.zeros(shape)
    for (b, t), v in want.items():
        start = layouts[b].turn_spans[t][0]
        mask[b, start + span[0] : start + span[1]] = 1
        values[b, start + span[0] : start + span[1]] = v
    return mask, values


def test_observation_advantages_by_hand(codec: ChatCodec) -> None:
    trajs = _batch(codec)
    layouts = [build_sequence(x) for x in trajs]
    shape = tuple(collate(layouts, codec)["input_ids"].shape)
    span = observation_token_span(trajs[0].turns[0].response_ids, codec.tokenizer)
    # group baseline: g's scored turns 1.0, 0.5, 0.0 -> mean 0.5 (row 1's second turn earned no format reward);
    # coef 2: row 0: +1.0, 0.0; row 1: -1.0, none; h: 0.8 alone -> 0.0
    want = {(0, 0): 1.0, (0, 1): 0.0, (1, 0): -1.0, (2, 0): 0.0}
    mask, values, stats = observation_advantages(trajs, range(3), codec, shape, baseline="group", coef=2.0)
    expect_mask, expect_values = _expected(want, layouts, span, shape)
    assert torch.equal(mask, expect_mask) and torch.equal(values, expect_values)
    assert stats == {"turns": 4, "local_tokens": 4 * (span[1] - span[0])}
    # a rank holding rows 1..2 gets the same values for its rows (the baseline is the whole batch's)
    mask_r, values_r, _ = observation_advantages(trajs, range(1, 3), codec, shape, baseline="group", coef=2.0)
    assert torch.equal(values_r[:2], values[1:]) and torch.equal(mask_r[:2], mask[1:])
    # step baseline: synthetic states depend on the turn only, so g's turn 0 (1.0, 0.0) -> mean 0.5,
    # g's turn 1 (0.5 alone: row 1's is unscored) -> 0; coef 1
    _, values_s, _ = observation_advantages(trajs, range(3), codec, shape, baseline="step", coef=1.0)
    s0, s1 = layouts[0].turn_spans[0][0] + span[0], layouts[0].turn_spans[1][0] + span[0]
    assert values_s[0, s0].item() == pytest.approx(0.5) and values_s[1, s0].item() == pytest.approx(-0.5)
    assert values_s[0, s1].item() == 0.0
    with pytest.raises(ValueError, match="baseline"):
        observation_advantages(trajs, range(3), codec, shape, baseline="episode")


def test_reasoning_advantages_by_hand(codec: ChatCodec) -> None:
    """The reasoning's tokens get coef x (outlook score - group mean), from the judge's outlook_score;
    turns without one (no outlook in the state, or no format reward) keep the task advantage."""
    text = ("<think><observation>goal is left of the player.</observation><reasoning>Left ice, Down hole, Right "
            "edge, Up goal.</reasoning><prediction>x</prediction></think><answer>Left</answer>")
    # outlook scores by turn: row 0: 1.0, 0.25; row 1: 0.5, None (no outlook); row 2 (group h): 0.0 but no format reward
    plan = [("g", [(1.0, 0.5), (0.25, 0.5)]), ("g", [(0.5, 0.5), (None, 0.5)]), ("h", [(0.0, 0.0)])]
    trajs = _batch(codec, text, plan, "outlook_score")
    for traj in trajs:  # a grounding score on every turn changes nothing here
        for turn in traj.turns:
            turn.grounding_score = 0.3
    layouts = [build_sequence(x) for x in trajs]
    shape = tuple(collate(layouts, codec)["input_ids"].shape)
    span = tag_token_span(trajs[0].turns[0].response_ids, codec.tokenizer, REASONING)
    inner = codec.decode(trajs[0].turns[0].response_ids[span[0]:span[1]])
    assert "Left ice, Down hole, Right edge, Up goal." in inner and "observation" not in inner
    assert "answer" not in inner and "prediction" not in inner
    # g's scored turns 1.0, 0.25, 0.5 -> mean 0.583..; coef 3: +1.25, -1.0, -0.25; h takes no part
    mean = (1.0 + 0.25 + 0.5) / 3
    want = {(0, 0): 3 * (1.0 - mean), (0, 1): 3 * (0.25 - mean), (1, 0): 3 * (0.5 - mean)}
    mask, values, stats = reasoning_advantages(trajs, range(3), codec, shape, baseline="group", coef=3.0)
    expect_mask, expect_values = _expected(want, layouts, span, shape)
    assert torch.equal(mask, expect_mask) and torch.allclose(values, expect_values)
    assert stats == {"turns": 3, "local_tokens": 3 * (span[1] - span[0])}
    # the observation's span is another one: the two advantages never touch the same token
    obs_mask, _, _ = observation_advantages(trajs, range(3), codec, shape)
    assert obs_mask.sum() > 0 and not bool((obs_mask * mask).any())


def test_config_keys_of_the_credit_options() -> None:
    from worldloop.common.contracts.config import ConfigError, config_from_dict
    from worldloop.common.contracts.config_checks import held_group_size

    cfg = config_from_dict({"trainer": {"estimator": "gigpo", "observation_advantage": "grounding",
                                        "observation_baseline": "step", "gigpo_gamma": 0.5},
                            "actor": {"n_samples_per_seed": 4}})
    assert held_group_size(cfg) == 4  # gigpo trains whole groups, as grpo does
    with pytest.raises(ConfigError, match=r"trainer\.observation_advantage"):
        config_from_dict({"trainer": {"observation_advantage": "grounding"}, "judge": {"enabled": False},
                          "actor": {"n_samples_per_seed": 2}})
    with pytest.raises(ConfigError, match=r"trainer\.estimator"):
        config_from_dict({"trainer": {"estimator": "gigpo"}})  # groups of one
    with pytest.raises(ConfigError, match=r"trainer\.gigpo_gamma"):
        config_from_dict({"trainer": {"gigpo_gamma": 1.5}})
    with pytest.raises(ConfigError, match=r"trainer\.observation_advantage_coef"):
        config_from_dict({"trainer": {"observation_advantage_coef": -1.0}})
    with pytest.raises(ConfigError, match=r"trainer\.reasoning_advantage.*judge\.enabled"):
        config_from_dict({"trainer": {"reasoning_advantage": "outlook"}, "judge": {"enabled": False},
                          "actor": {"n_samples_per_seed": 2}})
    with pytest.raises(ConfigError, match=r"trainer\.reasoning_advantage.*n_samples_per_seed"):
        config_from_dict({"trainer": {"reasoning_advantage": "outlook"}, "actor": {"n_samples_per_seed": 1}})
    with pytest.raises(ConfigError, match=r"trainer\.reasoning_advantage_coef"):
        config_from_dict({"trainer": {"reasoning_advantage_coef": -0.5}})
