"""``worldloop actor``: the rollout actor process (issue 5).

Public API::

    run(cfg, args) -> int                   # the CLI entry point; 0 on a clean stop
    Actor(cfg, backend, *, proc, producer, weights, actor_id)   # proc: common.transport.process.ProcessScaffold
        .run() -> None                      # the loop below, until stopped
    WeightFetcher (common/transport/weights/fetcher.py)  # background thread: fetches newer versions, .take()
    check_env_specs(specs) -> None          # ConfigError naming actor.envs[i] if one cannot be made

The loop, one iteration per batched generation:

1. read the control record (``worldloop.common.transport.control.read_control``): ``run_state`` "stopped" ends the
   loop (exit code 0); "paused" starts no new episode and no generation until "running" again
   (live episodes wait in memory; weights are still applied); ``max_turns`` applies to episodes
   started from now on (running ones keep theirs; each trajectory records its own ``max_turns``);
   ``policy_version`` gives the policy lag metric;
2. weights, applied between generations only: a :class:`WeightFetcher` thread owns the
   subscriber and, whenever ``latest_announced()`` is newer than what it has, runs
   ``fetch(min_version=...)`` in the background (a fetch neither stalls generation nor delays a
   shutdown); the loop takes the newest complete version and calls ``backend.update_weights``.
   A failed fetch is retried; a version the backend rejects (names or shapes that do not fit the
   model) is logged and not fetched again (a newer one is). When the control record's
   ``policy_version`` is below the actor's own (the learner restarted from a checkpoint and will
   reuse version numbers), the fetcher is resynced and takes the newest published version;
3. start new episodes (:class:`worldloop.actor.rollout.SeedSchedule`: env by weight, seeds from
   ``[seed_start, seed_end)`` drawn per actor from ``sha256(run.seed, actor_id)``,
   ``n_samples_per_seed`` episodes of one seed sharing a ``group_id``) until ``num_envs`` are live;
4. one ``RolloutEngine.step()`` (one batched generation for all live episodes, then the env steps);
5. push every finished trajectory with turns to ``{ns}:rollouts`` (judge enabled) or straight to
   ``{ns}:scored`` (``judge.enabled=false``). ``StreamProducer.add`` blocks while the stream's
   backlog is at ``redis.max_backlog`` (the stream metrics record the blocked time); the actor
   waits in 1 s slices so that SIGTERM or a "stopped" control record still ends it. Episodes that
   ended without a complete turn are counted and dropped, and their admission is refunded (also
   when every episode ended as it started and none is live: they are reported before the wait).

SIGTERM/SIGINT (when run in the main thread) end the loop after the current generation; live
episodes are abandoned (nothing was pushed for them, so nothing is lost downstream). The process
registers itself in ``{ns}:procs`` every 2 s with its metrics URL.

With ``$WORLDLOOP_PRODUCED_LOG`` set, each trajectory id is appended (fsynced) to that file once
its XADD returned (:class:`ProducedLog`): the soak's exact record of what entered the stream; an id
whose XADD went out unanswered when the actor stopped goes to ``<that file>.uncertain`` instead.

Without a weight channel (``weights.pub_port`` or ``weights.fetch_port`` 0) the actor runs with
the weights of ``model.path`` (version 0) and says so in the log.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from worldloop.actor.backends import make_backend
from worldloop.actor.generation import GenerationBackend, WeightUpdateError
from worldloop.actor.episodes import EpisodeEngine
from worldloop.actor.rollout import EpisodeSpec, RolloutEngine, Sampling, SeedSchedule, StepReport
from worldloop.common.transport.admission import Admission
from worldloop.common.exposure import warn_plain_weights
from worldloop.common.contracts.config import Config, ConfigError, EnvSpec
from worldloop.common.transport.control import default_proc_id
from worldloop.common.contracts.keys import Keys
from worldloop.common.metrics import metric
from worldloop.common.transport.process import ProcessScaffold
from worldloop.common.contracts.schemas import Trajectory, encode_trajectory, total_turn_reward
from worldloop.common.transport.streams import AddOutcomeUnknown, StopRequested, StreamProducer
from worldloop.common.transport.weights.fetcher import WeightFetcher

log = logging.getLogger("worldloop.actor")

ADMISSION_POLL_S = 0.05
PAUSE_POLL_S = 0.2
PUSH_SLICE_S = 1.0
BACKPRESSURE_LOG_S = 60.0  # a producer blocked on a full stream says so again this often


def check_env_specs(specs: list[EnvSpec]) -> None:
    """Make (and close) every configured env once, and once more with its train_kwargs laid over its
    kwargs, so that a bad id or kwarg fails at start-up."""
    import gymnasium

    from worldloop import envs  # noqa: F401  (registers worldloop/* ids)

    for i, spec in enumerate(specs):
        variants = [("", dict(spec.kwargs))] + ([(".train_kwargs", spec.training_kwargs())] if spec.train_kwargs else [])
        for where, kwargs in variants:
            try:
                gymnasium.make(spec.id, **kwargs).close()
            except Exception as e:  # gymnasium and env constructors raise many types for bad input
                raise ConfigError(f"actor.envs[{i}]{where}",
                                  f"cannot make {spec.id} with kwargs {kwargs}: {type(e).__name__}: {e}") from None


class ProducedLog:
    """``$WORLDLOOP_PRODUCED_LOG``: an append-only file that gets each trajectory id once its XADD
    returned (one line, fsynced), an exact record of what entered the stream that does not depend
    on anything downstream (``bench/chaos.py`` accounts every trajectory with it). A kill between
    the XADD and the append leaves that one id out; the soak reconciles it from its other fates.
    An id whose XADD went out but got no reply before the actor stopped (a lossy link:
    :class:`AddOutcomeUnknown`) may or may not have entered: :meth:`record_uncertain` writes it to
    ``<path>.uncertain``, so that an exact account knows it can appear downstream."""

    ENV = "WORLDLOOP_PRODUCED_LOG"
    UNCERTAIN = ".uncertain"  # the suffix of the sibling file of ids whose XADD went unanswered

    def __init__(self, path: str):
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    @classmethod
    def from_env(cls) -> "ProducedLog | None":
        path = os.environ.get(cls.ENV)
        return cls(path) if path else None

    def record(self, trajectory_id: str) -> None:
        os.write(self._fd, (trajectory_id + "\n").encode())
        os.fsync(self._fd)

    def record_uncertain(self, trajectory_id: str) -> None:
        fd = os.open(self.path + self.UNCERTAIN, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (trajectory_id + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)


class Actor:
    """The actor loop (see the module docstring); ``stop`` ends it from any thread."""

    def __init__(self, cfg: Config, backend: GenerationBackend, *, proc: ProcessScaffold, producer: StreamProducer,
                 weights: WeightFetcher | None, actor_id: str, admission: Admission | None = None):
        a = cfg.actor
        self.cfg = cfg
        self.backend = backend
        self.proc = proc
        self.keys = Keys(cfg.redis.namespace)
        self.producer = producer
        self.weights = weights
        self.actor_id = actor_id
        self.stop = proc.stop
        sampling = Sampling(a.temperature, a.top_p, a.max_new_tokens)
        if a.loop == "episode":
            self.engine: RolloutEngine = EpisodeEngine(
                backend, sampling=sampling, max_model_len=cfg.model.max_model_len, actor_id=actor_id,
                batch_wait_s=a.batch_wait_ms / 1000.0, env_timeout_s=a.env_timeout_s, env_workers=a.num_envs,
                min_version=self._oldest_allowed)
        else:
            self.engine = RolloutEngine(backend, sampling=sampling, max_model_len=cfg.model.max_model_len,
                                        actor_id=actor_id)
        self.schedule = SeedSchedule(a.envs, a.n_samples_per_seed, a.seed_start, a.seed_end, cfg.run.seed, actor_id)
        self.control = proc.control
        self.admission = admission
        self._admitted: list[EpisodeSpec] = []  # admitted, not started yet (the rest of a group)
        self._unadmitted: list[EpisodeSpec] | None = None  # the group waiting for budget
        self._leases: set[str] = set()  # trajectory ids admitted and not yet in the stream
        self._renewed_at = time.monotonic()
        self._resynced_at: int | None = None  # backend version when a learner restart was last handled
        self._learner_seen: int | None = None  # the control record's version at the last look
        self._applied_at = time.time()  # wall time the current weights were applied
        self.produced_log = ProducedLog.from_env()
        self._busy_seen = 0.0  # the engine's busy seconds already counted
        metric("worldloop_actor_policy_version").set(backend.version)

    # ------------------------------------------------------------------ loop

    def run(self) -> None:
        log.info("actor %s: %d envs, pushing to %s", self.actor_id, self.cfg.actor.num_envs, self.producer.stream)
        try:
            while not self.stop.is_set():
                state = self._read_control()
                if state == "stopped":
                    log.info("control record says stopped: actor %s exits", self.actor_id)
                    break
                self._apply_weights()
                self.engine.hold(state == "paused")
                if state == "paused":
                    metric("worldloop_actor_paused").set(1)
                    self.stop.wait(PAUSE_POLL_S)
                    continue
                metric("worldloop_actor_paused").set(0)
                admitted_all = self._fill()
                # nothing admitted: wait for the learner's next version. Episodes that ended as they
                # started (no turn) are reported by the next step() first, which refunds their
                # admission; without it they would hold their leases (renewed) and the budget for ever
                if self.engine.live == 0 and self.engine.pending_reports == 0:
                    self.proc.set_phase("waiting for admission (learner behind)" if not admitted_all else "idle",
                                        live_episodes=0, policy_version=self.backend.version)
                    t0 = time.monotonic()
                    self.stop.wait(ADMISSION_POLL_S)
                    waited = time.monotonic() - t0
                    metric("worldloop_actor_idle_seconds").inc(waited)
                    if not admitted_all:
                        metric("worldloop_actor_admission_wait_seconds").inc(waited)
                    continue
                self.proc.set_phase("generating", live_episodes=self.engine.live, policy_version=self.backend.version)
                report = self.engine.step()
                self._record(report)
                for traj in report.finished:
                    if not self._push(traj):
                        break
        finally:
            self.engine.close()
            metric("worldloop_actor_live_episodes").set(0)
            metric("worldloop_actor_paused").set(0)

    def _read_control(self) -> str:
        """The control record as the scaffold last polled it (kept while Redis is away); also
        follows a learner that restarted from an older checkpoint."""
        self.control = self.proc.control
        if self.proc.should_stop():
            return "stopped"
        learner, own = int(self.control["policy_version"]), int(self.backend.version)
        metric("worldloop_actor_policy_version").set(own)  # inference servers load versions on their own
        metric("worldloop_actor_policy_lag_versions").set(learner - own)
        went_back = self._learner_seen is not None and learner < self._learner_seen
        # the record was written after we applied `own` and still says less: not a record that lags
        # the weights channel (the learner publishes, then writes the record), a restart
        behind_since_apply = learner < own and float(self.control.get("updated_at") or 0.0) > self._applied_at + 1.0
        if (went_back or behind_since_apply) and self.weights is not None and self._resynced_at != own:
            # the learner restarted from a checkpoint older than our weights: its next versions
            # reuse numbers we hold, so take whatever it publishes now
            log.warning("learner is at v%d, behind our v%d (restarted from a checkpoint): refetching", learner, own)
            self._resynced_at = own
            self.weights.resync()
        self._learner_seen = learner
        return str(self.control["run_state"])

    def _apply_weights(self) -> None:
        got = self.weights.take() if self.weights is not None else None
        if got is None:
            return
        version, tensors = got
        try:
            with self.engine.paused_generation():  # between two batched calls (per-episode loop)
                self.backend.update_weights(tensors, version)
        except WeightUpdateError as e:
            metric("worldloop_actor_weight_update_failures").labels(reason="rejected").inc()
            log.error("weights v%d do not fit the model (%s); keeping v%d", version, e, self.backend.version)
            return
        self._applied_at = time.time()
        metric("worldloop_actor_weight_updates").inc()
        metric("worldloop_actor_policy_version").set(version)
        metric("worldloop_actor_policy_lag_versions").set(int(self.control["policy_version"]) - version)
        log.info("applied weights v%d", version)

    def _oldest_allowed(self) -> int:
        """The oldest version a response may come from: the learner's minus trainer.max_staleness."""
        return int(self.control["policy_version"]) - int(self.cfg.trainer.max_staleness)

    def _fill(self) -> bool:
        """Start episodes up to ``num_envs``; False when the admission budget held some back."""
        max_turns = self.control["max_turns"] or self.cfg.actor.max_turns
        blocked = False
        # at most num_envs attempts: an env that fails at every reset cannot spin this loop
        for _ in range(self.cfg.actor.num_envs):
            if self.engine.live >= self.cfg.actor.num_envs:
                break
            if not self._admitted:
                if self.admission is None:
                    self._admitted = [self.schedule.next(max_turns)]
                else:
                    group = self._unadmitted or self.schedule.next_group(max_turns)
                    ids = [spec.trajectory_id for spec in group]
                    if not self.admission.admit(ids, self.backend.version).admitted:
                        self._unadmitted, blocked = group, True
                        break
                    self._unadmitted = None
                    self._admitted = group
                    self._leases.update(ids)
            self.engine.start(self._admitted.pop(0))
        metric("worldloop_actor_live_episodes").set(self.engine.live)
        if self.admission is not None and self._leases and time.monotonic() - self._renewed_at >= self.admission.lease_s / 4:
            self._renewed_at = time.monotonic()
            self.admission.renew(sorted(self._leases))
        return not blocked

    # ------------------------------------------------------------------ results

    def _record(self, report: StepReport) -> None:
        if report.generate_seconds:
            metric("worldloop_actor_generate_seconds").observe(report.generate_seconds)
        metric("worldloop_actor_generated_tokens").inc(report.generated_tokens)
        if report.stale_refusals:
            metric("worldloop_actor_stale_refusals").inc(report.stale_refusals)
        busy = self.engine.busy_seconds()
        metric("worldloop_actor_generation_busy_seconds").inc(max(0.0, busy - self._busy_seen))
        self._busy_seen = busy
        metric("worldloop_actor_prompt_tokens").inc(report.prompt_tokens)
        for name, n in report.turns.items():
            metric("worldloop_actor_turns").labels(env=name).inc(n)
        for name, n in report.format_errors.items():
            metric("worldloop_actor_format_errors").labels(env=name).inc(n)
        for traj in report.finished:
            name, reason = traj.env_name, traj.end_reason
            metric("worldloop_actor_episode_ends").labels(env=name, reason=reason).inc()
            if not traj.turns:
                metric("worldloop_actor_dropped_episodes").labels(env=name, reason=reason).inc()
                continue
            metric("worldloop_actor_episodes").labels(env=name).inc()
            if traj.success:
                metric("worldloop_actor_successes").labels(env=name).inc()
            metric("worldloop_actor_episode_turns").labels(env=name).observe(len(traj.turns))
            metric("worldloop_actor_episode_reward").labels(env=name).observe(sum(total_turn_reward(t) for t in traj.turns))
        metric("worldloop_actor_live_episodes").set(self.engine.live)

    def _backpressure_wait(self, since: float | None) -> float:
        """One more slice (``PUSH_SLICE_S``) spent waiting for room in the full stream: shown in the
        phase (``worldloop up``/``status``, with the seconds waited so far), the log (at once, then
        every ``BACKPRESSURE_LOG_S``) and the stream's backpressure metrics; returns the start."""
        now = time.monotonic()
        stream, limit = self.producer.stream, self.producer.max_backlog
        if since is None:
            since = self._backpressure_logged = now
            log.warning("%s is at its backlog limit (%d undelivered entries): waiting on backpressure until "
                        "the judges drain it", stream, limit)
        elif now - self._backpressure_logged >= BACKPRESSURE_LOG_S:
            self._backpressure_logged = now
            log.warning("still waiting on backpressure: %s full for %.0f s", stream, now - since)
        self.proc.set_phase(f"waiting on backpressure ({stream} full)", backpressure_wait_s=round(now - since, 1))
        return since

    def _backpressure_over(self, since: float) -> None:
        log.info("room in %s again after %.1f s of backpressure", self.producer.stream, time.monotonic() - since)
        self.proc.set_phase("generating", backpressure_wait_s=0.0)

    def _push(self, traj: Trajectory) -> bool:
        """Add one trajectory to the stream, waiting on backpressure; False if stopped meanwhile."""
        if not traj.turns:
            # ended before its first generation (env error, context too long): it will never be
            # trained, so its admission goes back now instead of being renewed for ever
            if self.admission is not None and traj.trajectory_id in self._leases:
                self._leases.discard(traj.trajectory_id)
                self.admission.release([traj.trajectory_id], refund=True)
            return True
        payload = encode_trajectory(traj)
        waiting_since = None  # monotonic start of a wait on a full stream
        while True:
            try:
                self.producer.add(payload, timeout=PUSH_SLICE_S)
                if waiting_since is not None:
                    self._backpressure_over(waiting_since)
                if self.produced_log is not None:
                    self.produced_log.record(traj.trajectory_id)
                if self.admission is not None and traj.trajectory_id in self._leases:
                    self._leases.discard(traj.trajectory_id)
                    self.admission.settle(traj.trajectory_id)
                return True
            except (TimeoutError, StopRequested, AddOutcomeUnknown, RedisConnectionError, RedisTimeoutError) as e:
                # a full stream, or Redis away (the producer reconnects until asked to stop)
                if isinstance(e, TimeoutError):
                    waiting_since = self._backpressure_wait(waiting_since)
                if self.stop.is_set() or self._read_control() == "stopped":
                    self._gave_up(traj.trajectory_id, e)
                    return False

    def _gave_up(self, trajectory_id: str, e: Exception) -> None:
        """Say what a push cut short by a stop left: nothing in the stream, or (an XADD that went out
        unanswered) an entry that may be there."""
        if isinstance(e, AddOutcomeUnknown):
            log.warning("stopping with the XADD of trajectory %s unanswered: it may be in %s (%s)", trajectory_id,
                        self.producer.stream, e)
            if self.produced_log is not None:
                self.produced_log.record_uncertain(trajectory_id)
        else:
            log.warning("stopping while %s is full or away: trajectory %s not pushed (%s)", self.producer.stream,
                        trajectory_id, type(e).__name__)


# --------------------------------------------------------------------------- process


def _subscriber(cfg: Config) -> Any | None:
    if not cfg.weights.pub_port or not cfg.weights.fetch_port:
        log.warning("weights.pub_port/fetch_port is 0: no weight channel, this actor keeps the weights of %s (v0)",
                    cfg.model.path)
        return None
    from worldloop.common.transport.weights import subscriber_from_config

    warn_plain_weights("actor", cfg.weights.host, cfg.weights.curve_server_public)
    return subscriber_from_config(cfg)


def run(cfg: Config, args: argparse.Namespace | None = None) -> int:
    """Run an actor until stopped (signal or control record); 0 on a clean stop."""
    if not cfg.redis.url:
        raise ConfigError("redis.url", "the actor needs the run's Redis (redis://host:port/db; worldloop up sets it)")
    if not (Path(cfg.model.path) / "config.json").exists():
        raise ConfigError("model.path", f"no model directory at {cfg.model.path!r} (no config.json)")
    check_env_specs(cfg.actor.envs)
    actor_id = cfg.actor.actor_id or default_proc_id()
    keys = Keys(cfg.redis.namespace)
    stream = keys.rollouts if cfg.judge.enabled else keys.scored
    backend = subscriber = producer = fetcher = admission = None
    # a signal while the backend starts (vLLM: tens of seconds) interrupts at once; after ready()
    # the actor stops after the current generation
    with ProcessScaffold(cfg, "actor", actor_id, stop_message="stopping after the current generation") as proc:
        stop = proc.stop
        try:
            proc.set_phase("loading the generation backend")
            backend = make_backend(cfg)
            codec = getattr(backend, "codec", None)
            if codec is not None and not codec.is_vision and any(e.kwargs.get("render_mode", "vision") == "vision" for e in cfg.actor.envs):
                log.warning("%s is a text-only model: images of vision-mode envs are dropped", cfg.model.path)
            # a backend whose servers follow the weight channel themselves needs no fetcher here
            subscriber = None if getattr(backend, "loads_own_weights", False) else _subscriber(cfg)
            if subscriber is not None:
                fetcher = WeightFetcher(subscriber, stop, have=backend.version)
                fetcher.start()
            producer = StreamProducer(cfg.redis.url, stream, cfg.redis.max_backlog,
                                      reconnect_max_s=cfg.redis.reconnect_max_s, socket_timeout_s=cfg.redis.socket_timeout_s,
                                      should_stop=stop.is_set, startup_timeout_s=cfg.redis.startup_timeout_s)
            if cfg.actor.admission:
                admission = Admission(cfg.redis.url, keys, max_staleness=cfg.trainer.max_staleness,
                                      batch_size=cfg.trainer.train_batch_size, lease_s=cfg.actor.admission_lease_s,
                                      reconnect_max_s=cfg.redis.reconnect_max_s, socket_timeout_s=cfg.redis.socket_timeout_s,
                                      should_stop=stop.is_set, startup_timeout_s=cfg.redis.startup_timeout_s)
            proc.ready()
            Actor(cfg, backend, proc=proc, producer=producer, weights=fetcher, actor_id=actor_id,
                  admission=admission).run()
            if fetcher is not None:
                fetcher.check()  # stopped by a fatal fetch error: exit non-zero (the supervisor restarts us)
        finally:
            stop.set()
            if fetcher is not None:
                fetcher.join(timeout=1.0)
                if fetcher.is_alive():  # inside a fetch: the subscriber belongs to that thread; leave it
                    log.info("a weight fetch is in progress; not waiting for it")
                    subscriber = None
            for obj in (producer, admission, subscriber, backend):
                if obj is not None:
                    try:
                        obj.close()
                    except Exception as e:  # best-effort teardown
                        log.warning("closing %s: %s", type(obj).__name__, e)
    log.info("actor %s stopped", actor_id)
    return 0
