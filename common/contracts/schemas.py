"""Messages that cross a process boundary: typed msgpack maps with a ``schema`` tag.

Never pickle. A message is a :class:`msgspec.Struct` (:class:`Trajectory`, :class:`Turn`,
:class:`State`, :class:`DeadLetter`) encoded as a msgpack map whose keys are the field names.
:func:`decode_trajectory` decodes and type-checks in one pass (``msgspec.msgpack.Decoder``), then
makes the checks a type cannot express (:func:`check_trajectory`); any failure raises
:class:`SchemaError` whose message starts with the path of the bad field
(``$.turns[1].logprobs: 2 values for 3 response tokens``). Consumers send such messages to the
dead-letter stream (``worldloop.common.transport.streams``) instead of crashing. Unknown map keys are
ignored (a newer producer may add fields); a missing required key, a null where no null is allowed,
a bool where an int is expected, a non-finite float or a wrong ``schema`` tag are errors.

Trajectory (``worldloop.trajectory/1``): one multi-turn episode, token-in/token-out.
The learner rebuilds the model input of the whole episode as the concatenation,
turn by turn, of ``obs_ids`` (everything the model was fed before the turn's
response: system prompt and first user message for turn 0; the closing of the
previous assistant message, the next user message with its image tokens and the
assistant header for later turns) and ``response_ids`` (what the model sampled).
The loss mask is 1 exactly on ``response_ids``. ``images`` are the encoded (PNG)
images whose placeholder tokens sit inside that turn's ``obs_ids``, in order.

Fields with a default (``end_reason``; a turn's ``reasoning``, ``truncated_response``,
``token_versions`` and the judge's fields) may be absent on the wire and are left out when encoding at their default.
``structured``, ``env_kwargs`` and ``judge`` are free-form maps with string keys.

Per-token versions: a turn's ``token_versions`` (optional) names the policy version that sampled each
response token (one per ``response_ids`` entry), for a response whose generation spanned a weight
load; absent, every token was sampled by ``policy_version``. When present, ``policy_version`` is
the oldest token's version (``min(token_versions)``); a wrong length or another
``policy_version`` is a :class:`SchemaError` (dead-lettered like any malformed field).
"""

from __future__ import annotations

import re
import sys
from typing import Annotated, Any, Literal

import msgpack
import msgspec

TRAJECTORY_SCHEMA = "worldloop.trajectory/1"
DEADLETTER_SCHEMA = "worldloop.deadletter/1"

# a finite float: NaN fails both bounds, +-inf fails one (msgspec accepts ints here too)
Finite = Annotated[float, msgspec.Meta(ge=-sys.float_info.max, le=sys.float_info.max)]
# Policy versions, counts (turns, actions, indices) and token ids are >= 0 and < 2^31. A version is
# compared with others inside Redis Lua scripts (common/transport/admission.py), whose numbers are doubles
# (exact only below 2^53), goes out as a float64 Prometheus gauge and into torch and vLLM int32
# tensors (token ids too: vocabularies are far below 2^31). One version per update: 2^31 updates
# at one a second would take 68 years, so nothing legitimate comes near the bound, and a 2^62
# from a broken or hostile producer is refused at decoding instead of wrapping somewhere later.
MAX_INT = 2**31
Count = Annotated[int, msgspec.Meta(ge=0, lt=MAX_INT)]
# a level's seed: gymnasium takes any int >= 0 (numpy's SeedSequence); below 2^63 fits an int64
Seed = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]


class SchemaError(ValueError):
    """A message failed to decode or does not match its schema."""


class State(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Ground truth of the env at one moment (what the judge compares the agent's text with)."""

    relations: list[str]  # natural-language relation sentences (VAGEN App. D.1 style)
    symbolic: str | None  # grid in App. C symbols (grid envs)
    structured: dict[str, Any]  # App. C dict
    # what each move runs into (the env's move_outlook(), FrozenLake): the truth of an outlook reasoning
    outlook: str | None = None


class Turn(msgspec.Struct, kw_only=True, omit_defaults=True):
    index: Count
    policy_version: Count  # version of the weights that generated this turn
    obs_ids: list[Count]  # token ids
    response_ids: list[Count]
    logprobs: list[Finite]  # behaviour log-probs, len == len(response_ids)
    images: list[bytes]
    response_text: str
    observation: str | None  # parsed <observation> (grounding)
    prediction: str | None  # parsed <prediction> (world modeling)
    actions: list[str]
    format_ok: bool
    env_reward: Finite  # task reward of the turn (format reward excluded)
    format_reward: Finite
    done: bool
    success: bool
    state_before: State
    state_after: State
    actions_total: Count  # actions executed in the turn (WMAct N)
    actions_effective: Count  # of those, the ones that changed the state (WMAct N_eff)
    reasoning: str | None = None
    truncated_response: bool = False  # generation hit max_new_tokens
    # the policy version that sampled each response token (a response whose generation spanned a weight
    # load), len == len(response_ids); None = every token was sampled by policy_version, which is then the
    # OLDEST token's version (min(token_versions)): staleness and the learner's bound count the oldest token
    token_versions: list[Count] | None = None
    # written by the judge (absent or None before scoring)
    grounding_score: Finite | None = None
    worldmodeling_score: Finite | None = None
    reasoning_reward: Finite | None = None
    # the share of state_before.outlook's cells the turn's <reasoning> names right (judge/rule/outlook.py);
    # None where the state has no outlook. Not part of reasoning_reward: trainer.reasoning_advantage reads it
    outlook_score: Finite | None = None
    judge: dict[str, Any] | None = None


class Trajectory(msgspec.Struct, kw_only=True, omit_defaults=True):
    schema: Literal["worldloop.trajectory/1"]  # always TRAJECTORY_SCHEMA
    trajectory_id: str
    group_id: str
    env_id: str
    env_name: str
    env_kwargs: dict[str, Any]
    seed: Seed
    actor_id: str
    created_at: Finite
    prompt_format: str
    max_turns: Annotated[int, msgspec.Meta(ge=1, lt=MAX_INT)]
    turns: list[Turn]
    success: bool
    scored: bool
    # why the episode ended: done | max_turns | context | vision_token | env_error (actor/rollout.py)
    end_reason: str | None = None


class DeadLetter(msgspec.Struct, kw_only=True):
    schema: Literal["worldloop.deadletter/1"]
    reason: str
    source_stream: str
    source_id: str
    consumer: str
    at: Finite
    payload: bytes


class _IdOnly(msgspec.Struct):
    trajectory_id: str


_ENCODER = msgspec.msgpack.Encoder()
_TRAJECTORY = msgspec.msgpack.Decoder(Trajectory)
_ID_ONLY = msgspec.msgpack.Decoder(_IdOnly)
_DEADLETTER = msgspec.msgpack.Decoder(DeadLetter)


def packb(obj: Any) -> bytes:
    """msgpack bytes of a struct or of plain maps/lists/bytes (str as str, bytes as bin)."""
    return _ENCODER.encode(obj)


def trajectory_id_of(data: bytes) -> str | None:
    """The ``trajectory_id`` of a payload that is a msgpack map holding one (whatever else it holds
    or lacks), else None: what a dead-lettered entry's admission refund needs."""
    try:
        return _ID_ONLY.decode(data).trajectory_id
    except Exception:  # noqa: BLE001 -- untrusted bytes: any failure (also RecursionError) means "none"
        return None


def unpackb(data: bytes) -> Any:
    """Untyped decode (maps, lists, bytes); :class:`SchemaError` when it is not msgpack."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several types; all mean "not a message"
        raise SchemaError(f"payload is not valid msgpack: {type(e).__name__}: {e}") from None


_AT = re.compile(r"^(.*) - at `(\$[^`]*)`$", re.S)
_MISSING = re.compile(r"^Object missing required field `([^`]*)`$")
_BOUND = re.compile(r"^Expected `float` [<>]= -?1\.7976931348623157e\+308$")
_ENUM = re.compile(r"^Invalid enum value (.*)$")


def _schema_error(e: msgspec.MsgspecError, expected_tag: str) -> SchemaError:
    """msgspec's "<reason> - at `<path>`" as "<path>: <reason>" in this module's words."""
    text = str(e)
    m = _AT.match(text)
    reason, path = (m.group(1), m.group(2)) if m else (text, "$")
    if not isinstance(e, msgspec.ValidationError):  # (a ValidationError is a DecodeError too)
        return SchemaError(f"payload is not valid msgpack: {text}")
    if mm := _MISSING.match(reason):
        return SchemaError(f"{path}.{mm.group(1)}: missing")
    if _BOUND.match(reason):
        return SchemaError(f"{path}: expected a finite float")
    if (mm := _ENUM.match(reason)) and path == "$.schema":
        return SchemaError(f"$.schema: expected {expected_tag!r}, got {mm.group(1)}")
    reason = reason.replace("`None`", "null")
    return SchemaError(f"{path}: {reason[:1].lower()}{reason[1:]}")


def check_trajectory(traj: Trajectory) -> Trajectory:
    """The checks a type cannot express; return ``traj`` or raise :class:`SchemaError`."""
    if not traj.turns:
        raise SchemaError("$.turns: empty")
    for i, t in enumerate(traj.turns):
        if t.index != i:
            raise SchemaError(f"$.turns[{i}].index: is {t.index}, expected {i}")
        if not t.response_ids:
            raise SchemaError(f"$.turns[{i}].response_ids: empty")
        if len(t.logprobs) != len(t.response_ids):
            raise SchemaError(f"$.turns[{i}].logprobs: {len(t.logprobs)} values for {len(t.response_ids)} response tokens")
        if t.token_versions is not None:
            if len(t.token_versions) != len(t.response_ids):
                raise SchemaError(f"$.turns[{i}].token_versions: {len(t.token_versions)} values for "
                                  f"{len(t.response_ids)} response tokens")
            if min(t.token_versions) != t.policy_version:
                raise SchemaError(f"$.turns[{i}].policy_version: is {t.policy_version}, expected the oldest of "
                                  f"token_versions ({min(t.token_versions)})")
    return traj


def _decode(decoder: msgspec.msgpack.Decoder, data: bytes, expected_tag: str) -> Any:
    """``decoder.decode(data)`` raising only :class:`SchemaError`, whatever the untrusted bytes:
    also for nesting deeper than Python's recursion limit (msgspec raises RecursionError while it
    skips an unknown field's value) and for a payload that is not bytes."""
    try:
        return decoder.decode(data)
    except (msgspec.MsgspecError, UnicodeDecodeError) as e:
        raise _schema_error(e, expected_tag) from None
    except RecursionError:
        raise SchemaError(f"payload is not a {expected_tag} message: nested deeper than the decoder allows "
                          f"({len(data)} bytes)") from None
    except TypeError as e:
        raise SchemaError(f"payload is not bytes: {e}") from None


def decode_trajectory(data: bytes) -> Trajectory:
    """Decode, type-check and check one trajectory message (one pass over the bytes); any bad
    payload raises :class:`SchemaError` and nothing else."""
    return check_trajectory(_decode(_TRAJECTORY, data, TRAJECTORY_SCHEMA))


def encode_trajectory(traj: Trajectory) -> bytes:
    """Pack, then decode the bytes back with every check: producers fail loudly rather than ship
    a bad message (a field assigned a wrong type after construction is caught here)."""
    if not isinstance(traj, Trajectory):
        raise SchemaError(f"$: expected a Trajectory, got {type(traj).__name__}")
    try:
        data = _ENCODER.encode(traj)
    except (TypeError, ValueError, OverflowError) as e:
        raise SchemaError(f"$: cannot encode: {e}") from None
    decode_trajectory(data)
    return data


def deadletter_message(reason: str, source_stream: str, source_id: str, consumer: str, payload: bytes,
                       at: float) -> DeadLetter:
    return DeadLetter(schema=DEADLETTER_SCHEMA, reason=reason, source_stream=source_stream, source_id=source_id,
                      consumer=consumer, at=float(at), payload=bytes(payload))


def decode_deadletter(data: bytes) -> DeadLetter:
    """One dead-letter record; any bad payload raises :class:`SchemaError` and nothing else."""
    return _decode(_DEADLETTER, data, DEADLETTER_SCHEMA)


def empty_state() -> State:
    return State(relations=[], symbolic=None, structured={})


def state_from_info(info: Any) -> State:
    """The :class:`State` of an env's reset/step ``info`` (``info["state"]``, a dict), coerced to
    the message types; the empty state when there is none."""
    state = info.get("state") if isinstance(info, dict) else None
    if not isinstance(state, dict):
        return empty_state()
    symbolic, outlook = state.get("symbolic"), state.get("outlook")
    return State(relations=[str(r) for r in state.get("relations") or []],
                 symbolic=None if symbolic is None else str(symbolic), structured=dict(state.get("structured") or {}),
                 outlook=None if outlook is None else str(outlook))


def total_turn_reward(turn: Turn) -> float:
    """r_t = reasoning reward + format reward + env reward (reasoning reward 0 when unscored)."""
    return float(turn.env_reward) + float(turn.format_reward) + float(turn.reasoning_reward or 0.0)
