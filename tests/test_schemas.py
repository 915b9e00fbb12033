"""The trajectory message: round trip, and each kind of bad field names its path."""

from __future__ import annotations

import copy

import msgpack
import pytest

from common.schemas import (
    TRAJECTORY_SCHEMA,
    SchemaError,
    decode_deadletter,
    decode_trajectory,
    deadletter_message,
    empty_state,
    encode_trajectory,
    packb,
    total_turn_reward,
)


def make_turn(index: int, n_resp: int = 3) -> dict:
    return {
        "index": index,
        "policy_version": 2,
        "obs_ids": [1, 2, 3, 4],
        "response_ids": list(range(10, 10 + n_resp)),
        "logprobs": [-0.5] * n_resp,
        "images": [b"\x89PNG fake"],
        "response_text": "<think>...</think><answer>Up</answer>",
        "observation": "the box is left of the player",
        "reasoning": None,
        "prediction": "the player moves up",
        "actions": ["Up"],
        "format_ok": True,
        "env_reward": -0.1,
        "format_reward": 0.5,
        "done": False,
        "success": False,
        "state_before": empty_state(),
        "state_after": {"relations": ["box left of player"], "symbolic": "#P#", "structured": {"player": [1, 2]}},
        "actions_total": 1,
        "actions_effective": 1,
    }


def make_trajectory(tid: str = "t-1", turns: int = 2) -> dict:
    """A valid worldloop.trajectory/1 map (used by the stream tests too)."""
    return {
        "schema": TRAJECTORY_SCHEMA,
        "trajectory_id": tid,
        "group_id": "g-1",
        "env_id": "worldloop/Sokoban-v0",
        "env_name": "sokoban",
        "env_kwargs": {"dim_room": [6, 6]},
        "seed": 7,
        "actor_id": "a-1",
        "created_at": 1.5,
        "prompt_format": "grounding_worldmodeling",
        "max_turns": 3,
        "turns": [make_turn(i) for i in range(turns)],
        "success": False,
        "scored": False,
    }


def test_valid_trajectory_round_trips() -> None:
    traj = make_trajectory()
    data = encode_trajectory(traj)
    assert isinstance(data, bytes)
    assert decode_trajectory(data) == traj


def test_optional_turn_keys_may_be_absent_and_scores_present() -> None:
    traj = make_trajectory()
    traj["turns"][1].pop("reasoning")
    traj["turns"][0].update(grounding_score=0.8, worldmodeling_score=1.0, reasoning_reward=0.9, judge={"m": "rule"})
    assert decode_trajectory(encode_trajectory(traj))["turns"][0]["reasoning_reward"] == 0.9


def _broken(mutate) -> dict:
    traj = copy.deepcopy(make_trajectory())
    mutate(traj)
    return traj


BAD_CASES = [
    ("missing top-level field", lambda t: t.pop("seed"), "trajectory.seed: missing"),
    ("wrong scalar type", lambda t: t.update(seed="7"), "trajectory.seed: expected int"),
    ("bool is not an int", lambda t: t.update(max_turns=True), "trajectory.max_turns: expected int"),
    ("null in non-nullable", lambda t: t.update(actor_id=None), "trajectory.actor_id: is null"),
    ("non-finite float", lambda t: t["turns"][0].update(env_reward=float("nan")), "trajectory.turns[0].env_reward"),
    ("bad list item", lambda t: t["turns"][1]["response_ids"].__setitem__(1, "x"), "trajectory.turns[1].response_ids[1]"),
    ("nested state map", lambda t: t["turns"][0]["state_after"].pop("relations"),
     "trajectory.turns[0].state_after.relations: missing"),
    ("logprob length", lambda t: t["turns"][0]["logprobs"].pop(), "trajectory.turns[0].logprobs"),
    ("turn index order", lambda t: t["turns"][1].update(index=5), "trajectory.turns[1].index"),
    ("empty response", lambda t: t["turns"][0].update(response_ids=[], logprobs=[]), "trajectory.turns[0].response_ids"),
    ("no turns", lambda t: t.update(turns=[]), "trajectory.turns: empty"),
    ("wrong schema tag", lambda t: t.update(schema="worldloop.trajectory/0"), "schema:"),
    ("turns not a list", lambda t: t.update(turns={}), "trajectory.turns: expected a list"),
    ("end_reason not a string", lambda t: t.update(end_reason=3), "trajectory.end_reason: expected str"),
]


def test_end_reason_is_optional() -> None:
    traj = make_trajectory()
    assert "end_reason" not in decode_trajectory(encode_trajectory(traj))
    traj["end_reason"] = "max_turns"
    assert decode_trajectory(encode_trajectory(traj))["end_reason"] == "max_turns"


@pytest.mark.parametrize("label,mutate,path", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_field_names_its_path(label: str, mutate, path: str) -> None:
    traj = _broken(mutate)
    with pytest.raises(SchemaError, match=None) as ei:
        encode_trajectory(traj)
    assert path in str(ei.value), f"{label}: {ei.value}"
    # the decoder rejects the same message coming off the wire
    with pytest.raises(SchemaError) as ei2:
        decode_trajectory(packb(traj))
    assert path in str(ei2.value)


@pytest.mark.parametrize("data", [b"\xc1", b"not msgpack at all \xff", msgpack.packb([1, 2]), b""])
def test_garbage_bytes_give_schema_error(data: bytes) -> None:
    with pytest.raises(SchemaError):
        decode_trajectory(data)


def test_deadletter_round_trip_and_reject() -> None:
    rec = deadletter_message("bad", "ns:rollouts", "1-0", "c1", b"\x00\x01", 3.0)
    assert decode_deadletter(packb(rec)) == rec
    with pytest.raises(SchemaError):
        decode_deadletter(packb(make_trajectory()))


def test_total_turn_reward_sums_components() -> None:
    turn = make_turn(0)  # env -0.1 + format 0.5, unscored
    assert total_turn_reward(turn) == pytest.approx(0.4)
    turn["reasoning_reward"] = 0.25
    assert total_turn_reward(turn) == pytest.approx(0.65)
