"""tools/pytest_cpu.py: a real pytest run with the plugin records each test's wall time and the CPU
time of the worker and of the children it reaped, one JSONL file per worker; the summary sums them
per module, and refuses a folder it cannot read with the place and the reason."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"


def _tool():
    spec = importlib.util.spec_from_file_location("pytest_cpu_tool", TOOLS / "pytest_cpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


tool = _tool()

# CPU is spent by CPU time, not by wall time: the busy tests burn 0.5 s of process time however
# loaded the machine is, and the sleeping one burns almost none however long it waits
CASES = '''
import subprocess, sys, time

BURN = "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.5: pass"

def test_burns_in_the_worker():
    exec(BURN)

def test_burns_in_a_child():
    subprocess.run([sys.executable, "-c", BURN], check=True)

def test_sleeps():
    time.sleep(0.5)
'''


def _run(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    (tmp_path / "cases").mkdir(exist_ok=True)
    (tmp_path / "cases" / "test_cases.py").write_text(CASES)
    out = tmp_path / "cpu"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TOOLS), os.environ.get("PYTHONPATH", "")]),
               PYTEST_CPU_OUT=str(out))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "pytest_cpu", "-p", "no:randomly", "-p", "no:cacheprovider",
                           "-q", "--rootdir", str(tmp_path / "cases"), "-c", os.devnull, *extra, str(tmp_path / "cases")],
                          capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, out


def _by_name(out: Path) -> dict[str, dict]:
    return {r["id"].rsplit("::", 1)[1]: r for r in tool.load(out)}


def test_the_plugin_splits_worker_cpu_child_cpu_and_waiting(tmp_path) -> None:
    _, out = _run(tmp_path)
    assert [p.name for p in out.glob("*.jsonl")] == ["main.jsonl"]
    rows = _by_name(out)
    assert sorted(rows) == ["test_burns_in_a_child", "test_burns_in_the_worker", "test_sleeps"]
    worker, child, sleeper = rows["test_burns_in_the_worker"], rows["test_burns_in_a_child"], rows["test_sleeps"]
    assert worker["self"] >= 0.45 and worker["children"] < 0.05, worker
    assert child["children"] >= 0.45 and child["self"] < 0.45, child
    assert sleeper["wall"] >= 0.5 and sleeper["self"] + sleeper["children"] < 0.25, sleeper
    # a second session starts the folder afresh: three records again, not six
    _run(tmp_path)
    assert len(tool.load(out)) == 3


def test_each_xdist_worker_writes_its_own_file(tmp_path) -> None:
    _, out = _run(tmp_path, "-n", "2", "--dist", "load")
    files = sorted(p.name for p in out.glob("*.jsonl"))
    assert set(files) <= {"gw0.jsonl", "gw1.jsonl"} and files, files
    assert sorted(_by_name(out)) == ["test_burns_in_a_child", "test_burns_in_the_worker", "test_sleeps"]


def test_modules_are_summed_and_ordered_by_cpu(tmp_path) -> None:
    (tmp_path / "gw0.jsonl").write_text(
        json.dumps({"id": "tests/test_a.py::x", "wall": 3.0, "self": 1.0, "children": 0.5}) + "\n"
        + json.dumps({"id": "tests/test_b.py::y", "wall": 10.0, "self": 0.0, "children": 4.0}) + "\n\n")
    (tmp_path / "gw1.jsonl").write_text(json.dumps({"id": "tests/test_a.py::z[1]", "wall": 1.0, "self": 2.0,
                                                    "children": 0.0}) + "\n")
    mods = tool.by_module(tool.load(tmp_path))
    # test_a: wall 3 + 1 = 4, CPU (1 + 0.5) + (2 + 0) = 3.5; test_b: wall 10, CPU 4 -> test_b first
    assert mods == [{"module": "tests/test_b.py", "wall": 10.0, "cpu": 4.0, "tests": 1},
                    {"module": "tests/test_a.py", "wall": 4.0, "cpu": 3.5, "tests": 2}]
    text = tool.table(tool.load(tmp_path), top=1)
    # 14 s of wall, 7.5 s of CPU: 0.54 CPU s per wall s; only the top module is listed
    assert text.splitlines()[0] == "3 tests: 14 s of worker wall time, 8 s of CPU counted (0.54 CPU s per wall s)"
    assert "| `tests/test_b.py` | 1 | 10.0 | 4.0 | 0.40 |" in text and "test_a" not in text


def test_a_bad_line_or_folder_is_named(tmp_path, capsys) -> None:
    (tmp_path / "gw0.jsonl").write_text(json.dumps({"id": "t::x", "wall": 1}) + "\n")
    with pytest.raises(ValueError, match=r"gw0\.jsonl:1: not a pytest_cpu record"):
        tool.load(tmp_path)
    assert tool.main([str(tmp_path)]) == 2
    assert "gw0.jsonl:1" in capsys.readouterr().err
    assert tool.main([str(tmp_path / "missing")]) == 2
    assert "no folder" in capsys.readouterr().err
    (tmp_path / "gw0.jsonl").write_text("")
    assert tool.main([str(tmp_path)]) == 2
    assert "holds no records" in capsys.readouterr().err
