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


def test_the_readme_runs_the_tests_as_ci_does() -> None:
    """The README's test command (the paragraph **Run the tests**) is the pytest line of .ci/run, word for word."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    ci_cmd = [line.strip() for line in (root / ".ci/run").read_text().splitlines()
              if line.strip().startswith("python -m pytest")]
    readme = (root / "README.md").read_text()
    block = re.search(r"\*\*Run the tests\*\*.*?```bash\n(.*?)```", readme, re.S).group(1)
    assert ci_cmd == [line for line in block.splitlines() if line.startswith("python -m pytest")], (ci_cmd, block)
    assert "--dist loadgroup" in ci_cmd[0] and "--durations=30" in ci_cmd[0]


def test_every_serial_module_exists_and_its_tests_are_grouped(request) -> None:
    """conftest.SERIAL_LANES name test files that exist (a renamed file would silently leave its lane),
    each in one lane only; every file with a test marked vllm is in the lane serial-engines (never two
    vLLM engines at once); a test of a lane's module is in that lane's group, any other in its
    module's; the lanes come first in the collection, in their order, then conftest.HEAVY_MODULES."""
    import re
    from collections import Counter
    from pathlib import Path

    import conftest

    here = Path(__file__).resolve().parent
    named = [m for lane in conftest.SERIAL_LANES.values() for m in lane]
    assert [m for m, n in Counter(named).items() if n > 1] == [] and conftest.SERIAL_MODULES == set(named)
    assert sorted(m for m in [*named, *conftest.HEAVY_MODULES] if not (here / f"{m}.py").exists()) == []
    assert not set(conftest.HEAVY_MODULES) & conftest.SERIAL_MODULES
    vllm = {p.stem for p in here.glob("test_*.py") if re.search(r"pytest\.mark\.vllm\b", p.read_text())}
    assert vllm and sorted(vllm - set(conftest.SERIAL_LANES["serial-engines"])) == []
    assert conftest.xdist_group_of(request.node.nodeid) == "test_ci"
    assert [conftest.xdist_group_of(n) for n in ("tests/test_up.py::t[a-b]", "tests/test_hf_backend.py::t",
                                                  "tests/test_vllm_backend.py::T::t", "tests/test_chaos.py::t",
                                                  "tests/test_netns.py::t")] == [
        "serial-runs", "test_hf_backend", "serial-engines", "serial-soak", "serial-runs-b"]
    first = [*conftest.SERIAL_LANES, *conftest.HEAVY_MODULES]
    groups = [conftest.xdist_group_of(item.nodeid) for item in request.session.items]
    rank = [first.index(g) if g in first else len(first) for g in groups]
    assert rank == sorted(rank)


def test_a_module_marked_in_order_gets_its_written_order_back_in_its_places() -> None:
    """conftest.in_written_order on a shuffled list: the in_order module's tests (x at lines 5, 9, 9
    with parameters 0 and 1) take back their written order in the places they held; the others stay."""
    from pathlib import Path
    from types import SimpleNamespace

    import conftest

    def item(name: str, path: str, line: int, param: int | None = None, in_order: bool = False):
        return SimpleNamespace(name=name, path=Path(path), location=(path, line, name),
                               callspec=SimpleNamespace(indices={"p": param}) if param is not None else None,
                               get_closest_marker=lambda m: object() if (in_order and m == "in_order") else None)

    x = [item("x9b", "x.py", 9, 1, True), item("a", "a.py", 3), item("x5", "x.py", 5, None, True),
         item("x9a", "x.py", 9, 0, True), item("b", "a.py", 1)]
    conftest.in_written_order(x)
    assert [i.name for i in x] == ["x5", "a", "x9a", "x9b", "b"]


def test_the_shared_tiny_model_is_built_once_per_arguments_and_read_only(shared_tiny_model) -> None:
    """Defaults filled in: no seed and seed=0 are one model; other arguments another; every file
    read-only (mode 444: a write fails, except as root, where the check after each test catches it);
    force=True (a rebuild over the shared one) refused."""
    import stat

    import conftest

    a = shared_tiny_model(max_image_side=56)
    assert shared_tiny_model(seed=0, max_image_side=56) == a and shared_tiny_model(max_image_side=112) != a
    files = [p for p in a.rglob("*") if p.is_file()]
    assert (a / "config.json") in files and {stat.S_IMODE(p.stat().st_mode) for p in files} == {0o444}
    assert conftest._SHARED_MODELS[a] == conftest._files_of(a)  # what the check after this test compares
    with pytest.raises(ValueError, match="force=True rebuilds a shared model"):
        shared_tiny_model(max_image_side=56, force=True)
