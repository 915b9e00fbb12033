"""How a config field is declared, and how a value that breaks it is reported.

Every section of :mod:`worldloop.common.contracts.config` is a :class:`Section`: a pydantic model that
forbids unknown keys and validates strictly, so its fields hold their type, default, bound and
one-line doc together::

    max_backlog: int = Field(512, ge=1, description="a producer waits while ...")

Strict means YAML's values are taken as they are: an ``int`` takes no float or bool, a ``bool``
takes no 0/1 and no "yes" string, a ``str`` takes no number. One YAML 1.1 quirk is undone: it
reads ``1e-6`` (no dot) as a string, so a :data:`Float` field takes such text as a number.

A bound beyond ``ge``/``gt``/``le``/``lt`` is a :class:`Rule` on the field's annotation. A bound's
error text is written once (:func:`bound_reason`) and serves the error and the generated
reference (``docs/configuration.md``); ``json_schema_extra`` may add a ``unit`` and a ``note``
(``{"unit": "seconds", "note": "no limit"}`` reads "must be > 0 seconds or null (no limit)").

:func:`config_error` turns pydantic's first error into :class:`ConfigError` naming the dotted key
(``actor.envs[1].weight``, ``judge.scorer_weights.llm``) and the reason in worldloop's words.
"""

from __future__ import annotations

import re
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Literal

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError, core_schema


class ConfigError(ValueError):
    """A configuration key is unknown or its value is invalid."""

    def __init__(self, key: str, reason: str):
        self.key = key
        self.reason = reason
        super().__init__(f"config key '{key}': {reason}")


class Section(BaseModel):
    """A config section: unknown keys are errors, values are checked strictly, defaults too.
    Assignment in code is not checked (as on any Python object)."""

    # allow_inf_nan=False: no number key takes .inf or .nan (a "no limit" is null where a key has one)
    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True, allow_inf_nan=False)


_FLOAT_TEXT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _float_text(value: Any) -> Any:
    if isinstance(value, str) and _FLOAT_TEXT.fullmatch(value.strip()):
        return float(value)  # YAML 1.1 reads 1e-6 (no dot) as a string
    return value


# a float field: ints and floats (never bools), and number text such as YAML 1.1's "1e-6"
Float = Annotated[float, BeforeValidator(_float_text)]


@dataclass(frozen=True)
class Rule:
    """A bound that ``ge``/``gt``/``le``/``lt`` cannot say, on a field's annotation:
    ``Annotated[list[str], Rule("must list ...", lambda v: ...)]``. ``reason`` is the error text
    (a ", got <value>" follows it) and the field's bound in the reference."""

    reason: str
    ok: Callable[[Any], bool]

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> core_schema.CoreSchema:
        def check(value: Any) -> Any:
            if not self.ok(value):
                raise PydanticCustomError("config_rule", "{reason}", {"reason": self.reason})
            return value

        return core_schema.no_info_after_validator_function(check, handler(source))


# a numeric bound: its sign, its attribute, and its bracket in an interval
_OPS = {Ge: (">=", "ge", "["), Gt: (">", "gt", "("), Le: ("<=", "le", "]"), Lt: ("<", "lt", ")")}


def _limit(mark: Any) -> str:
    x = getattr(mark, _OPS[type(mark)][1])
    return str(int(x)) if isinstance(x, float) and x.is_integer() else str(x)


def bound_reason(info: FieldInfo) -> str | None:
    """The field's bound as an error reason ("must be in (0, 1]", "must be > 0 seconds or null
    (no limit)", a :class:`Rule`'s text), or None for a field without one."""
    rules = [m.reason for m in info.metadata if isinstance(m, Rule)]
    lo = next((m for m in info.metadata if isinstance(m, (Ge, Gt))), None)
    hi = next((m for m in info.metadata if isinstance(m, (Le, Lt))), None)
    if lo is None and hi is None:
        return "; ".join(rules) or None
    if lo is not None and hi is not None:
        text = f"in {_OPS[type(lo)][2]}{_limit(lo)}, {_limit(hi)}{_OPS[type(hi)][2]}"
    else:
        mark = lo if lo is not None else hi
        text = f"{_OPS[type(mark)][0]} {_limit(mark)}"
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    if extra.get("unit"):
        text += f" {extra['unit']}"
    if nullable(info.annotation):
        text += " or null"
    if extra.get("note"):
        text += f" ({extra['note']})"
    return "; ".join([f"must be {text}", *rules])


def nullable(tp: Any) -> bool:
    """Whether the annotation ``tp`` admits None (``X | None``)."""
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


def unwrap(tp: Any) -> Any:
    """``tp`` without ``Annotated`` and without ``| None``."""
    while True:
        rest = [a for a in typing.get_args(tp) if a is not type(None)]
        if typing.get_origin(tp) is Annotated:
            tp = typing.get_args(tp)[0]
        elif nullable(tp) and len(rest) == 1:
            tp = rest[0]
        else:
            return tp


def _walk(root: type[BaseModel], loc: tuple) -> tuple[Any, FieldInfo | None]:
    """The annotation at ``loc`` (a pydantic error location) and the last model field on the way."""
    tp: Any = root
    info = None
    parts = list(loc)
    while parts:
        part = parts.pop(0)
        tp = unwrap(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            info = tp.model_fields.get(part)
            if info is None:
                return None, None
            tp = info.annotation
        elif typing.get_origin(tp) is list:
            tp = typing.get_args(tp)[0]
        elif typing.get_origin(tp) is dict:
            key_type, value_type = typing.get_args(tp)
            if parts[:1] == ["[key]"]:  # the entry's key itself is wrong
                parts.pop(0)
                tp = key_type
            else:
                tp = value_type
    return unwrap(tp), info


def dotted(loc: tuple) -> str:
    """A pydantic error location as a config key: ``actor.envs[1].weight``, ``judge.scorers.<key>``."""
    out = ""
    for i, part in enumerate(loc):
        if i + 1 < len(loc) and loc[i + 1] == "[key]":
            continue  # a dict key that is itself wrong: "<key>" stands for it
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            name = "<key>" if part == "[key]" else str(part)
            out += f".{name}" if out else name
    return out


_EXPECTED = {"int_type": "expected an integer", "float_type": "expected a number", "string_type": "expected a string",
             "list_type": "expected a list", "dict_type": "expected a mapping",
             "finite_number": "must be a finite number (not .inf or .nan)"}
_BOUNDS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")


def _without_union_tags(root: type[BaseModel], loc: tuple) -> tuple:
    """``loc`` less the member tags pydantic puts after a field of a union type (``int | Literal["auto"]``
    gives ``(..., "micro_batch_tokens", "int")``): the key a user wrote has no such part."""
    tp: Any = root
    out: list = []
    parts = list(loc)
    while parts:
        part = parts.pop(0)
        tp = unwrap(tp)
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            return tuple(out + parts)  # ``part`` is the member's tag; the rest (if any) lies inside it
        out.append(part)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            info = tp.model_fields.get(part)
            if info is None:
                return tuple(out + parts)
            tp = info.annotation
        elif typing.get_origin(tp) in (list, dict):
            tp = typing.get_args(tp)[-1] if part != "[key]" else typing.get_args(tp)[0]
    return tuple(out)


def config_error(exc: ValidationError, root: type[BaseModel]) -> ConfigError:
    """The first error of ``exc`` (validating ``root``) as a :class:`ConfigError`; a value that fits no
    member of a union names each member's reason, joined by "; "."""
    errors = exc.errors()
    loc = _without_union_tags(root, tuple(errors[0]["loc"]))
    same = [e for e in errors if _without_union_tags(root, tuple(e["loc"])) == loc]
    if len(same) > 1:
        reasons = [_one_error({**e, "loc": loc}, root).reason for e in same]
        return ConfigError(dotted(loc) or "<root>", "; ".join(dict.fromkeys(reasons)))
    return _one_error({**errors[0], "loc": loc}, root)


def _one_error(err: dict, root: type[BaseModel]) -> ConfigError:
    """One pydantic error (its location already a config key's) as a :class:`ConfigError`."""
    loc, kind, value = tuple(err["loc"]), err["type"], err.get("input")
    key = dotted(loc) or "<root>"
    got = f"got {type(value).__name__} {value!r}"
    if kind == "extra_forbidden":
        parent, _ = _walk(root, loc[:-1])
        known = sorted(parent.model_fields) if isinstance(parent, type) and issubclass(parent, BaseModel) else []
        return ConfigError(key, f"unknown key (known keys here: {', '.join(known)})")
    if kind in _EXPECTED:
        return ConfigError(key, f"{_EXPECTED[kind]}, {got}")
    if kind == "bool_type":
        return ConfigError(key, f"expected true/false, got {value!r}")
    if kind == "model_type":
        return ConfigError(key, f"expected a mapping for section {err['ctx']['class_name']}, got {value!r}")
    if kind == "literal_error":
        tp, _ = _walk(root, loc)
        members = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
        literals = [a for m in members if typing.get_origin(m) is Literal for a in typing.get_args(m)]
        choices = literals or err["ctx"]["expected"]
        return ConfigError(key, f"must be one of {choices}, got {value!r}")
    if kind == "config_rule":
        return ConfigError(key, f"{err['ctx']['reason']}, got {value!r}")
    if kind in _BOUNDS:
        _, info = _walk(root, loc)
        reason = bound_reason(info) if info is not None else None
        return ConfigError(key, f"{reason or err['msg']}, got {value!r}")
    return ConfigError(key, f"{err['msg'][:1].lower()}{err['msg'][1:]}, got {value!r}")
