"""tests/ci.py: what counts as CI, and that a missing tool or a broken import skips locally and fails on CI."""

from __future__ import annotations

import sys

import pytest

from ci import on_ci, require_import, require_tool, unavailable


def outcome(fn, *args, **kwargs) -> tuple[str, str]:
    """("skip" | "fail" | "returned", message): caught here, so that a helper that skips where it
    must fail makes this test fail instead of skipping it."""
    try:
        fn(*args, **kwargs)
    except pytest.skip.Exception as e:
        return "skip", str(e)
    except pytest.fail.Exception as e:
        return "fail", str(e)
    return "returned", ""


@pytest.mark.parametrize("value, want", [
    ("true", True), ("TRUE", True), (" yes ", True), ("1", True), ("Yes", True),
    ("", False), ("0", False), ("false", False), ("no", False), ("on", False),
])
def test_on_ci_accepts_true_1_and_yes(monkeypatch, value: str, want: bool) -> None:
    monkeypatch.setenv("CI", value)
    assert on_ci() is want


def test_without_ci_a_missing_tool_or_import_skips_with_the_reason(monkeypatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    assert outcome(require_tool, "no-such-tool-xyz", install="apt-get install xyz") == (
        "skip", "no-such-tool-xyz is not installed (apt-get install xyz)")
    kind, why = outcome(require_import, "no_such_module_xyz")
    assert kind == "skip" and why.startswith("no_such_module_xyz does not import: ModuleNotFoundError"), why
    # required=True (WORLDLOOP_REQUIRE_VLLM=1) fails even outside CI
    kind, why = outcome(require_import, "no_such_module_xyz", required=True)
    assert kind == "fail" and "no_such_module_xyz does not import" in why, why


def test_on_ci_a_missing_tool_or_a_broken_import_fails(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CI", "true")
    kind, why = outcome(require_tool, "no-such-tool-xyz")
    assert kind == "fail" and "no-such-tool-xyz is not installed" in why, why
    kind, why = outcome(unavailable, "refused")
    assert kind == "fail" and why.startswith("refused") and "on CI this is a failure" in why, why
    # an installed module that raises something other than ImportError at import is a failure too
    (tmp_path / "broken_mod_xyz.py").write_text("raise RuntimeError('half-installed')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    kind, why = outcome(require_import, "broken_mod_xyz")
    sys.modules.pop("broken_mod_xyz", None)
    assert kind == "fail" and "broken_mod_xyz does not import: RuntimeError: half-installed" in why, why


def test_what_is_there_is_returned(monkeypatch) -> None:
    monkeypatch.setenv("CI", "true")
    assert require_tool("no-such-tool-xyz", "python3").endswith("python3")  # the first one found
    assert require_import("json").dumps([1]) == "[1]"
