#!/usr/bin/env python3
"""Where the suite's time goes: CPU seconds beside wall seconds, per test and per module.

A pytest plugin and its summary. ``--durations`` gives wall time only, and on a 2-core machine a
test that waits (a sleep, a server starting, a partition) costs the other worker nothing, while one
that computes slows both. This plugin records, for each test on each xdist worker, its wall time and
the CPU time of the worker process (``self``) and of the child processes it reaped (``children``:
``worldloop up`` and its roles, ``torchrun`` ranks, ``redis-server``s stopped by the test). What a
test leaves running past its end (a module-scoped ``vllm serve``) is counted by nobody.

    PYTHONPATH=tools python -m pytest -p pytest_cpu -n 3 --dist loadgroup   # writes $PYTEST_CPU_OUT
    python tools/pytest_cpu.py [DIR] [--top N]                              # prints the tables

``PYTEST_CPU_OUT`` (default ``.pytest_cpu``) holds one JSON line per test in ``<worker>.jsonl``;
a new session with the plugin starts the folder afresh
(``tests/README.md`` "Where the time goes" has a whole run's table).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

OUT_ENV = "PYTEST_CPU_OUT"
DEFAULT_OUT = ".pytest_cpu"


def _out_dir() -> Path:
    return Path(os.environ.get(OUT_ENV, DEFAULT_OUT))


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


def _worker(config) -> str | None:
    """The xdist worker's id ("gw0", ...), None in the controller or a run without xdist. Read from the
    config, not from $PYTEST_XDIST_WORKER, which a pytest started by a test on a worker inherits."""
    workerinput = getattr(config, "workerinput", None)
    return None if workerinput is None else str(workerinput["workerid"])


# ------------------------------------------------------------------ the plugin (pytest hooks)

def pytest_sessionstart(session) -> None:
    """Every process makes the folder; the controller (or a run without xdist) empties it, and xdist
    workers only append (their first record comes at the end of their first test)."""
    out = _out_dir()
    out.mkdir(parents=True, exist_ok=True)
    if _worker(session.config) is None:
        for old in out.glob("*.jsonl"):
            old.unlink()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # noqa: ARG001 (pytest's signature)
    own0, kids0 = _cpu()
    t0 = time.monotonic()
    yield
    own1, kids1 = _cpu()
    record = {"id": item.nodeid, "wall": round(time.monotonic() - t0, 3), "self": round(own1 - own0, 3),
              "children": round(kids1 - kids0, 3)}
    with open(_out_dir() / f"{_worker(item.config) or 'main'}.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


# ------------------------------------------------------------------ the summary

def load(folder: Path) -> list[dict]:
    """Every record of ``folder``'s ``*.jsonl``; a line that is not a record raises ValueError with its place."""
    rows = []
    for path in sorted(folder.glob("*.jsonl")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                rows.append({"id": str(rec["id"]), "wall": float(rec["wall"]), "self": float(rec["self"]),
                             "children": float(rec["children"])})
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a pytest_cpu record ({e})") from None
    return rows


def by_module(rows: list[dict]) -> list[dict]:
    """Per test file: wall and CPU seconds summed over its tests, most CPU first."""
    acc: dict[str, dict] = defaultdict(lambda: {"wall": 0.0, "cpu": 0.0, "tests": 0})
    for r in rows:
        m = acc[r["id"].split("::", 1)[0]]
        m["wall"] += r["wall"]
        m["cpu"] += r["self"] + r["children"]
        m["tests"] += 1
    return sorted(({"module": k, **v} for k, v in acc.items()), key=lambda m: (-m["cpu"], m["module"]))


def table(rows: list[dict], top: int) -> str:
    mods = by_module(rows)
    wall = sum(r["wall"] for r in rows)
    cpu = sum(r["self"] + r["children"] for r in rows)
    lines = [f"{len(rows)} tests: {wall:.0f} s of worker wall time, {cpu:.0f} s of CPU counted "
             f"({cpu / wall if wall else 0:.2f} CPU s per wall s)",
             "", "| module | tests | wall s | CPU s | CPU / wall |", "| --- | --- | --- | --- | --- |"]
    for m in mods[:top]:
        ratio = m["cpu"] / m["wall"] if m["wall"] else 0.0
        lines.append(f"| `{m['module']}` | {m['tests']} | {m['wall']:.1f} | {m['cpu']:.1f} | {ratio:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Print per-module wall and CPU seconds from a pytest_cpu run.")
    p.add_argument("folder", nargs="?", default=os.environ.get(OUT_ENV, DEFAULT_OUT))
    p.add_argument("--top", type=int, default=30)
    a = p.parse_args(argv)
    folder = Path(a.folder)
    if not folder.is_dir():
        print(f"pytest_cpu: no folder {folder}; run pytest with -p pytest_cpu first", file=sys.stderr)
        return 2
    try:
        rows = load(folder)
    except ValueError as e:
        print(f"pytest_cpu: {e}", file=sys.stderr)
        return 2
    if not rows:
        print(f"pytest_cpu: {folder} holds no records", file=sys.stderr)
        return 2
    print(table(rows, a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
