"""Shared fixtures: a private redis-server per test on a free port (never the one on 6379)."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# DeepSpeed JIT-compiles small CPU ops once; keep them in one cached folder.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".torch_extensions"))
# models made on the spot are cached under $XDG_CACHE_HOME (worldloop/bootstrap/store.py): the tests'
# (and their child processes') go to a folder of this session, never to the user's cache
_CACHE = tempfile.mkdtemp(prefix="worldloop-test-cache-")
os.environ["XDG_CACHE_HOME"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, True)

from worldloop.common.transport.redis_local import LocalRedis  # noqa: E402


@pytest.fixture
def redis_server():
    """A fresh redis-server on a free loopback port; yields the LocalRedis (url, restart(), stop())."""
    srv = LocalRedis().start()
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture
def redis_url(redis_server) -> str:
    return redis_server.url


# --- running in parallel (pytest-xdist, `--dist loadgroup`; tests/README.md "Parallel runs") --------------
# The full-system tests start many processes each (`worldloop up`, several roles, a Prometheus, a
# supervisord, network namespaces, a vLLM): they form one group, "serial", which one worker runs one
# test at a time, so that no two of them share the 2 cores and the memory at once. Every other test
# goes to the group of its module, so that a module's module-scoped fixtures (a learner, a trained
# model) are built once, on one worker. Every test marked vllm is in one of these modules (test_ci.py).
SERIAL_MODULES = frozenset({
    "test_up", "test_chaos", "test_scaling", "test_server_run", "test_netns", "test_prometheus", "test_deploy",
    "test_admission_runs", "test_resource_faults", "test_redis_faults", "test_learner_resume", "test_show",
    "test_server_backend", "test_vllm_backend", "test_server_auth", "test_redis_cluster",
})
SERIAL_GROUP = "serial"


def xdist_group_of(nodeid: str) -> str:
    """The xdist group of a test, from its node id: "serial" for a test of SERIAL_MODULES, else its module."""
    module = Path(nodeid.split("::", 1)[0]).stem
    return SERIAL_GROUP if module in SERIAL_MODULES else module


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: a run without pytest-xdist has no such hook
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` with the groups of xdist_group_of. xdist's own loadgroup reads a group from a
    node-id suffix that its workers write into ``item._nodeid``, which pytest 9 no longer reads (its
    node ids are structured): every test would be its own group. The same scheduling (xdist's
    loadscope: a group's tests go to one worker, in order), with the scope taken from the node id."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group_of(nodeid)

    return ByGroup(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # pytest-randomly has shuffled the items already (its hook wraps this one)
    in_written_order(items)
    # the serial group, the longest piece of work, first (in its shuffled order): the scheduler hands out
    # groups in the order of their first test, and a serial group handed out last would run alone at the end
    items.sort(key=lambda item: xdist_group_of(item.nodeid) != SERIAL_GROUP)


def _written_key(item: pytest.Item) -> tuple:
    callspec = getattr(item, "callspec", None)
    return item.location[1] or 0, tuple(callspec.indices.values()) if callspec is not None else ()


def in_written_order(items: list) -> None:
    """The tests of a module marked ``in_order`` (one scenario on a shared, expensive fixture, e.g. a
    vLLM engine whose weight versions the tests advance) are put back in the order they are written,
    in the places the random order gave the module's tests; every other test keeps its random place."""
    slots: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        if item.get_closest_marker("in_order") is not None:
            slots.setdefault(str(item.path), []).append(i)
    for places in slots.values():
        for i, item in zip(places, sorted((items[i] for i in places), key=_written_key)):
            items[i] = item


# --- the tiny model, built once per session (per xdist worker) and shared by the tests that only read it ----
_SHARED_MODELS: dict[Path, dict[str, tuple[int, int]]] = {}  # path -> its files' (size, mtime) when built


@pytest.fixture(scope="session")
def shared_tiny_model(tmp_path_factory):
    """``shared_tiny_model(**kwargs)``: the directory ``make_tiny_model(path, **kwargs)`` builds, built once
    per session for each distinct set of arguments (defaults filled in, so ``seed=0`` and no seed are the
    same model). Tests only read it: its files are made read-only (a write fails with PermissionError,
    except as root), and after each test that used it they are compared with what was built (a test
    that changed one fails in its teardown). A test that changes its model builds its own copy with
    ``make_tiny_model(tmp_path / ...)``."""
    import inspect
    import json

    from worldloop.bootstrap.tiny_model import make_tiny_model

    sig = inspect.signature(make_tiny_model)
    root = tmp_path_factory.mktemp("shared-tiny")
    built: dict[str, Path] = {}

    def get(**kwargs) -> Path:
        if kwargs.get("force"):
            raise ValueError("shared_tiny_model: force=True rebuilds a shared model; build your own copy")
        bound = sig.bind(root, **kwargs)
        bound.apply_defaults()
        args = {k: v for k, v in bound.arguments.items() if k != "path"}
        key = json.dumps(args, sort_keys=True)
        if key not in built:
            path = make_tiny_model(root / f"m{len(built)}", **args)
            _make_read_only(path)
            _SHARED_MODELS[path] = _files_of(path)
            built[key] = path
        return built[key]

    return get


@pytest.fixture(autouse=True)
def _shared_models_unchanged(request):
    yield
    if "shared_tiny_model" not in request.fixturenames:
        return
    changed = {str(p): sorted(set(files) ^ set(now) | {f for f in files if now.get(f) != files[f]})
               for p, files in _SHARED_MODELS.items() if (now := _files_of(p)) != files}
    if changed:
        pytest.fail(f"{request.node.nodeid} changed a shared tiny model (files {changed}): a test that "
                    "changes its model builds its own with make_tiny_model(tmp_path / ...)", pytrace=False)


def _files_of(path: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.rglob("*"))
            if p.is_file()}


def _make_read_only(path: Path) -> None:
    for p in sorted(path.rglob("*"), reverse=True):
        p.chmod(0o555 if p.is_dir() else 0o444)
    path.chmod(0o555)
