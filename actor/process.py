"""``worldloop actor``: the rollout actor process (issue 5).

Public API::

    run(cfg, args) -> int                   # the CLI entry point; 0 on a clean stop
    Actor(cfg, backend, *, redis_client, producer, weights, actor_id, stop)
        .run() -> None                      # the loop below, until stopped
    WeightFetcher(subscriber, stop, have=0) # background thread: fetches newer versions, .take()
    check_env_specs(specs) -> None          # ConfigError naming actor.envs[i] if one cannot be made

The loop, one iteration per batched generation:

1. read the control record (``common.control.read_control``): ``run_state`` "stopped" ends the
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
3. start new episodes (:class:`actor.rollout.SeedSchedule`: env by weight, seeds from
   ``[seed_start, seed_end)`` drawn per actor from ``sha256(run.seed, actor_id)``,
   ``n_samples_per_seed`` episodes of one seed sharing a ``group_id``) until ``num_envs`` are live;
4. one ``RolloutEngine.step()`` (one batched generation for all live episodes, then the env steps);
5. push every finished trajectory with turns to ``<ns>:rollouts`` (judge enabled) or straight to
   ``<ns>:scored`` (``judge.enabled=false``). ``StreamProducer.add`` blocks while the stream's
   backlog is at ``redis.max_backlog`` (the stream metrics record the blocked time); the actor
   waits in 1 s slices so that SIGTERM or a "stopped" control record still ends it. Episodes that
   ended without a complete turn are counted and dropped.

SIGTERM/SIGINT (when run in the main thread) end the loop after the current generation; live
episodes are abandoned (nothing was pushed for them, so nothing is lost downstream). The process
registers itself in ``<ns>:procs`` every 2 s with its metrics URL.

Without a weight channel (``weights.pub_port`` or ``weights.fetch_port`` 0) the actor runs with
the weights of ``model.path`` (version 0) and says so in the log.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from pathlib import Path
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from actor.backends import GenerationBackend, WeightUpdateError, make_backend
from actor.rollout import RolloutEngine, Sampling, SeedSchedule, StepReport
from common.config import Config, ConfigError
from common.control import Keys, default_proc_id, read_control, register_process
from common.metrics import metric, serve_metrics
from common.schemas import encode_trajectory, total_turn_reward
from common.streams import StreamProducer, connect

log = logging.getLogger("worldloop.actor")

HEARTBEAT_S = 2.0
PAUSE_POLL_S = 0.2
PUSH_SLICE_S = 1.0


def check_env_specs(specs: list[Any]) -> None:
    """Make (and close) every configured env once so that a bad id or kwarg fails at start-up."""
    import gymnasium

    import envs  # noqa: F401  (registers worldloop/* ids)

    for i, spec in enumerate(specs):
        try:
            gymnasium.make(spec.id, **dict(spec.kwargs or {})).close()
        except Exception as e:  # gymnasium and env constructors raise many types for bad input
            raise ConfigError(f"actor.envs[{i}]", f"cannot make {spec.id} with kwargs {spec.kwargs}: {type(e).__name__}: {e}") from None


class WeightFetcher(threading.Thread):
    """Owns the subscriber: fetches every newer announced version in the background.

    The actor's loop takes the newest complete version with :meth:`take` between generations,
    so a fetch (large models: seconds; a vanished learner: up to ``weights.fetch_timeout_s``)
    neither stalls generation nor delays a shutdown.
    """

    def __init__(self, subscriber: Any, stop: threading.Event, *, have: int = 0, poll_s: float = 0.05):
        super().__init__(name="actor-weights", daemon=True)
        self.subscriber = subscriber
        self.stop = stop
        self.poll_s = poll_s
        self._have = int(have)  # the newest version fetched (handed over or waiting in _ready)
        self._lock = threading.Lock()
        self._ready: tuple[int, dict] | None = None

    def take(self) -> tuple[int, dict] | None:
        with self._lock:
            got, self._ready = self._ready, None
        return got

    def resync(self) -> None:
        """Forget what was fetched: the next fetch takes the newest version whatever its number.

        A learner that restarts from its last checkpoint publishes version numbers again that
        this actor may already hold (with the weights of updates that were lost in the crash).
        """
        with self._lock:
            self._have, self._ready = -1, None

    def run(self) -> None:
        from common.weights import WeightsError

        while not self.stop.is_set():
            announced = self.subscriber.latest_announced()
            if announced is not None and announced > self._have:
                try:
                    got = self.subscriber.fetch(min_version=self._have)
                except WeightsError as e:
                    metric("worldloop_actor_weight_update_failures").labels(reason="fetch").inc()
                    log.warning("fetching weights v%s failed (%s); retrying", announced, e)
                    self.stop.wait(1.0)
                    continue
                if got is not None:
                    with self._lock:
                        self._ready = got  # a newer version replaces one not applied yet
                        self._have = got[0]
                    continue
            self.stop.wait(self.poll_s)


class Actor:
    """The actor loop (see the module docstring); ``stop`` ends it from any thread."""

    def __init__(self, cfg: Config, backend: GenerationBackend, *, redis_client: Any, producer: StreamProducer,
                 weights: WeightFetcher | None, actor_id: str, stop: threading.Event):
        a = cfg.actor
        self.cfg = cfg
        self.backend = backend
        self.r = redis_client
        self.keys = Keys(cfg.redis.namespace)
        self.producer = producer
        self.weights = weights
        self.actor_id = actor_id
        self.stop = stop
        self.engine = RolloutEngine(backend, sampling=Sampling(a.temperature, a.top_p, a.max_new_tokens),
                                    max_model_len=cfg.model.max_model_len, actor_id=actor_id)
        self.schedule = SeedSchedule(a.envs, a.n_samples_per_seed, a.seed_start, a.seed_end, cfg.run.seed, actor_id)
        self.control = {"policy_version": 0, "max_turns": None, "run_state": "running", "updated_at": 0.0}
        self._redis_backoff = 0.05
        self._resynced_at: int | None = None  # backend version when a learner restart was last handled
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
                if state == "paused":
                    metric("worldloop_actor_paused").set(1)
                    self.stop.wait(PAUSE_POLL_S)
                    continue
                metric("worldloop_actor_paused").set(0)
                self._fill()
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
        try:
            self.control = read_control(self.r, self.keys)
            self._redis_backoff = 0.05
        except (RedisConnectionError, RedisTimeoutError) as e:  # keep the last record, retry with backoff
            log.warning("reading the control record failed (%s); retrying in %.2fs", e, self._redis_backoff)
            self.stop.wait(self._redis_backoff)
            self._redis_backoff = min(self._redis_backoff * 2, self.cfg.redis.reconnect_max_s)
        learner, own = int(self.control["policy_version"]), int(self.backend.version)
        metric("worldloop_actor_policy_lag_versions").set(learner - own)
        if learner < own and self.weights is not None and self._resynced_at != own:
            # the learner restarted from a checkpoint older than our weights: its next versions
            # reuse numbers we hold, so take whatever it publishes now
            log.warning("learner is at v%d, behind our v%d (restarted from a checkpoint): refetching", learner, own)
            self._resynced_at = own
            self.weights.resync()
        return str(self.control["run_state"])

    def _apply_weights(self) -> None:
        got = self.weights.take() if self.weights is not None else None
        if got is None:
            return
        version, tensors = got
        try:
            self.backend.update_weights(tensors, version)
        except WeightUpdateError as e:
            metric("worldloop_actor_weight_update_failures").labels(reason="rejected").inc()
            log.error("weights v%d do not fit the model (%s); keeping v%d", version, e, self.backend.version)
            return
        metric("worldloop_actor_weight_updates").inc()
        metric("worldloop_actor_policy_version").set(version)
        metric("worldloop_actor_policy_lag_versions").set(int(self.control["policy_version"]) - version)
        log.info("applied weights v%d", version)

    def _fill(self) -> None:
        max_turns = self.control["max_turns"] or self.cfg.actor.max_turns
        # at most num_envs attempts: an env that fails at every reset cannot spin this loop
        for _ in range(self.cfg.actor.num_envs):
            if self.engine.live >= self.cfg.actor.num_envs:
                break
            self.engine.start(self.schedule.next(max_turns))
        metric("worldloop_actor_live_episodes").set(self.engine.live)

    # ------------------------------------------------------------------ results

    def _record(self, report: StepReport) -> None:
        if report.generate_seconds:
            metric("worldloop_actor_generate_seconds").observe(report.generate_seconds)
        metric("worldloop_actor_generated_tokens").inc(report.generated_tokens)
        metric("worldloop_actor_prompt_tokens").inc(report.prompt_tokens)
        for name, n in report.turns.items():
            metric("worldloop_actor_turns").labels(env=name).inc(n)
        for name, n in report.format_errors.items():
            metric("worldloop_actor_format_errors").labels(env=name).inc(n)
        for traj in report.finished:
            name, reason = traj["env_name"], traj["end_reason"]
            metric("worldloop_actor_episode_ends").labels(env=name, reason=reason).inc()
            if not traj["turns"]:
                metric("worldloop_actor_dropped_episodes").labels(env=name, reason=reason).inc()
                continue
            metric("worldloop_actor_episodes").labels(env=name).inc()
            if traj["success"]:
                metric("worldloop_actor_successes").labels(env=name).inc()
            metric("worldloop_actor_episode_turns").labels(env=name).observe(len(traj["turns"]))
            metric("worldloop_actor_episode_reward").labels(env=name).observe(sum(total_turn_reward(t) for t in traj["turns"]))
        metric("worldloop_actor_live_episodes").set(self.engine.live)

    def _push(self, traj: dict) -> bool:
        """Add one trajectory to the stream, waiting on backpressure; False if stopped meanwhile."""
        if not traj["turns"]:
            return True
        payload = encode_trajectory(traj)
        while True:
            try:
                self.producer.add(payload, timeout=PUSH_SLICE_S)
                return True
            except TimeoutError:
                if self.stop.is_set() or self._read_control() == "stopped":
                    log.warning("stopping while %s is full: trajectory %s not pushed", self.producer.stream,
                                traj["trajectory_id"])
                    return False


# --------------------------------------------------------------------------- process


def _heartbeat(url: str, socket_timeout_s: float, keys: Keys, actor_id: str, port: int | None, host: str,
               stop: threading.Event) -> None:
    r = None
    while not stop.is_set():
        try:
            r = r or connect(url, socket_timeout_s)
            register_process(r, keys, "actor", actor_id, port, host=host)
        except Exception as e:  # a heartbeat must never take the actor down; Redis may be restarting
            log.debug("heartbeat failed: %s", e)
            r = None
        stop.wait(HEARTBEAT_S)


def _subscriber(cfg: Config) -> Any | None:
    if not cfg.weights.pub_port or not cfg.weights.fetch_port:
        log.warning("weights.pub_port/fetch_port is 0: no weight channel, this actor keeps the weights of %s (v0)",
                    cfg.model.path)
        return None
    from common.weights import subscriber_from_config

    return subscriber_from_config(cfg)


def _install_signals(stop: threading.Event) -> dict:
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        def handler(signum, frame, _stop=stop):
            log.info("signal %d: stopping after the current generation", signum)
            _stop.set()
        previous[sig] = signal.signal(sig, handler)
    return previous


def run(cfg: Config, args: argparse.Namespace | None = None) -> int:
    """Run an actor until stopped (signal or control record); 0 on a clean stop."""
    if not cfg.redis.url:
        raise ConfigError("redis.url", "the actor needs the run's Redis (redis://host:port/db; worldloop up sets it)")
    if not (Path(cfg.model.path) / "config.json").exists():
        raise ConfigError("model.path", f"no model directory at {cfg.model.path!r} (no config.json)")
    check_env_specs(cfg.actor.envs)
    actor_id = cfg.actor.actor_id or default_proc_id()
    keys = Keys(cfg.redis.namespace)
    stop = threading.Event()
    previous = _install_signals(stop)
    port = serve_metrics("actor", cfg.metrics.host, cfg.metrics.port) if cfg.metrics.enabled else None
    beat = threading.Thread(target=_heartbeat, name="actor-heartbeat", daemon=True,
                            args=(cfg.redis.url, cfg.redis.socket_timeout_s, keys, actor_id, port, cfg.metrics.host, stop))
    beat.start()
    stream = keys.rollouts if cfg.judge.enabled else keys.scored
    backend = subscriber = producer = r = fetcher = None
    try:
        backend = make_backend(cfg)
        codec = getattr(backend, "codec", None)
        if codec is not None and not codec.is_vision and any(e.kwargs.get("render_mode", "vision") == "vision" for e in cfg.actor.envs):
            log.warning("%s is a text-only model: images of vision-mode envs are dropped", cfg.model.path)
        subscriber = _subscriber(cfg)
        if subscriber is not None:
            fetcher = WeightFetcher(subscriber, stop, have=backend.version)
            fetcher.start()
        producer = StreamProducer(cfg.redis.url, stream, cfg.redis.max_backlog,
                                  reconnect_max_s=cfg.redis.reconnect_max_s, socket_timeout_s=cfg.redis.socket_timeout_s)
        r = connect(cfg.redis.url, cfg.redis.socket_timeout_s)
        Actor(cfg, backend, redis_client=r, producer=producer, weights=fetcher, actor_id=actor_id, stop=stop).run()
    finally:
        stop.set()
        if fetcher is not None:
            fetcher.join(timeout=1.0)
            if fetcher.is_alive():  # inside a fetch: the subscriber belongs to that thread; leave it
                log.info("a weight fetch is in progress; not waiting for it")
                subscriber = None
        for obj in (producer, subscriber, backend, r):
            if obj is not None:
                try:
                    obj.close()
                except Exception as e:  # best-effort teardown
                    log.warning("closing %s: %s", type(obj).__name__, e)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        beat.join(timeout=HEARTBEAT_S + 1)
    log.info("actor %s stopped", actor_id)
    return 0


__all__ = ["Actor", "WeightFetcher", "check_env_specs", "run"]
