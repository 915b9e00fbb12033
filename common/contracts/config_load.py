"""From YAML text to a plain config tree: files, shipped presets and ``key.sub=value`` overrides.

Nothing here knows the schema; :func:`worldloop.common.contracts.config.config_from_dict` validates the tree
this module builds. An override's value is parsed as YAML, so ``actor.envs=[{id: x}]`` and
``judge.base_url=null`` work. Every error is a :class:`ConfigError` naming the key (or ``<file>``
/ ``<root>``) and the reason.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from worldloop.common.contracts.config_fields import ConfigError


def parse_override(text: str) -> tuple[str, Any]:
    """``key.sub=value`` -> (``key.sub``, the value parsed as YAML; an empty value is "")."""
    if "=" not in text:
        raise ConfigError(text, "an override must look like key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(text, "an override must name a key before '='")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(key, f"value {raw!r} is not valid YAML: {e}") from None
    return key, value


def set_dotted(tree: dict, key: str, value: Any) -> None:
    """Set ``key`` (dotted) in the nested dict ``tree``, making the sections on the way."""
    parts = key.split(".")
    node = tree
    for i, p in enumerate(parts[:-1]):
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        elif not isinstance(nxt, dict):
            raise ConfigError(".".join(parts[: i + 1]), "is a value, not a section; cannot set a sub-key")
        node = nxt
    node[parts[-1]] = value


def deep_copy(x: Any) -> Any:
    """A copy of a tree of dicts and lists (the leaves are shared)."""
    if isinstance(x, dict):
        return {k: deep_copy(v) for k, v in x.items()}
    if isinstance(x, list):
        return [deep_copy(v) for v in x]
    return x


def with_overrides(data: dict | None, overrides: list[str] | tuple[str, ...] = ()) -> dict:
    """A copy of ``data`` with every override applied in order (the caller's dict is untouched)."""
    tree = data or {}
    if not isinstance(tree, dict):
        raise ConfigError("<root>", "the config file must be a mapping of sections")
    tree = deep_copy(tree)
    for ov in overrides:
        set_dotted(tree, *parse_override(ov))
    return tree


def preset_names() -> list[str]:
    """The presets shipped in the package (``worldloop.configs``), without ``.yaml``."""
    return sorted(f.name[: -len(".yaml")] for f in resources.files("worldloop.configs").iterdir() if f.name.endswith(".yaml"))


def resolve_config_path(path: str | os.PathLike) -> Path:
    """A config file: ``path`` itself when it exists, else the shipped preset of that name
    (``tiny-sokoban`` or ``tiny-sokoban.yaml``), so presets work from a non-editable install."""
    p = Path(path)
    if p.exists():
        return p
    name = p.name[: -len(".yaml")] if p.name.endswith(".yaml") else p.name
    if str(p) in (name, name + ".yaml", f"configs/{name}.yaml"):
        preset = resources.files("worldloop.configs") / f"{name}.yaml"
        if preset.is_file():
            return Path(str(preset))
    raise ConfigError("<file>", f"config file {str(p)!r} does not exist and is not a preset (presets: {', '.join(preset_names())})")


def read_config_file(path: str | os.PathLike) -> tuple[dict, Path]:
    """The mapping a config file (or preset) holds, and the file it was read from."""
    p = resolve_config_path(path)
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError("<file>", f"{p} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError("<root>", f"{p} must hold a mapping of sections, got {type(data).__name__}")
    return data, p


def run_dir_of(cfg: Any) -> Path:
    """The run folder of a config: ``run.run_dir``, or ``runs/<run.name>`` when it is unset (the
    learner writes there; the evaluator reads the final checkpoint from there)."""
    return Path(cfg.run.run_dir) if cfg.run.run_dir else Path("runs") / cfg.run.name


def get_key(cfg: Any, dotted: str) -> Any:
    """The value at a dotted key: ``get_key(cfg, "trainer.actor_lr")``."""
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def to_dict(cfg: Any) -> dict:
    """The config (or a section) as plain data, for logs, the run directory and child processes."""
    return cfg.model_dump()


def env_label(spec: Any) -> str:
    """Short env name used in metrics labels: worldloop/Sokoban-v0 -> sokoban."""
    if spec.name:
        return spec.name
    base = spec.id.split("/")[-1]
    return base.split("-v")[0].lower()
