#!/usr/bin/env python3
"""Check worldloop's import rules: no import cycles and no import that runs up the layers.

    python tools/check_layers.py            # prints the rules, the counts, and every violation
    python tools/check_layers.py --graph    # also prints every module's worldloop imports

Layers, lowest first, read from the folders (``worldloop/__init__.py`` says what each holds):

    contracts    common/contracts/    worldloop.common.contracts.*  (config, schemas, keys, modeling, logprobs)
    utilities    common/*.py          the small modules at the top of worldloop.common (metrics, files, ...)
    transport    common/transport/    worldloop.common.transport.*  (Redis streams, admission, lease, weights, ...)
    envs         envs/                worldloop.envs.*
    roles        actor/ judge/ learner/
    apps         worldloop/           (cli, up, plot, status, bootstrap, eval, testing)

Rules: a module imports only its own layer or lower ones; a role never imports another role;
only actors and applications import envs, but the judge imports the env families' registry
``worldloop.envs.family``; contracts import only contracts; envs import only contracts; a family's
truth module (``worldloop.envs.<family>.truth``) imports only the registry and contracts. Every
import counts, also the lazy ones inside functions and those under ``TYPE_CHECKING``. A module's
layer comes from its folder alone: a new file in ``common/transport/`` is transport without any
list to edit.

Why the judge may import envs' registry: each env family owns its ground truth and scoring
knowledge (``envs/<family>/truth.py``: what a state holds, its prompts, tolerances, VAGEN rules),
and the judge must ask it. The alternatives were worse: an interface in the contracts cannot be
filled by the envs without the contracts importing them (upward), and a judge that keeps the
families' knowledge is what this layout replaced. The registry module imports nothing of
worldloop, and the truth modules it loads (through the ``worldloop.envs`` package) import only it
and the contracts, so the judge never loads an env, a simulator or a renderer; the learner still
imports nothing of envs. Cycles are found between modules (strongly connected components of the
module graph), and a package counts as the module that its ``__init__`` is.

Reads the sources only (nothing is imported or run) and exits 1 when anything is found, so
CI and ``tests/test_layers.py`` use it as is.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# folder -> dotted package, as pyproject.toml's [tool.setuptools.package-dir]
PACKAGE_DIRS = {
    "worldloop": "worldloop",
    "common": "worldloop.common",
    "actor": "worldloop.actor",
    "judge": "worldloop.judge",
    "learner": "worldloop.learner",
    "envs": "worldloop.envs",
}
# folder (relative to the repository root) -> layer; the longest matching prefix wins
LAYER_FOLDERS = {
    "common/contracts": "contracts",
    "common/transport": "transport",
    "common": "utilities",
    "envs": "envs",
    "actor": "roles",
    "judge": "roles",
    "learner": "roles",
    "worldloop": "apps",
}
ROLES = ("worldloop.actor", "worldloop.judge", "worldloop.learner")
FAMILY_REGISTRY = "worldloop.envs.family"  # what the judge may import from envs (see the docstring)
RANK = {"contracts": 0, "utilities": 1, "transport": 2, "envs": 2, "roles": 3, "apps": 4}


def module_path(mod: str) -> str:
    """The repository path of a dotted module name, without its suffix (``worldloop.common.contracts.keys``
    -> ``common/contracts/keys``), through the package-dir mapping."""
    pkg = max((p for p in PACKAGE_DIRS.values() if mod == p or mod.startswith(p + ".")), key=len)
    folder = next(f for f, p in PACKAGE_DIRS.items() if p == pkg)
    rest = mod[len(pkg):].lstrip(".")
    return f"{folder}/{rest.replace('.', '/')}" if rest else folder


def layer(mod: str) -> str:
    """The layer of a module, from the folder its file sits in (the longest matching folder wins)."""
    path = module_path(mod) + "/"
    return LAYER_FOLDERS[max((f for f in LAYER_FOLDERS if path.startswith(f + "/")), key=len)]


def _is_family_truth(mod: str) -> bool:
    parts = mod.split(".")
    return len(parts) == 4 and parts[:2] == ["worldloop", "envs"] and parts[3] == "truth"


def role_of(mod: str) -> str | None:
    return next((r for r in ROLES if mod == r or mod.startswith(r + ".")), None)


def discover() -> dict[str, Path]:
    """dotted module name -> file, for every module of the distribution."""
    mods: dict[str, Path] = {}
    for folder, pkg in PACKAGE_DIRS.items():
        base = ROOT / folder
        for f in sorted(base.rglob("*.py")):
            rel = f.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([pkg, *parts]) if parts else pkg
            if folder == "worldloop" and parts and parts[0] in {p.split(".")[-1] for p in PACKAGE_DIRS.values() if p != "worldloop"}:
                continue
            mods[name] = f
    return mods


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The worldloop modules that ``name`` imports, resolved to the most specific known module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" for a in node.names] + [mod]
        for t in targets:
            if not t.startswith("worldloop"):
                continue
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    # ``from worldloop.x import y`` where y is a module also names the package worldloop.x; keep
    # only the most specific module of each import
    return {m for m in out if not any(o != m and o.startswith(m + ".") for o in out) or layer(m) == "contracts"}


def violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for mod, deps in sorted(graph.items()):
        lm = layer(mod)
        for dep in sorted(deps):
            ld = layer(dep)
            why = None
            if RANK[ld] > RANK[lm]:
                why = f"upward: {lm} imports {ld}"
            elif lm == "roles" and ld == "roles" and role_of(mod) != role_of(dep):
                why = "a role imports another role"
            elif ld == "envs" and lm == "roles" and role_of(mod) != "worldloop.actor" and not (
                    role_of(mod) == "worldloop.judge" and dep == FAMILY_REGISTRY):
                why = f"only actors and applications import envs (the judge: only {FAMILY_REGISTRY})"
            elif lm == "contracts" and ld != "contracts":
                why = f"a contract imports {ld}"
            elif lm == "envs" and ld not in ("envs", "contracts"):
                why = f"envs import {ld}"
            elif _is_family_truth(mod) and ld == "envs" and dep != FAMILY_REGISTRY:
                why = f"a family's truth module imports only {FAMILY_REGISTRY} and contracts"
            if why:
                found.append(f"{mod} -> {dep}: {why}")
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in graph:
                    continue
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on:
                    low[v] = min(low[v], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def build_graph() -> dict[str, set[str]]:
    mods = discover()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graph", action="store_true", help="print every module's worldloop imports")
    args = ap.parse_args(argv)
    graph = build_graph()
    if args.graph:
        for mod, deps in sorted(graph.items()):
            print(f"{mod} [{layer(mod)}] -> {', '.join(sorted(deps)) or '-'}")
    bad = violations(graph)
    cyc = cycles(graph)
    edges = sum(len(d) for d in graph.values())
    for v in bad:
        print(f"layer violation: {v}")
    for c in cyc:
        print(f"import cycle: {' <-> '.join(c)}")
    print(f"check_layers: {len(graph)} modules, {edges} imports, {len(cyc)} cycles, {len(bad)} layer violations")
    return 1 if bad or cyc else 0


if __name__ == "__main__":
    sys.exit(main())
