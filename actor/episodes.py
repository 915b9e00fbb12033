"""Per-episode rollouts (``actor.loop: episode``): every episode runs its own turn loop.

Public API::

    EpisodeEngine(backend, *, sampling, max_model_len, actor_id="local", codec=None, sample_seed=None,
                  make_env=None, keyed_sampling=False, batch_wait_s=0.005, env_timeout_s=120.0,
                  env_workers=8, min_version=None, step_wait_s=0.2)
        .start(spec) -> str            # registers the episode; its env is made and reset in the env pool
        .step() -> StepReport          # waits (at most step_wait_s) for episodes to end; reports them
        .hold(on)                      # on: no request goes out (run state "paused"); off: they go out
        .paused_generation()           # context: no batched call runs inside it (weight updates)
        .busy_seconds() -> float       # time with at least one request in flight (generation busy)
        .live, .pending_reports, .close()
    play_episodes(backend, specs, *, concurrency=8, sampling=Sampling(), max_model_len=4096,
                  actor_id="local", sample_seed=None, codec=None, keyed_sampling=False,
                  loop="lockstep") -> list[Trajectory]   # in the specs' order: what ``worldloop eval`` builds on

Same contract as :class:`worldloop.actor.rollout.RolloutEngine` (its docstring says what a turn
records and why an episode ends), with one difference: nothing is in lockstep.

* **Each episode on its own.** When an episode's response arrives, its env steps in the env pool
  (``env_workers`` threads) and its next request goes out from there at once; no episode waits
  for another's response or env step. Env reset, step, rendering and the SVG worker all run in
  that pool, never on the generation path.
* **Batches that wait a little.** One batcher thread gathers the ready requests: after the first
  it waits until every live episode that is not generating has its request in, or at most
  ``batch_wait_s`` (``actor.batch_wait_ms``), so episodes whose envs step at about the same time
  share a batch and a slow env holds the others back for no longer than that. A backend with
  ``submit`` (the server backend) then gets the batch's requests together, one request per
  episode turn (the servers batch continuously and prefill them together); any other backend
  (``hf``, in-process ``vllm``) generates the batch in one call.
* **Weights.** :meth:`paused_generation` holds the batcher's lock, so an in-process backend's
  ``update_weights`` runs between two batched calls (a batch is one turn of the episodes in it).
  Inference servers load versions themselves (``actor.weight_update``, :mod:`worldloop.actor.server.app`).
* **Staleness.** With ``min_version`` (the actor passes: the learner's version minus
  ``trainer.max_staleness``) a response whose oldest token is older is refused and its turn
  generated again; ``StepReport.stale_refusals`` counts them.
* **Faults.** An env that raises ends its episode as ``env_error``; one whose reset or step takes
  longer than ``env_timeout_s`` ends it as ``env_timeout`` (both without turns: the actor refunds
  the admission); the other episodes go on. An exception from a backend (a bad request, a server
  that answers something unusable) stops the engine: :meth:`step` raises it in the caller.
* **Reproducibility.** Keyed sampling keys a request by (sample seed, env, episode seed, turn),
  never by the order in which episodes finish.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Iterator, Sequence

from worldloop.actor.generation import GenerationBackend, GenRequest, GenResult
from worldloop.actor.rollout import EpisodeSpec, RolloutEngine, Sampling, StepReport, _Episode, episode_sample_key
from worldloop.common.contracts.modeling import ChatCodec
from worldloop.common.contracts.schemas import Trajectory

log = logging.getLogger(__name__)

MAX_STALE_RETRIES = 3  # a turn refused as stale this often in a row drops its episode
CLOSE_JOIN_S = 60.0  # close() waits this long for a batched call or an env step in progress


class _EnvPool:
    """Daemon worker threads for env resets and steps. Not ``ThreadPoolExecutor``: its threads are
    joined at interpreter exit, so one env stuck for ever would keep the actor from exiting."""

    def __init__(self, workers: int):
        self._tasks: "queue.SimpleQueue[tuple | None]" = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"rollout-env-{i}", daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        self._tasks.put((fn, args))

    def _run(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            fn, args = task
            fn(*args)

    def shutdown(self, join_s: float) -> None:
        """Stop the workers; wait up to ``join_s`` for those inside an env (a daemon thread killed in
        native code at interpreter exit aborts the process). One stuck longer is left behind."""
        for _ in self._threads:
            self._tasks.put(None)
        deadline = time.monotonic() + join_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))


class _Batcher:
    """One thread that gathers ready requests into batches: after the first, it waits until every
    live episode that is not generating has its request in (or ``wait_s`` passed), so episodes
    whose envs step at about the same time share one batch. An in-process backend generates the
    batch in one call; with a ``submitter`` (servers) its requests go out together, one each."""

    def __init__(self, engine: "EpisodeEngine", wait_s: float, submitter: "_Submitter | None" = None):
        self.engine = engine
        self.wait_s = float(wait_s)
        self.submitter = submitter
        # held during a batched call; weight updates take it too (servers load weights themselves)
        self.lock: Any = threading.Lock() if submitter is None else contextlib.nullcontext()
        self._cv = threading.Condition()
        self._queue: list[tuple[_Episode, GenRequest]] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="rollout-batcher", daemon=True)
        self._thread.start()

    def submit(self, ep: _Episode, req: GenRequest) -> None:
        with self._cv:
            self._queue.append((ep, req))
            self._cv.notify()

    def _take(self) -> list[tuple[_Episode, GenRequest]] | None:
        with self._cv:
            while not self._queue and not self._closed:
                self._cv.wait()
            if self._closed:
                return None
            deadline = time.monotonic() + self.wait_s
            while len(self._queue) < self.engine.awaiting_generation() and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            batch, self._queue = self._queue, []
        self.engine._taken(batch)
        return batch

    def _run(self) -> None:
        e = self.engine
        while True:
            batch = self._take()
            if batch is None:
                return
            try:
                if self.submitter is not None:
                    for ep, req in batch:
                        self.submitter.submit(ep, req)
                    continue
                with self.lock:
                    version = int(e.backend.version)
                    e._gen_started(len(batch))
                    try:
                        results = e.backend.generate([r for _, r in batch], temperature=e.sampling.temperature,
                                                     top_p=e.sampling.top_p, max_new_tokens=e.sampling.max_new_tokens,
                                                     seed=e._next_seed())
                    finally:
                        e._gen_done(len(batch))
                for (ep, req), res in zip(batch, results):
                    e._on_result(ep, req, res, version)
            except BaseException as exc:  # a backend failure stops the engine; step() raises it
                e._fail(exc)
                return

    def close(self) -> None:
        """Stop taking batches and wait for the one being generated (it runs in native code)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(CLOSE_JOIN_S)
        if self.submitter is not None:
            self.submitter.close()


class _Submitter:
    """Backends that take one request at a time (``submit`` -> Future of a GenResult): servers."""

    def __init__(self, engine: "EpisodeEngine"):
        self.engine = engine
        self._futures: set[Future] = set()
        self._guard = threading.Lock()

    def submit(self, ep: _Episode, req: GenRequest) -> None:
        e = self.engine
        version = int(e.backend.version)
        e._gen_started(1)
        try:
            fut = e.backend.submit(req, temperature=e.sampling.temperature, top_p=e.sampling.top_p,
                                   max_new_tokens=e.sampling.max_new_tokens, seed=e._next_seed())
        except BaseException:
            e._gen_done(1)
            raise
        with self._guard:
            self._futures.add(fut)

        def done(f: Future) -> None:
            with self._guard:
                self._futures.discard(f)
            e._gen_done(1)
            if f.cancelled():
                return
            exc = f.exception()
            if exc is not None:
                e._fail(exc)
                return
            e._on_result(ep, req, f.result(), version)

        fut.add_done_callback(done)

    def close(self) -> None:
        with self._guard:
            for f in list(self._futures):
                f.cancel()


class EpisodeEngine(RolloutEngine):
    """Plays live episodes each on its own turn loop (see the module docstring)."""

    def __init__(self, backend: GenerationBackend, *, sampling: Sampling, max_model_len: int, actor_id: str = "local",
                 codec: Any = None, sample_seed: int | None = None, make_env: Callable[..., Any] | None = None,
                 keyed_sampling: bool = False, batch_wait_s: float = 0.005, env_timeout_s: float = 120.0,
                 env_workers: int = 8, min_version: Callable[[], int | None] | None = None, step_wait_s: float = 0.2):
        super().__init__(backend, sampling=sampling, max_model_len=max_model_len, actor_id=actor_id, codec=codec,
                         sample_seed=sample_seed, make_env=make_env, keyed_sampling=keyed_sampling)
        self.env_timeout_s = float(env_timeout_s)
        self.step_wait_s = float(step_wait_s)
        self.min_version = min_version
        self._lock = threading.Lock()  # the accumulated report, phases, seeds, busy time
        self._live: dict[str, _Episode] = {}
        self._ended: "queue.SimpleQueue[_Episode]" = queue.SimpleQueue()
        self._wake = threading.Event()
        self._acc = StepReport()
        self._held = False
        self._parked: list[tuple[_Episode, GenRequest]] = []
        self._error: BaseException | None = None
        self._closed = False
        self._in_flight = 0
        self._busy_since = 0.0
        self._busy_s = 0.0
        self._pool = _EnvPool(max(1, int(env_workers)))
        self._gen = _Batcher(self, batch_wait_s, _Submitter(self) if hasattr(backend, "submit") else None)

    # ------------------------------------------------------------------ the caller's side

    @property
    def live(self) -> int:
        return len(self._live)

    @property
    def pending_reports(self) -> int:
        return self._ended.qsize()

    def awaiting_generation(self) -> int:
        """Live episodes whose next request could join the batch being gathered: those stepping
        their env or with a request queued (not those generating)."""
        with self._lock:
            return sum(1 for ep in self._live.values() if ep.phase in ("env", "queued"))

    def _taken(self, batch: list[tuple[_Episode, GenRequest]]) -> None:
        with self._lock:
            for ep, _ in batch:
                if ep.phase == "queued":
                    ep.phase = "gen"

    def start(self, spec: EpisodeSpec) -> str:
        ep = _Episode(spec, self.actor_id)
        ep.phase, ep.since, ep.stale_tries = "env", time.monotonic(), 0
        with self._lock:
            self._live[ep.trajectory_id] = ep
        self._pool.submit(self._guarded, self._reset, ep)
        return ep.trajectory_id

    def step(self) -> StepReport:
        if self._error is not None:
            raise self._error
        self._wake.wait(self.step_wait_s)
        self._wake.clear()
        if self._error is not None:
            raise self._error
        self._end_hung_envs()
        with self._lock:
            report, self._acc = self._acc, StepReport()
        report.finished = []
        while True:
            try:
                ep = self._ended.get_nowait()
            except queue.Empty:
                break
            with self._lock:
                self._live.pop(ep.trajectory_id, None)
            report.finished.append(ep.message())
        return report

    def hold(self, on: bool) -> None:
        """On: requests that become ready are parked, none goes out. Off: the parked ones go out."""
        with self._lock:
            self._held = bool(on)
            parked: list[tuple[_Episode, GenRequest]] = []
            if not on:
                parked, self._parked = self._parked, []
        for ep, req in parked:
            self._send(ep, req)

    @contextlib.contextmanager
    def paused_generation(self) -> Iterator[None]:
        with self._gen.lock:
            yield

    def busy_seconds(self) -> float:
        with self._lock:
            return self._busy_s + (time.monotonic() - self._busy_since if self._in_flight else 0.0)

    def close(self) -> None:
        self._closed = True
        self._gen.close()
        self._pool.shutdown(CLOSE_JOIN_S)
        with self._lock:
            episodes = list(self._live.values())
            self._live.clear()
        for ep in episodes:
            if ep.phase != "env":  # an env in a worker's hands is closed by that worker
                self._end(ep)

    # ------------------------------------------------------------------ workers

    def _guarded(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except BaseException as exc:  # a bug outside the env's own code: stop the engine loudly
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        if self._closed:
            return
        if self._error is None:
            self._error = exc
        self._wake.set()

    def _abandoned(self, ep: _Episode) -> bool:
        """The engine closed or the episode was ended from outside (env timeout): drop the work."""
        if self._closed or ep.phase == "ended":
            self._end(ep)  # a no-op for an env left to a stuck worker (env_timeout: ep.env is None)
            return True
        return False

    def _reset(self, ep: _Episode) -> None:
        self._open(ep)
        self._advance(ep)

    def _advance(self, ep: _Episode) -> None:
        """After an env reset or step: end the episode, or send its next request."""
        if self._abandoned(ep):
            return
        if ep.end_reason is not None:
            self._finish(ep)
            return
        key = episode_sample_key(self.sample_seed, ep.spec, len(ep.turns)) if self.keyed_sampling else None
        req = GenRequest(ep.context + ep.pending.ids, ep.images + ep.pending.images, sample_key=key,
                         session=ep.trajectory_id)
        self._send(ep, req)

    def _send(self, ep: _Episode, req: GenRequest) -> None:
        with self._lock:
            ep.phase, ep.since = "queued", time.monotonic()
            if self._held:
                self._parked.append((ep, req))
                return
        self._gen.submit(ep, req)

    def _on_result(self, ep: _Episode, req: GenRequest, res: GenResult, version: int) -> None:
        """A response arrived (generation thread): its env steps in the pool, off this thread."""
        if self._closed:
            return
        with self._lock:
            ep.phase, ep.since = "env", time.monotonic()
        self._pool.submit(self._guarded, self._after_generation, ep, req, res, version)

    def _after_generation(self, ep: _Episode, req: GenRequest, res: GenResult, version: int) -> None:
        if self._abandoned(ep):
            return
        version = version if res.version is None else int(res.version)
        floor = self.min_version() if self.min_version is not None and res.error is None else None
        if floor is not None and version < floor:
            with self._lock:
                self._acc.stale_refusals += 1
            ep.stale_tries += 1
            log.info("episode %s: a response from v%d is older than the staleness bound (v%d); turn %d generated again",
                     ep.trajectory_id, version, floor, len(ep.turns))
            if ep.stale_tries <= MAX_STALE_RETRIES:
                self._send(ep, req)
                return
            ep.end_reason, ep.turns, ep.pending = "stale", [], None
            self._finish(ep)
            return
        ep.stale_tries = 0
        local = StepReport()
        local.generated_tokens = len(res.response_ids)
        local.prompt_tokens = len(req.prompt_ids)
        self._play(ep, res, version, local)
        with self._lock:
            self._acc.generated_tokens += local.generated_tokens
            self._acc.prompt_tokens += local.prompt_tokens
            for name, n in local.turns.items():
                self._acc.turns[name] = self._acc.turns.get(name, 0) + n
            for name, n in local.format_errors.items():
                self._acc.format_errors[name] = self._acc.format_errors.get(name, 0) + n
        self._advance(ep)

    def _finish(self, ep: _Episode) -> None:
        with self._lock:
            if ep.phase == "ended":
                return
            ep.phase = "ended"
        self._end(ep)
        self._ended.put(ep)
        self._wake.set()

    def _end_hung_envs(self) -> None:
        now = time.monotonic()
        with self._lock:
            hung = [ep for ep in self._live.values() if ep.phase == "env" and now - ep.since > self.env_timeout_s]
        for ep in hung:
            # ep.env None: its env stays with the worker that is stuck in it (never closed under it)
            ep.end_reason, ep.turns, ep.pending, ep.env = "env_timeout", [], None, None
            log.error("env %s (seed %d) took more than %.0f s (actor.env_timeout_s); episode %s dropped",
                      ep.spec.env_id, ep.spec.seed, self.env_timeout_s, ep.trajectory_id)
            self._finish(ep)

    # ------------------------------------------------------------------ bookkeeping

    def _next_seed(self) -> int | None:
        with self._lock:
            seed = None if self.sample_seed is None else self.sample_seed + self._calls
            self._calls += 1
        return seed

    def _gen_started(self, n: int) -> None:
        with self._lock:
            if self._in_flight == 0:
                self._busy_since = time.monotonic()
            self._in_flight += n

    def _gen_done(self, n: int) -> None:
        with self._lock:
            self._in_flight -= n
            if self._in_flight == 0:
                self._busy_s += time.monotonic() - self._busy_since


# --------------------------------------------------------------------------- playing a list


def play_episodes(
    backend: GenerationBackend,
    specs: Sequence[EpisodeSpec],
    *,
    concurrency: int = 8,
    sampling: Sampling = Sampling(),
    max_model_len: int = 4096,
    actor_id: str = "local",
    sample_seed: int | None = None,
    codec: ChatCodec | None = None,
    keyed_sampling: bool = False,
    loop: str = "lockstep",
) -> list[Trajectory]:
    """Play every spec to its end, ``concurrency`` episodes at a time: in one batched generation per
    turn (``loop="lockstep"``) or each on its own turn loop (``"episode"``: :mod:`worldloop.actor.episodes`).

    Returns one :class:`Trajectory` per spec, in the order of ``specs`` (``turns == []`` for an
    episode that ended before its first generation: see the module docstring).
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if loop not in ("lockstep", "episode"):
        raise ValueError(f"loop must be lockstep or episode, got {loop!r}")
    engine_cls = EpisodeEngine if loop == "episode" else RolloutEngine
    engine = engine_cls(backend, sampling=sampling, max_model_len=max_model_len, actor_id=actor_id,
                        codec=codec, sample_seed=sample_seed, keyed_sampling=keyed_sampling)
    index: dict[str, int] = {}  # trajectory id -> position in specs
    out: list[Trajectory | None] = [None] * len(specs)
    queue = list(enumerate(specs))
    try:
        while queue or engine.live or engine.pending_reports:
            while queue and engine.live < concurrency:
                i, spec = queue.pop(0)
                index[engine.start(spec)] = i
            for traj in engine.step().finished:
                out[index[traj.trajectory_id]] = traj
    finally:
        engine.close()
    return [t for t in out if t is not None]
