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

# xdist workers share the cores: each worker's torch (and every process it starts, `worldloop up`'s
# children included, which take OMP_NUM_THREADS when it is set) gets its share of them, not all of
# them. Two workers of 2 threads each on 2 cores took twice as long as two of 1 thread each
# (tests/README.md "Durations"). Set before anything imports torch; an OMP_NUM_THREADS already in the
# environment wins.
if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    from worldloop.up import child_threads  # imports no torch

    os.environ.setdefault("OMP_NUM_THREADS", str(child_threads(int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

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
# supervisord, network namespaces, a vLLM). They run in four serial lanes: each lane is one xdist
# group, which one worker runs one test at a time, and the lanes run side by side, one per worker (with
# `-n 3`, the README's command, the fourth lane goes to the worker that ends its lane first; each
# worker then takes the other modules' groups). What
# two of them could share is kept apart for every pair across the lanes: Redis, the weight channel,
# /metrics, Prometheus and the learner's torchrun rendezvous take a port the OS hands out (never a fixed
# one); test_deploy's supervisord programs take ports below the ephemeral range, checked free, where no
# other test binds; the model cache ($XDG_CACHE_HOME, below) is per worker; the DeepSpeed JIT cache is
# shared behind torch's file lock; each run's files are under its own tmp_path. What is still shared
# is the cores and the memory: every module that starts a vLLM engine is in the one lane
# "serial-engines" (two engines at once would each need the 2 cores through their start and weight
# loads, and twice the memory); every vllm-marked test is in that lane (test_ci.py). The chaos soak,
# the longest run (a fixed 2-minute soak, then the drain), is a lane of its own: in the engines lane
# it made that lane the longest piece of work of the suite (about 480 s of CI's 614 s with -n 2), and
# it holds no engine, so it may run beside one. No lane's module shares a port, a mount, a name or a
# file with a module of another lane (the comment beside each says what it takes).
SERIAL_LANES: dict[str, tuple[str, ...]] = {
    "serial-engines": (
        "test_server_run",     # `worldloop up` with a `worldloop serve` (vLLM) it kills; free ports only
        "test_server_backend", # one `worldloop serve` (vLLM) for the module; free ports only
        "test_vllm_backend",   # an in-process vLLM engine for the module
        "test_server_auth",    # `worldloop serve` (vLLM) with an API key; free ports only
        "test_vllm_lora",      # an in-process vLLM engine with LoRA (its shutdown tears torch.distributed down)
        "test_server_lora",    # `worldloop serve` (vLLM) with LoRA for the module; free ports only
    ),
    # the other runs of several processes, in two lanes of about equal time (tests/README.md "Durations":
    # 384 s and 380 s of a 764 s lane on a slow draw of the VM), the second handed out after the soak
    "serial-runs": (
        "test_up",                # `worldloop up` (learner, actors, judge, evaluator); free ports only
        "test_learner_resume",    # kill -9 + --resume; torchrun --standalone (a free rendezvous port)
        "test_admission_runs",    # two `worldloop up` runs; free ports only
        "test_deploy",            # supervisord: ports below the ephemeral range, checked free (no other test binds there)
        "test_redis_faults",      # Redis killed and restarted: its own redis-server on a free port
    ),
    "serial-soak": (
        "test_chaos",          # the soak: 5 roles + a persisted Redis under faults for 3-5 min; free ports only
    ),
    "serial-runs-b": (
        "test_netns",             # network namespaces named after its own pid, a 10.200.N subnet no interface uses
        "test_prometheus",        # a real Prometheus and a run, each on a free port
        "test_resource_faults",   # its own tmpfs mounted under its tmp_path; a learner on free ports
        "test_scaling",           # a learner and two actors started apart; its learner binds port 0
        "test_show",              # a headless chromium on files under its tmp_path
        "test_redis_cluster",     # a Redis Cluster of its own, on free ports
    ),
}
SERIAL_MODULES = frozenset(m for lane in SERIAL_LANES.values() for m in lane)
# the slowest modules outside the lanes (tests/README.md "Durations"), handed out right after the lanes,
# so that none of them starts last while the other workers have nothing left
HEAVY_MODULES = ("test_tiny_model", "test_secrets", "test_actor", "test_microbatch")
_HAND_OUT_ORDER = {group: i for i, group in enumerate([*SERIAL_LANES, *HEAVY_MODULES])}
_LANE_OF = {m: lane for lane, modules in SERIAL_LANES.items() for m in modules}


def xdist_group_of(nodeid: str) -> str:
    """The xdist group of a test, from its node id: its lane for a test of SERIAL_MODULES, else its module."""
    module = Path(nodeid.split("::", 1)[0]).stem
    return _LANE_OF.get(module, module)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: a run without pytest-xdist has no such hook
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` with the groups of xdist_group_of. xdist's own loadgroup reads a group from a
    node-id suffix that its workers write into ``item._nodeid``, which pytest 9 no longer reads (its
    node ids are structured): every test would be its own group. The same scheduling (xdist's
    loadscope: a group's tests go to one worker, in order), with the scope taken from the node id, and
    the groups handed out in the order of the collection (pytest_collection_modifyitems: the lanes,
    then HEAVY_MODULES), not loadscope's default of the group with the most tests first."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group_of(nodeid)

    config.option.loadscopereorder = False
    return ByGroup(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # pytest-randomly has shuffled the items already (its hook wraps this one)
    in_written_order(items)
    # the lanes, the longest pieces of work, first (each in its shuffled order), then the slowest other
    # modules, then the rest in their shuffled order: the scheduler hands out groups in the order of
    # their first test, one lane to each worker, and a long group handed out last would run alone at the end
    items.sort(key=lambda item: _HAND_OUT_ORDER.get(xdist_group_of(item.nodeid), len(_HAND_OUT_ORDER)))


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
