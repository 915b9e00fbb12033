"""``worldloop --version`` and ``worldloop config show`` in a subprocess (``python -m worldloop``)."""

from __future__ import annotations

from pathlib import Path

import yaml

import worldloop
from worldloop.common.contracts.config import load_config, to_dict
from test_cli import cli

ROOT = Path(__file__).resolve().parent.parent




def test_version_prints_the_installed_version() -> None:
    out = cli("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"worldloop {worldloop.__version__}"
    assert worldloop.__version__ != "0+unknown"  # the distribution is installed (pip install -e .)


def test_config_show_prints_the_resolved_config_as_yaml(tmp_path: Path) -> None:
    out = cli("config", "show", "configs/tiny-sokoban.yaml", "trainer.total_steps=7", "redis.namespace=abc")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("# worldloop ") and "configs/tiny-sokoban.yaml" in out.stdout.splitlines()[0]
    shown = yaml.safe_load(out.stdout)
    assert shown["trainer"]["total_steps"] == 7 and shown["redis"]["namespace"] == "abc"
    assert shown["run"]["name"] == "tiny-sokoban"  # from the file
    expected = to_dict(load_config("configs/tiny-sokoban.yaml", ["trainer.total_steps=7", "redis.namespace=abc"]))
    assert shown == yaml.safe_load(yaml.safe_dump(_lists(expected)))  # every key, every default filled in
    # what it prints is a config: loading it back gives the same config
    saved = tmp_path / "resolved.yaml"
    saved.write_text(out.stdout)
    again = cli("config", "show", str(saved))
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines()[1:] == out.stdout.splitlines()[1:]


def test_config_show_without_a_file_shows_the_defaults_with_overrides() -> None:
    out = cli("config", "show", "actor.num_envs=3")
    assert out.returncode == 0, out.stderr
    assert "(built-in defaults)" in out.stdout.splitlines()[0]
    assert yaml.safe_load(out.stdout)["actor"]["num_envs"] == 3


def test_config_show_names_the_bad_key_and_the_reason_and_exits_2() -> None:
    out = cli("config", "show", "configs/tiny-sokoban.yaml", "trainer.total_stepz=7")
    assert out.returncode == 2 and out.stdout == ""
    assert "config key 'trainer.total_stepz': unknown key" in out.stderr
    out = cli("config", "show", "configs/tiny-sokoban.yaml", "trainer.total_steps=-3")
    assert out.returncode == 2
    assert "config key 'trainer.total_steps': must be >= 1, got -3" in out.stderr
    out = cli("config", "show", "no/such/config.yaml")
    assert out.returncode == 2 and "no/such/config.yaml" in out.stderr


def _lists(obj):
    if isinstance(obj, dict):
        return {k: _lists(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_lists(v) for v in obj]
    return obj
