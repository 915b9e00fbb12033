"""The import rules of worldloop (tools/check_layers.py): no cycles, nothing imports upward, roles
never import each other, contracts import no transport; layers come from folders; and benches never import the tests."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import check_layers  # noqa: E402


def test_the_tree_keeps_the_import_rules() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "check_layers.py")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 cycles, 0 layer violations" in proc.stdout


def test_the_checker_finds_a_cycle_and_each_kind_of_violation() -> None:
    graph = {
        "worldloop.common.contracts.schemas": {"worldloop.common.transport.streams"},      # a contract imports transport
        "worldloop.common.transport.streams": set(),
        "worldloop.actor.rollout": {"worldloop.learner.trainer"},       # a role imports another role
        "worldloop.learner.trainer": {"worldloop.envs.base"},           # only actors/apps import envs
        "worldloop.envs.base": {"worldloop.common.transport.streams"},            # envs import only contracts
        "worldloop.judge.rule": {"worldloop.up"},                       # upward
        "worldloop.up": {"worldloop.status"},
        "worldloop.status": {"worldloop.up"},                           # a cycle
    }
    found = "\n".join(check_layers.violations(graph))
    for words in ("upward: contracts imports transport", "a role imports another role", "only actors and applications import envs",
                  "envs import transport", "upward: roles imports apps"):
        assert words in found, (words, found)
    assert check_layers.cycles(graph) == [["worldloop.status", "worldloop.up"]]
    assert check_layers.cycles({"a": {"b"}, "b": set()}) == []


def test_lazy_and_type_checking_imports_count(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from worldloop.up import x\n"
                 "def g():\n    from worldloop.learner import trainer\n")
    known = {"worldloop.up", "worldloop.learner", "worldloop.learner.trainer", "worldloop.actor.m"}
    assert check_layers.imports_of("worldloop.actor.m", f, known) == {"worldloop.up", "worldloop.learner.trainer"}


def test_benches_never_import_the_tests() -> None:
    for f in sorted((ROOT / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n == "tests" or n.startswith("tests.") or n.startswith("test_") for n in names), f"{f.name} imports {names}"


def test_layers_come_from_folders() -> None:
    # a module's layer is read off its path: nothing to register when a file is added
    assert check_layers.layer("worldloop.common.contracts.schemas") == "contracts"
    assert check_layers.layer("worldloop.common.contracts") == "contracts"
    assert check_layers.layer("worldloop.common.transport.weights.codec") == "transport"
    assert check_layers.layer("worldloop.common.transport.brand_new") == "transport"
    assert check_layers.layer("worldloop.common.metrics") == "utilities"
    assert check_layers.layer("worldloop.common") == "utilities"
    assert check_layers.layer("worldloop.envs.grid.sokoban") == "envs"
    assert check_layers.layer("worldloop.learner.trainer") == "roles"
    assert check_layers.layer("worldloop.eval.stats") == "apps"
    found = "\n".join(check_layers.violations({"worldloop.common.metrics": {"worldloop.common.transport.streams"},
                                                "worldloop.common.transport.streams": set()}))
    assert "upward: utilities imports transport" in found, found


def test_the_old_config_path_still_imports_and_names_the_new_one() -> None:
    # worldloop.common.config is a public path users import; it moved with a deprecation
    proc = subprocess.run(
        [sys.executable, "-W", "always::DeprecationWarning", "-c",
         "import worldloop.common.config as old, worldloop.common.contracts.config as new\n"
         "assert old is new, (old, new)\n"
         "print(old.Config.__module__)"],
        capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "worldloop.common.contracts.config"
    assert "worldloop.common.config moved to worldloop.common.contracts.config" in proc.stderr


def test_the_judge_imports_only_the_env_families_registry_and_family_truths_no_env_code() -> None:
    graph = {
        "worldloop.judge.rule.truths": {"worldloop.envs.family"},       # allowed: the registry
        "worldloop.judge.prompts": {"worldloop.envs.grid.truth"},       # a family's module: not allowed
        "worldloop.learner.trainer": {"worldloop.envs.family"},         # the learner imports no envs at all
        "worldloop.envs.family": set(),
        "worldloop.envs.grid.truth": {"worldloop.envs.family", "worldloop.envs.grid.sokoban"},  # env code: not allowed
        "worldloop.envs.grid.sokoban": {"worldloop.envs.base"},
        "worldloop.envs.base": set(),
    }
    found = check_layers.violations(graph)
    assert found == [
        "worldloop.envs.grid.truth -> worldloop.envs.grid.sokoban: a family's truth module imports only "
        "worldloop.envs.family and contracts",
        "worldloop.judge.prompts -> worldloop.envs.grid.truth: only actors and applications import envs "
        "(the judge: only worldloop.envs.family)",
        "worldloop.learner.trainer -> worldloop.envs.family: only actors and applications import envs "
        "(the judge: only worldloop.envs.family)",
    ], found
