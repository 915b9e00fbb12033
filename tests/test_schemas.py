"""The trajectory message: round trip, and each kind of bad field names its path."""

from __future__ import annotations

import copy
import re

import msgpack
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worldloop.testing.trajectories import make_trajectory, make_turn
from worldloop.common.contracts.schemas import (
    TRAJECTORY_SCHEMA,
    DeadLetter,
    SchemaError,
    State,
    Trajectory,
    Turn,
    decode_deadletter,
    decode_trajectory,
    deadletter_message,
    encode_trajectory,
    packb,
    total_turn_reward,
)


def test_valid_trajectory_round_trips() -> None:
    traj = make_trajectory()
    data = encode_trajectory(traj)
    assert isinstance(data, bytes)
    back = decode_trajectory(data)
    assert isinstance(back, Trajectory) and isinstance(back.turns[0], Turn)
    assert isinstance(back.turns[0].state_after, State)
    assert back == traj
    assert back.turns[1].state_after.structured == {"player": [1, 2]}


def test_wire_format_is_a_plain_msgpack_map() -> None:
    """Same wire as the hand-written dict producers: a map keyed by field name, bytes as bin."""
    wire = msgpack.unpackb(encode_trajectory(make_trajectory()), raw=False)
    assert wire["schema"] == TRAJECTORY_SCHEMA and wire["trajectory_id"] == "t-1"
    assert wire["turns"][0]["images"] == [b"\x89PNG fake"]
    assert wire["turns"][1]["state_after"] == {"relations": ["box left of player"], "symbolic": "#P#",
                                              "structured": {"player": [1, 2]}}
    # fields at their default are left out, as the dict producers did
    assert "end_reason" not in wire and "grounding_score" not in wire["turns"][0]
    # a map written by plain msgpack decodes (explicit nulls for the optional fields included)
    wire["turns"][0].update(grounding_score=None, judge=None, reasoning=None)
    back = decode_trajectory(msgpack.packb(wire, use_bin_type=True))
    assert back == make_trajectory()


def test_unknown_keys_are_ignored() -> None:
    wire = msgpack.unpackb(encode_trajectory(make_trajectory()), raw=False)
    wire["added_by_a_newer_actor"] = 1
    wire["turns"][0]["extra"] = [1, 2]
    assert decode_trajectory(msgpack.packb(wire, use_bin_type=True)) == make_trajectory()


def test_optional_turn_keys_may_be_absent_and_scores_present() -> None:
    traj = make_trajectory()
    traj.turns[1].reasoning = "because"
    traj.turns[0].grounding_score, traj.turns[0].worldmodeling_score = 0.8, 1
    traj.turns[0].reasoning_reward, traj.turns[0].judge = 0.9, {"m": "rule"}
    back = decode_trajectory(encode_trajectory(traj))
    assert back.turns[0].reasoning_reward == 0.9 and back.turns[0].judge == {"m": "rule"}
    assert back.turns[0].worldmodeling_score == 1.0 and back.turns[1].reasoning == "because"
    assert back.turns[1].grounding_score is None and back.turns[1].truncated_response is False


def test_token_versions_round_trip_and_are_left_out_when_absent() -> None:
    traj = make_trajectory()
    assert "token_versions" not in msgpack.unpackb(encode_trajectory(traj), raw=False)["turns"][0]
    traj.turns[0].token_versions = [2, 2, 3]  # a weight load after the second token; policy_version 2 = the oldest
    back = decode_trajectory(encode_trajectory(traj))
    assert back.turns[0].token_versions == [2, 2, 3] and back.turns[1].token_versions is None


def _wire() -> dict:
    return msgpack.unpackb(encode_trajectory(make_trajectory()), raw=False)


# mutations of the wire map (what a broken or hostile producer could send)
BAD_CASES = [
    ("missing top-level field", lambda t: t.pop("seed"), "$.seed: missing"),
    ("wrong scalar type", lambda t: t.update(seed="7"), "$.seed: expected `int`, got `str`"),
    ("bool is not an int", lambda t: t.update(max_turns=True), "$.max_turns: expected `int`, got `bool`"),
    ("null in non-nullable", lambda t: t.update(actor_id=None), "$.actor_id: expected `str`, got null"),
    ("non-finite float", lambda t: t["turns"][0].update(env_reward=float("nan")), "$.turns[0].env_reward: expected a finite float"),
    ("infinite logprob", lambda t: t["turns"][1]["logprobs"].__setitem__(2, float("-inf")),
     "$.turns[1].logprobs[2]: expected a finite float"),
    ("infinite score", lambda t: t["turns"][0].update(grounding_score=float("inf")),
     "$.turns[0].grounding_score: expected a finite float"),
    ("bad list item", lambda t: t["turns"][1]["response_ids"].__setitem__(1, "x"), "$.turns[1].response_ids[1]: expected `int`"),
    ("image not bytes", lambda t: t["turns"][0]["images"].__setitem__(0, "png"), "$.turns[0].images[0]: expected `bytes`"),
    ("nested state map", lambda t: t["turns"][0]["state_after"].pop("relations"),
     "$.turns[0].state_after.relations: missing"),
    ("state not a map", lambda t: t["turns"][1].update(state_before=[]), "$.turns[1].state_before: expected `object`"),
    ("relation not a string", lambda t: t["turns"][1]["state_after"]["relations"].append(3),
     "$.turns[1].state_after.relations[1]: expected `str`"),
    ("judge not a map", lambda t: t["turns"][0].update(judge="rule"), "$.turns[0].judge: expected `object | null`"),
    ("logprob length", lambda t: t["turns"][0]["logprobs"].pop(), "$.turns[0].logprobs: 2 values for 3 response tokens"),
    ("turn index order", lambda t: t["turns"][1].update(index=5), "$.turns[1].index: is 5, expected 1"),
    ("empty response", lambda t: t["turns"][0].update(response_ids=[], logprobs=[]), "$.turns[0].response_ids: empty"),
    ("token_versions length", lambda t: t["turns"][0].update(token_versions=[2, 3]),
     "$.turns[0].token_versions: 2 values for 3 response tokens"),
    ("policy_version not the oldest token's", lambda t: t["turns"][1].update(token_versions=[3, 4, 3]),
     "$.turns[1].policy_version: is 2, expected the oldest of token_versions (3)"),
    ("negative token version", lambda t: t["turns"][0].update(token_versions=[2, -1, 2]),
     "$.turns[0].token_versions[1]: expected `int` >= 0"),
    ("no turns", lambda t: t.update(turns=[]), "$.turns: empty"),
    ("wrong schema tag", lambda t: t.update(schema="worldloop.trajectory/0"),
     "$.schema: expected 'worldloop.trajectory/1', got 'worldloop.trajectory/0'"),
    ("no schema tag", lambda t: t.pop("schema"), "$.schema: missing"),
    ("turns not a list", lambda t: t.update(turns={}), "$.turns: expected `array`, got `object`"),
    ("end_reason not a string", lambda t: t.update(end_reason=3), "$.end_reason: expected `str | null`, got `int`"),
]


@pytest.mark.parametrize("label,mutate,message", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_field_names_its_path(label: str, mutate, message: str) -> None:
    wire = _wire()
    mutate(wire)
    with pytest.raises(SchemaError, match="^" + re.escape(message)) as ei:
        decode_trajectory(msgpack.packb(wire, use_bin_type=True))
    assert str(ei.value).startswith(message), f"{label}: {ei.value}"


# the same checks on the producer side: a struct field assigned a bad value after construction
ENCODE_CASES = [
    ("wrong scalar type", lambda t: setattr(t, "seed", "7"), "$.seed: expected `int`"),
    ("non-finite float", lambda t: setattr(t.turns[0], "env_reward", float("nan")), "$.turns[0].env_reward: expected a finite float"),
    ("logprob length", lambda t: t.turns[0].logprobs.pop(), "$.turns[0].logprobs: 2 values for 3 response tokens"),
    ("turn index order", lambda t: setattr(t.turns[1], "index", 0), "$.turns[1].index: is 0, expected 1"),
    ("no turns", lambda t: setattr(t, "turns", []), "$.turns: empty"),
    ("state not a State", lambda t: setattr(t.turns[0], "state_after", None), "$.turns[0].state_after: expected `object`, got null"),
    ("unencodable value", lambda t: setattr(t.turns[0], "judge", {"x": object()}), "$: cannot encode"),
]


@pytest.mark.parametrize("label,mutate,message", ENCODE_CASES, ids=[c[0] for c in ENCODE_CASES])
def test_encode_refuses_a_bad_struct(label: str, mutate, message: str) -> None:
    traj = copy.deepcopy(make_trajectory())
    mutate(traj)
    with pytest.raises(SchemaError, match="^" + re.escape(message)) as ei:
        encode_trajectory(traj)
    assert str(ei.value).startswith(message), f"{label}: {ei.value}"


def test_encode_refuses_a_dict() -> None:
    wire = _wire()
    with pytest.raises(SchemaError, match="expected a Trajectory, got dict"):
        encode_trajectory(wire)


def test_end_reason_is_optional() -> None:
    traj = make_trajectory()
    assert decode_trajectory(encode_trajectory(traj)).end_reason is None
    traj.end_reason = "max_turns"
    assert decode_trajectory(encode_trajectory(traj)).end_reason == "max_turns"


@pytest.mark.parametrize("data,why", [(b"\xc1", "payload is not valid msgpack: .*invalid opcode"),
                                      (b"not msgpack at all \xff", r"^\$: expected `object`, got `int`"),
                                      (msgpack.packb([1, 2]), r"^\$: expected `object`, got `array`"),
                                      (b"", "payload is not valid msgpack: Input data was truncated")])
def test_garbage_bytes_give_schema_error(data: bytes, why: str) -> None:
    with pytest.raises(SchemaError, match=why):
        decode_trajectory(data)


def test_garbage_bytes_say_not_msgpack() -> None:
    with pytest.raises(SchemaError, match="not valid msgpack"):
        decode_trajectory(b"\xc1\xc1")
    with pytest.raises(SchemaError, match=r"^\$: expected `object`, got `array`"):
        decode_trajectory(msgpack.packb([1, 2]))


def test_deadletter_round_trip_and_reject() -> None:
    rec = deadletter_message("bad", "ns:rollouts", "1-0", "c1", b"\x00\x01", 3)
    assert isinstance(rec, DeadLetter) and rec.at == 3.0
    back = decode_deadletter(packb(rec))
    assert back == rec and back.payload == b"\x00\x01" and back.reason == "bad"
    with pytest.raises(SchemaError, match=r"\$.schema: expected 'worldloop.deadletter/1', got 'worldloop.trajectory/1'"):
        decode_deadletter(packb(make_trajectory()))


def test_packb_writes_plain_maps_like_msgpack() -> None:
    obj = {"a": [1, 2.5, None, True], "b": b"\x00", "c": {"d": "e"}}
    assert packb(obj) == msgpack.packb(obj, use_bin_type=True)
    assert msgspec.msgpack.decode(packb(obj)) == obj


def test_total_turn_reward_sums_components() -> None:
    turn = make_turn(0)  # env -0.1 + format 0.5, unscored
    assert total_turn_reward(turn) == pytest.approx(0.4)
    turn.reasoning_reward = 0.25
    assert total_turn_reward(turn) == pytest.approx(0.65)


# issue 38, finding 13: versions, counts and token ids are >= 0 and < 2^31 (common/contracts/schemas.py says
# why), a seed >= 0 and < 2^63, max_turns >= 1
BOUND_CASES = [
    ("policy version 2^62", lambda t: t["turns"][1].update(policy_version=2**62),
     "$.turns[1].policy_version: expected `int` <= 2147483647"),
    ("policy version 2^31", lambda t: t["turns"][0].update(policy_version=2**31),
     "$.turns[0].policy_version: expected `int` <= 2147483647"),
    ("negative policy version", lambda t: t["turns"][0].update(policy_version=-1),
     "$.turns[0].policy_version: expected `int` >= 0"),
    ("negative max_turns", lambda t: t.update(max_turns=-3), "$.max_turns: expected `int` >= 1"),
    ("zero max_turns", lambda t: t.update(max_turns=0), "$.max_turns: expected `int` >= 1"),
    ("negative actions_total", lambda t: t["turns"][0].update(actions_total=-1),
     "$.turns[0].actions_total: expected `int` >= 0"),
    ("negative actions_effective", lambda t: t["turns"][1].update(actions_effective=-2),
     "$.turns[1].actions_effective: expected `int` >= 0"),
    ("huge actions_total", lambda t: t["turns"][0].update(actions_total=2**40),
     "$.turns[0].actions_total: expected `int` <= 2147483647"),
    ("negative token id", lambda t: t["turns"][1]["response_ids"].__setitem__(0, -5),
     "$.turns[1].response_ids[0]: expected `int` >= 0"),
    ("token id 2^33", lambda t: t["turns"][0]["obs_ids"].__setitem__(0, 2**33),
     "$.turns[0].obs_ids[0]: expected `int` <= 2147483647"),
    ("negative turn index", lambda t: t["turns"][0].update(index=-1), "$.turns[0].index: expected `int` >= 0"),
    ("negative seed", lambda t: t.update(seed=-7), "$.seed: expected `int` >= 0"),
    ("seed 2^63", lambda t: t.update(seed=2**63), "$.seed: expected `int` <= 9223372036854775807"),
]


@pytest.mark.parametrize("label,mutate,message", BOUND_CASES, ids=[c[0] for c in BOUND_CASES])
def test_out_of_bound_integers_are_refused_naming_their_path(label: str, mutate, message: str) -> None:
    wire = _wire()
    mutate(wire)
    with pytest.raises(SchemaError, match=re.escape(message)):
        decode_trajectory(msgpack.packb(wire, use_bin_type=True))


@settings(max_examples=200, deadline=None)
@given(version=st.integers(min_value=-(2**63), max_value=2**64 - 1), actions=st.integers(-(2**40), 2**40))
def test_integer_bounds_property(version: int, actions: int) -> None:
    """Every policy version and action count in [0, 2^31) round-trips; every other one is refused
    with the field's path, as SchemaError (never a crash or a silent wrap)."""
    wire = _wire()
    wire["turns"][1]["policy_version"] = version
    wire["turns"][0]["actions_total"] = actions
    data = msgpack.packb(wire, use_bin_type=True)
    if 0 <= version < 2**31 and 0 <= actions < 2**31:
        back = decode_trajectory(data)
        assert (back.turns[1].policy_version, back.turns[0].actions_total) == (version, actions)
    else:
        bad = "$.turns[0].actions_total" if not 0 <= actions < 2**31 else "$.turns[1].policy_version"
        with pytest.raises(SchemaError, match=re.escape(bad) + ": expected `int`"):
            decode_trajectory(data)
