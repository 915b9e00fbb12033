"""docs/configuration.md is what the config schema generates (tools/gen_config_docs.py), and the
schema documents itself: every field has a one-line doc, every rule across fields a docstring."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from worldloop.common.contracts import config_checks
from worldloop.common.contracts.config import Config, ConfigError, EnvSpec, LoraConfig, load_config, to_dict
from worldloop.common.contracts.config_fields import bound_reason, unwrap

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import gen_config_docs  # noqa: E402


def test_docs_configuration_md_is_what_the_schema_generates() -> None:
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == gen_config_docs.render(), (
        "docs/configuration.md is stale: regenerate it with `python tools/gen_config_docs.py` and commit it")


def test_the_check_mode_fails_on_a_stale_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stale = tmp_path / "configuration.md"
    stale.write_text(gen_config_docs.render().replace("`redis.max_backlog` | int | `512`", "`redis.max_backlog` | int | `7`"))
    monkeypatch.setattr(gen_config_docs, "OUT", stale)
    monkeypatch.setattr(gen_config_docs, "ROOT", tmp_path)
    assert gen_config_docs.main(["--check"]) == 1
    assert gen_config_docs.main([]) == 0 and gen_config_docs.main(["--check"]) == 0
    assert stale.read_text() == gen_config_docs.render()
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_config_docs.py"), "--check"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def _sections() -> list[tuple[str, type[BaseModel]]]:
    return [(name, unwrap(info.annotation)) for name, info in Config.model_fields.items()] + [("actor.envs[]", EnvSpec),
                                                                                        ("model.lora", LoraConfig)]


def test_every_key_is_in_the_reference_with_its_doc_default_and_bound() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    keys = [f"{prefix}.{name}" for prefix, model in _sections() for name in model.model_fields]
    assert len(keys) > 150
    for (prefix, model) in _sections():
        assert model.__doc__, model
        for name, info in model.model_fields.items():
            assert info.description and len(info.description) >= 10, f"{prefix}.{name} needs a one-line description"
            row = next(line for line in text.splitlines() if line.startswith(f"| `{prefix}.{name}` |"))
            assert gen_config_docs.cell(info.description) in row
            reason = bound_reason(info)
            if reason:
                assert gen_config_docs.cell(reason.removeprefix("must be ")) in row
    # the defaults of the whole tree are in the table as JSON
    flat = to_dict(load_config(None))
    assert "| `trainer.actor_lr` | float | `1e-06` | " in text and flat["trainer"]["actor_lr"] == 1e-06
    assert "| `redis.claim_idle_ms` | int | `60000` | in [1000, 2592000000] ms (" in text


def test_every_rule_across_fields_is_described_in_prose() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    rules = text.split("## Rules across fields", 1)[1]
    for fn in (config_checks.pass_rule_mode, *config_checks.CROSS_CHECKS):
        assert fn.__doc__ and gen_config_docs.prose(fn) in rules, fn.__name__


def test_the_reference_states_the_bound_that_the_error_names() -> None:
    # the bound text of the reference and of the error come from one place
    with pytest.raises(ConfigError, match="judge.cache_size") as e:
        load_config(None, ["judge.cache_size=-1"])
    row = next(line for line in (ROOT / "docs" / "configuration.md").read_text().splitlines()
               if line.startswith("| `judge.cache_size` |"))
    assert e.value.reason == "must be >= 0 (0 = no cache), got -1" and "| >= 0 (0 = no cache) |" in row
