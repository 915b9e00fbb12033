"""Which model a run starts from, and where it is kept: shipped in the package, cached on this
machine, or built now.

Public API::

    resolve_model(cfg, *, build=True, run_dir=None) -> ResolvedModel   # (path, source, recipe_hash, ...)
    prepare_model(cfg, run_dir) -> ResolvedModel      # `worldloop up`: resolve, set model.path, record it
    make_model(cfg, out, *, fingerprint=None, run_dir=None) -> dict    # a reproducible build; its recipe
    shipped_models() -> dict[str, Path]               # recipe hash -> shipped model directory
    cache_root() -> Path                              # $XDG_CACHE_HOME/worldloop/models
    fingerprint_of(cfg) -> dict                       # code_fingerprint, kept per recipe and code_version()
    SHIPPED_DIR, BUILD_THREADS, DETERMINISM

**Resolution** (:func:`resolve_model`), in order; ``source`` says which one gave the model:

1. ``path``: ``model.path`` names a directory with a ``config.json``: it is used as it is (an
   explicit model always wins; nothing is checked against the recipe).
2. ``model.make_tiny_if_missing`` false: a missing or null ``model.path`` is an error.
3. ``shipped``: the config's :func:`~worldloop.bootstrap.recipe.recipe_hash` is that of a model
   shipped in the package (``worldloop/warmstarts/<preset>/``): used at once, no grounding, no SFT.
4. ``cache``: the model of this recipe and this code (the key is the recipe hash and the
   :func:`~worldloop.bootstrap.recipe.code_fingerprint`, seconds to compute, 30-40 s under load, kept per
   recipe and :func:`code_version` by :func:`fingerprint_of`) in :func:`cache_root`.
5. ``built``: made now into the cache (``build=False``: an error instead). The build runs in a
   temporary sibling folder and is renamed into place when whole, under an exclusive lock on
   ``<key>.lock``: concurrent runs of one recipe build it once (the others wait and take it), a
   killed build leaves only a temporary folder that the next builder removes.

A ``model.path`` that does not exist is not written to (before, the model was built there): the
model of the config's recipe is used instead and the run directory's ``model.json`` says which.

**Reproducibility** (:func:`make_model`): every step is seeded from the config (``run.seed``; the
levels from their seed ranges), torch runs on :data:`BUILD_THREADS` intra-op thread with
deterministic algorithms requested, and ``recipe.json`` records the recipe, the fingerprints, the
package versions, the machine and the reports. :data:`DETERMINISM` says what that does and does
not guarantee.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from worldloop.bootstrap.pipeline import build_model
from worldloop.bootstrap.recipe import (BUILDER_VERSION, RECIPE_FILE, code_fingerprint, data_fingerprint, read_recipe,
                                        recipe_hash, recipe_keys, tokenizer_hash)
from worldloop.common.contracts.config import Config
from worldloop.common.versions import package_versions

log = logging.getLogger(__name__)

SHIPPED_DIR = Path(__file__).resolve().parent.parent / "warmstarts"
# one intra-op thread: reductions then run in one fixed order, and on a shared 2-core machine it was
# 11x faster than 2 threads (20 grounding steps: 15 s against 163 s at load 10)
BUILD_THREADS = 1
DETERMINISM = (
    "Same CPU type and package versions: the same weights, bit for bit (every step seeded from the config, "
    f"{BUILD_THREADS} intra-op thread, torch deterministic algorithms). Across machines the data are the same (the "
    "tokenizer and data fingerprints check it) but the weights may differ in the last bits: float32 kernels take "
    "other vector code paths on other CPUs (AVX2, AVX-512) and torch versions, and thousands of grounding and SFT "
    "steps amplify such differences. Hence the shipped models: every machine starts from the same file.")


@dataclass
class ResolvedModel:
    path: Path
    source: str  # path | shipped | cache | built
    recipe_hash: str
    cache_key: str | None = None
    recipe: dict | None = None  # the model's recipe.json (None: a model.path without one)

    def record(self) -> dict:
        return {"path": str(self.path), "source": self.source, "recipe_hash": self.recipe_hash,
                "cache_key": self.cache_key, "builder_version": BUILDER_VERSION, "recipe": self.recipe}


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/worldloop/models`` (``~/.cache`` when unset or empty)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "worldloop" / "models"


def cache_key(rhash: str, fingerprint: dict) -> str:
    """The cache folder of a recipe made by this code: recipe hash and code fingerprint, 16 hex."""
    import hashlib

    blob = json.dumps({"recipe": rhash, **fingerprint}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


# worldloop's own packages, whose files decide what code_fingerprint computes (the shipped warm starts aside)
CODE_PACKAGES = ("worldloop", "worldloop.common", "worldloop.envs", "worldloop.actor", "worldloop.learner",
                 "worldloop.judge")


def code_version() -> str:
    """sha256 over every file of :data:`CODE_PACKAGES` (paths and bytes; not ``__pycache__`` nor the
    shipped warm starts) and :func:`~worldloop.common.versions.package_versions`: what the code that
    makes a model's tokenizer and data is, read in milliseconds."""
    import hashlib
    import importlib.util

    h = hashlib.sha256(json.dumps(package_versions(), sort_keys=True).encode())
    for name in CODE_PACKAGES:
        for root in importlib.util.find_spec(name).submodule_search_locations or []:
            root = Path(root)
            for p in sorted(root.rglob("*")):
                rel = p.relative_to(root)
                if p.is_file() and "__pycache__" not in rel.parts and rel.parts[0] != "warmstarts":
                    h.update(f"{name}/{rel.as_posix()}\0".encode())
                    h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def fingerprint_of(cfg: Config) -> dict:
    """:func:`~worldloop.bootstrap.recipe.code_fingerprint` of ``cfg``, kept per recipe and
    :func:`code_version` in ``<cache_root>/../fingerprints/`` (computing it builds a fresh tiny model
    and the recipe's first examples: seconds, 30-40 s on 2 loaded cores, for every run of a recipe that is not
    shipped, a cache hit included). The same worldloop files and package versions give the same
    fingerprint; a change of a system library the envs render with (libcairo, fonts) is not seen:
    delete the folder after one."""
    path = cache_root().parent / "fingerprints" / f"{recipe_hash(cfg)}-{code_version()[:16]}.json"
    try:
        got = json.loads(path.read_text())
        if isinstance(got, dict) and set(got) == {"tokenizer", "data"} and all(isinstance(v, str) for v in got.values()):
            return got
    except (OSError, ValueError):
        pass
    fingerprint = code_fingerprint(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(fingerprint))
    os.replace(tmp, path)
    return fingerprint


def shipped_models(root: Path = SHIPPED_DIR) -> dict[str, Path]:
    """Recipe hash -> directory of every model shipped in the package (those with a recipe.json)."""
    out = {}
    for recipe_file in sorted(root.glob(f"*/{RECIPE_FILE}")):
        recipe = read_recipe(recipe_file.parent)
        if recipe and (recipe_file.parent / "config.json").exists():
            out[recipe["recipe_hash"]] = recipe_file.parent
    return out


def _ready(path: Path) -> bool:
    return (path / "config.json").exists() and (path / RECIPE_FILE).exists()


@contextlib.contextmanager
def deterministic_torch() -> Iterator[None]:
    """:data:`BUILD_THREADS` intra-op threads and deterministic algorithms (warn-only) inside; the
    process's own settings restored after."""
    import torch

    threads = torch.get_num_threads()
    det, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.set_num_threads(BUILD_THREADS)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(det, warn_only=warn)


def make_model(cfg: Config, out: str | Path, *, fingerprint: dict | None = None, run_dir: str | Path | None = None,
               replace: bool = False) -> dict:
    """Build the model of ``cfg``'s recipe into ``out`` reproducibly (see the module docstring) and
    return its recipe (also written to ``out/recipe.json``). Built in a temporary sibling and renamed
    into place when whole; an existing ``out`` is kept (a concurrent builder won) unless ``replace``.
    Each step's report also goes to ``<run_dir>/<step>.json`` as the step ends."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.build-", dir=out.parent))
    model_dir = work / "model"
    started = time.monotonic()
    reports: dict[str, dict] = {}
    try:
        with deterministic_torch():
            for step, report in build_model(cfg, model_dir):
                reports[step] = report
                if run_dir is not None:
                    (Path(run_dir) / f"{step}.json").write_text(json.dumps(report, indent=2))
            made = {"tokenizer": tokenizer_hash(model_dir), "data": data_fingerprint(cfg, model_dir)}
        if fingerprint is not None and made != fingerprint:
            log.warning("model: the built model's fingerprint %s differs from the code's %s", made, fingerprint)
        recipe = _recipe(cfg, made, reports, time.monotonic() - started)
        (model_dir / RECIPE_FILE).write_text(json.dumps(recipe, indent=2) + "\n")
        for f in model_dir.iterdir():  # readable like any installed file (some writers make 0600 files)
            f.chmod(0o644)
        model_dir.chmod(0o755)
        _install(model_dir, out, replace)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("model: built in %.0fs at %s (recipe %s)", recipe["build"]["seconds"], out, recipe["recipe_hash"])
    return recipe


def _recipe(cfg: Config, fingerprint: dict, reports: dict, seconds: float) -> dict:
    import torch

    return {"recipe_hash": recipe_hash(cfg), "builder_version": BUILDER_VERSION, "keys": recipe_keys(cfg),
            "tokenizer_hash": fingerprint["tokenizer"], "data_fingerprint": fingerprint["data"],
            "config": Path(cfg.source).stem if cfg.source else None, "versions": package_versions(),
            "build": {"seconds": round(seconds, 1), "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                      "torch_threads": BUILD_THREADS, "deterministic_algorithms": True,
                      "machine": platform.machine(), "cpu": _cpu_name(),
                      "cpu_capability": torch.backends.cpu.get_cpu_capability()},
            "determinism": DETERMINISM, "reports": reports}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _install(model_dir: Path, out: Path, replace: bool) -> None:
    """Move the finished build to ``out``: replacing an old one (``replace``) or, when another
    builder got there first, keeping theirs."""
    if out.exists() and replace:
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.rename(out, old)
        os.rename(model_dir, out)
        shutil.rmtree(old, ignore_errors=True)
        return
    try:
        os.rename(model_dir, out)
    except OSError:
        if not _ready(out):
            raise


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``lock_path`` (released when the holder exits, however it exits)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("model: another process is building %s; waiting for it", lock_path.with_suffix(""))
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_into_cache(cfg: Config, key: str, fingerprint: dict, *, run_dir: str | Path | None = None,
                     replace: bool = False) -> tuple[Path, dict | None]:
    """Under the key's lock: the cached model when another process made it meanwhile (and not
    ``replace``), else a new build. Returns the directory and the recipe it was built with (None:
    found ready)."""
    target = cache_root() / key
    with _locked(target.with_name(f"{key}.lock")):
        if _ready(target) and not replace:
            return target, None
        for stale in target.parent.glob(f".{key}.build-*"):  # left by a killed builder: we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        return target, make_model(cfg, target, fingerprint=fingerprint, run_dir=run_dir, replace=replace)


def resolve_model(cfg: Config, *, build: bool = True, run_dir: str | Path | None = None) -> ResolvedModel:
    """The model ``cfg`` starts from (see the module docstring); FileNotFoundError when there is none
    and it may not be made (``model.make_tiny_if_missing`` false, or ``build`` false)."""
    path = cfg.model.path
    rhash = recipe_hash(cfg)
    if path and (Path(path) / "config.json").exists():
        return ResolvedModel(Path(path), "path", rhash, recipe=read_recipe(path))
    if not cfg.model.make_tiny_if_missing:
        what = f"model.path {path!r} has no config.json" if path else "model.path is null"
        raise FileNotFoundError(f"{what} and model.make_tiny_if_missing is false")
    if path:
        log.info("model: model.path %s does not exist: using the model of the config's recipe (nothing is written "
                 "to model.path)", path)
    shipped = shipped_models().get(rhash)
    if shipped is not None:
        return ResolvedModel(shipped, "shipped", rhash, recipe=read_recipe(shipped))
    log.info("model: recipe %s is not shipped; looking for it in %s", rhash, cache_root())
    fingerprint = fingerprint_of(cfg)
    key = cache_key(rhash, fingerprint)
    target = cache_root() / key
    if _ready(target):
        return ResolvedModel(target, "cache", rhash, key, read_recipe(target))
    if not build:
        raise FileNotFoundError(f"no shipped or cached model has this config's recipe {rhash}: build it with "
                                "`worldloop model build CONFIG [overrides]` (or set model.path)")
    log.info("model: building recipe %s into %s", rhash, target)
    target, recipe = build_into_cache(cfg, key, fingerprint, run_dir=run_dir)
    if recipe is None:
        return ResolvedModel(target, "cache", rhash, key, read_recipe(target))
    return ResolvedModel(target, "built", rhash, key, recipe)


def prepare_model(cfg: Config, run_dir: str | Path) -> ResolvedModel:
    """``worldloop up``'s model: :func:`resolve_model`, then ``model.path`` names it (the children get
    that path), ``<run_dir>/model.json`` records where it came from, and ``grounding.json`` /
    ``sft.json`` hold the recipe's reports."""
    run_dir = Path(run_dir)
    model = resolve_model(cfg, run_dir=run_dir)
    cfg.model.path = str(model.path)
    (run_dir / "model.json").write_text(json.dumps(model.record(), indent=2))
    for step, report in ((model.recipe or {}).get("reports") or {}).items():
        if not (run_dir / f"{step}.json").exists():
            (run_dir / f"{step}.json").write_text(json.dumps(report, indent=2))
    log.info("model: %s (%s, recipe %s)", model.path, model.source, model.recipe_hash)
    return model


def model_command(cfg: Config, args) -> int:
    """``worldloop model build CONFIG [overrides] [--out DIR]``: build the config's model afresh into
    ``DIR`` (replacing what is there) or into the cache; ``worldloop model resolve CONFIG
    [overrides]``: print the directory of the model a run of CONFIG starts from (building it into
    the cache when neither shipped nor cached), for ``model.path`` of processes started by hand."""
    if args.action == "export":
        from worldloop.learner.export import export_command

        return export_command(cfg, args)
    if args.action == "resolve":
        model = resolve_model(cfg)
        log.info("model: %s, recipe %s", model.source, model.recipe_hash)
        print(model.path, flush=True)
        return 0
    if args.out:
        out, recipe = Path(args.out), make_model(cfg, args.out, replace=True)
    else:
        fingerprint = fingerprint_of(cfg)
        out, recipe = build_into_cache(cfg, cache_key(recipe_hash(cfg), fingerprint), fingerprint, replace=True)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"worldloop model build: {out} ({size / 2**20:.1f} MiB), recipe {recipe['recipe_hash']}, builder "
          f"{recipe['builder_version']}, {recipe['build']['seconds']:.0f} s", flush=True)
    for step, report in recipe["reports"].items():
        print(f"  {step}: {_summary(step, report)}", flush=True)
    return 0


def _summary(step: str, report: dict) -> str:
    if step == "grounding":
        return (f"first relation read right on {report['after_agent']['first']:.0%} of held-out first turns "
                f"(before {report['before_agent']['first']:.0%}), {report['seconds']:.0f} s")
    if step == "sft":
        return (f"loss {report['loss_before']:.3f} -> {report['loss_after']:.3f}, well-formed answers "
                f"{report['format_ok_before']:.0%} -> {report['format_ok_after']:.0%}, {report['seconds']:.0f} s")
    return json.dumps(report)
