"""Messages that cross a process boundary: msgpack maps with a ``schema`` tag.

Never pickle. Every decode validates the map against the field table below and
raises :class:`SchemaError` with a reason; consumers send such messages to the
dead-letter stream (``common.streams``) instead of crashing.

Trajectory (``worldloop.trajectory/1``): one multi-turn episode, token-in/token-out.
The learner rebuilds the model input of the whole episode as the concatenation,
turn by turn, of ``obs_ids`` (everything the model was fed before the turn's
response: system prompt and first user message for turn 0; the closing of the
previous assistant message, the next user message with its image tokens and the
assistant header for later turns) and ``response_ids`` (what the model sampled).
The loss mask is 1 exactly on ``response_ids``. ``images`` are the encoded (PNG)
images whose placeholder tokens sit inside that turn's ``obs_ids``, in order.

Field types use a small vocabulary: "str", "int", "float" (int accepted),
"bool", "bytes", "list[...]", "map", "any", a trailing "?" allows None, and a
nested field table is a sub-schema.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack

TRAJECTORY_SCHEMA = "worldloop.trajectory/1"
DEADLETTER_SCHEMA = "worldloop.deadletter/1"

STATE_FIELDS: dict[str, Any] = {
    "relations": "list[str]",  # natural-language relation sentences (VAGEN App. D.1 style)
    "symbolic": "str?",  # grid in App. C symbols (grid envs)
    "structured": "map",  # App. C dict
}

TURN_FIELDS: dict[str, Any] = {
    "index": "int",
    "policy_version": "int",  # version of the weights that generated this turn
    "obs_ids": "list[int]",
    "response_ids": "list[int]",
    "logprobs": "list[float]",  # behaviour log-probs, len == len(response_ids)
    "images": "list[bytes]",
    "response_text": "str",
    "observation": "str?",  # parsed <observation> (grounding)
    "reasoning": "str?",
    "prediction": "str?",  # parsed <prediction> (world modeling)
    "actions": "list[str]",
    "format_ok": "bool",
    "env_reward": "float",  # task reward of the turn (format reward excluded)
    "format_reward": "float",
    "done": "bool",
    "success": "bool",
    "state_before": STATE_FIELDS,
    "state_after": STATE_FIELDS,
    "actions_total": "int",  # actions executed in the turn (WMAct N)
    "actions_effective": "int",  # of those, the ones that changed the state (WMAct N_eff)
    "truncated_response": "bool",  # generation hit max_new_tokens
    # written by the judge (absent or None before scoring)
    "grounding_score": "float?",
    "worldmodeling_score": "float?",
    "reasoning_reward": "float?",
    "judge": "map?",
}

TRAJECTORY_FIELDS: dict[str, Any] = {
    "schema": "str",
    "trajectory_id": "str",
    "group_id": "str",
    "env_id": "str",
    "env_name": "str",
    "env_kwargs": "map",
    "seed": "int",
    "actor_id": "str",
    "created_at": "float",
    "prompt_format": "str",
    "max_turns": "int",
    "turns": "list[turn]",
    "success": "bool",
    "scored": "bool",
    # why the episode ended: done | max_turns | context | vision_token | env_error (actor/rollout.py)
    "end_reason": "str?",
}

OPTIONAL_TRAJECTORY_KEYS = {"end_reason"}

OPTIONAL_TURN_KEYS = {"grounding_score", "worldmodeling_score", "reasoning_reward", "judge", "truncated_response", "reasoning"}

DEADLETTER_FIELDS: dict[str, Any] = {
    "schema": "str",
    "reason": "str",
    "source_stream": "str",
    "source_id": "str",
    "consumer": "str",
    "at": "float",
    "payload": "bytes",
}


class SchemaError(ValueError):
    """A message failed to decode or does not match its schema."""


def packb(obj: dict) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpackb(data: bytes) -> Any:
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
        )
    except Exception as e:  # msgpack raises several types; all mean "not a message"
        raise SchemaError(f"payload is not valid msgpack: {type(e).__name__}: {e}") from None


def _check(path: str, spec: Any, value: Any, optional: frozenset[str] = frozenset()) -> None:
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            raise SchemaError(f"{path}: expected a map, got {type(value).__name__}")
        for k, sub in spec.items():
            if k not in value:
                if k in optional:
                    continue
                raise SchemaError(f"{path}.{k}: missing")
            _check(f"{path}.{k}", sub, value[k])
        return
    nullable = spec.endswith("?")
    base = spec[:-1] if nullable else spec
    if value is None:
        if nullable:
            return
        raise SchemaError(f"{path}: is null, expected {base}")
    if base.startswith("list[") and base.endswith("]"):
        if not isinstance(value, list):
            raise SchemaError(f"{path}: expected a list, got {type(value).__name__}")
        inner = base[5:-1]
        if inner == "turn":
            for i, v in enumerate(value):
                _check(f"{path}[{i}]", TURN_FIELDS, v, frozenset(OPTIONAL_TURN_KEYS))
            return
        for i, v in enumerate(value):
            _check_scalar(f"{path}[{i}]", inner, v)
        return
    _check_scalar(path, base, value)


def _check_scalar(path: str, base: str, value: Any) -> None:
    ok = {
        "str": lambda v: isinstance(v, str),
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
        "bool": lambda v: isinstance(v, bool),
        "bytes": lambda v: isinstance(v, (bytes, bytearray)),
        "map": lambda v: isinstance(v, dict),
        "any": lambda v: True,
    }.get(base)
    if ok is None:
        raise SchemaError(f"{path}: unknown field type {base}")
    if not ok(value):
        shown = repr(value)
        if len(shown) > 60:
            shown = shown[:57] + "..."
        raise SchemaError(f"{path}: expected {base}, got {type(value).__name__} {shown}")


def validate_trajectory(msg: Any) -> dict:
    """Validate a decoded trajectory map; return it or raise SchemaError."""
    if not isinstance(msg, dict):
        raise SchemaError(f"message: expected a map, got {type(msg).__name__}")
    schema = msg.get("schema")
    if schema != TRAJECTORY_SCHEMA:
        raise SchemaError(f"schema: expected {TRAJECTORY_SCHEMA!r}, got {schema!r}")
    _check("trajectory", TRAJECTORY_FIELDS, msg, frozenset(OPTIONAL_TRAJECTORY_KEYS))
    if not msg["turns"]:
        raise SchemaError("trajectory.turns: empty")
    for i, t in enumerate(msg["turns"]):
        if len(t["logprobs"]) != len(t["response_ids"]):
            raise SchemaError(
                f"trajectory.turns[{i}].logprobs: {len(t['logprobs'])} values for {len(t['response_ids'])} response tokens"
            )
        if t["index"] != i:
            raise SchemaError(f"trajectory.turns[{i}].index: is {t['index']}, expected {i}")
        if not t["response_ids"]:
            raise SchemaError(f"trajectory.turns[{i}].response_ids: empty")
    return msg


def encode_trajectory(traj: dict) -> bytes:
    """Validate then pack; producers fail loudly rather than ship a bad message."""
    validate_trajectory(traj)
    return packb(traj)


def decode_trajectory(data: bytes) -> dict:
    return validate_trajectory(unpackb(data))


def deadletter_message(reason: str, source_stream: str, source_id: str, consumer: str, payload: bytes, at: float) -> dict:
    return {
        "schema": DEADLETTER_SCHEMA,
        "reason": reason,
        "source_stream": source_stream,
        "source_id": source_id,
        "consumer": consumer,
        "at": float(at),
        "payload": bytes(payload),
    }


def decode_deadletter(data: bytes) -> dict:
    msg = unpackb(data)
    if not isinstance(msg, dict) or msg.get("schema") != DEADLETTER_SCHEMA:
        raise SchemaError("not a dead-letter message")
    _check("deadletter", DEADLETTER_FIELDS, msg)
    return msg


def empty_state() -> dict:
    return {"relations": [], "symbolic": None, "structured": {}}


def total_turn_reward(turn: dict) -> float:
    """r_t = reasoning reward + format reward + env reward (reasoning reward 0 when unscored)."""
    return float(turn["env_reward"]) + float(turn["format_reward"]) + float(turn.get("reasoning_reward") or 0.0)
