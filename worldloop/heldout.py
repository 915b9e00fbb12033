"""``worldloop evaluator``: held-out success while a run trains, off the learner's path.

Every ``trainer.eval_every`` policy versions the evaluator plays a fixed set of held-out episodes
with the newest weights: for each env of ``actor.envs``, ``trainer.eval_episodes`` seeds from
``eval.seed_start`` on (checked disjoint from the training seeds by the config), ``actor.max_turns``
turns, ``eval.temperature``. It is a process of its own, like an actor: it loads ``model.path``
(the start of the run: version 0 is evaluated first, so the curve starts at the warm start),
takes new weights from the learner's ZeroMQ channel in the background, and never slows the
learner's step itself.

**CPU.** On a small machine it shares the cores with the actors and the learner, so it keeps to a
budget: at scheduling priority ``trainer.eval_nice`` (``os.nice``), and an in-run evaluation
starts only while the in-run evaluations so far and the next one stay within
``trainer.eval_cpu_share`` of the run's CPU seconds (every process's ``cpu_s`` heartbeat:
:class:`worldloop.eval.cpu.CpuBudget`); a deferred evaluation waits and then takes the newest
version. Once the run stops (the control record says ``stopped``), it plays the **final
evaluation**: the learner's final version on ``trainer.final_eval_episodes`` seeds per env (the
in-run seeds and more), with the machine to itself. The learner writes a checkpoint after its last
step before it says ``stopped`` and then closes its weight channel, so a stopping evaluator that
has not fetched the final version takes it from that checkpoint's ``hf/`` export when it can read
the run directory (as under ``worldloop up``); otherwise it waits up to ``FINAL_FETCH_S`` for the
channel. Then it exits. Under ``worldloop up``'s time budget the final evaluation also keeps to the
run's end: the learner's control record says by when (``final_eval_by``), the evaluator plays in
chunks of :data:`FINAL_CHUNK` episodes, the envs interleaved, and starts no chunk that would end
past it (its record then says ``cut``: planned, played, by). An HF backend on the CPU plays it in
``trainer.final_eval_processes`` processes (default one per core: :func:`play_final_split`, copies of
the evaluator made by ``fork``, one torch thread each); with one process its torch takes the cores
idle at that moment (:func:`idle_core_threads`).

Each evaluation is one line ``{"eval": {...}}`` in ``<run_dir>/eval.jsonl`` and in
``<run_dir>/metrics.jsonl``: policy version, ``final``, episodes, successes and the success rate
with its 95% Wilson interval per env and over all, mean episode reward, seconds, ``cpu_s`` (its own
CPU seconds, the final evaluation's forks included; the final record also ``processes``), ``cpu`` (:meth:`CpuBudget.snapshot`: the in-run evaluations' and the evaluator's
share of the run's CPU so far; the final record also ``cpu_at_stop``, the same when the run
stopped: the in-run evaluations' share of the whole run) and ``first_turn_reading`` (per env, the share of first turns whose
``<observation>`` reads the board right: :func:`worldloop.eval.reading.first_turn_reading`). On
``/metrics``: ``worldloop_eval_success_rate{env}``, ``worldloop_eval_first_turn_reading_accuracy{env}``,
``worldloop_eval_cpu_share``, ``worldloop_eval_policy_version``. ``worldloop up`` starts it when
``trainer.eval_every > 0`` and waits for the final evaluation before it stops the run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import signal
import threading
import time
from pathlib import Path

from worldloop.actor.backends import make_backend
from worldloop.common.transport.weights.fetcher import WeightFetcher
from worldloop.actor.episodes import play_episodes
from worldloop.actor.rollout import EpisodeSpec, Sampling, env_name
from worldloop.common.contracts.config import Config, ConfigError, run_dir_of
from worldloop.common.transport.control import default_proc_id, list_processes
from worldloop.common.files import append_lines
from worldloop.common.metrics import metric
from worldloop.common.transport.process import ProcessScaffold
from worldloop.common.contracts.schemas import decode_trajectory, encode_trajectory, packb, total_turn_reward, unpackb
from worldloop.learner.trackers import final_eval_processes
from worldloop.eval.cpu import CpuBudget, idle_cores
from worldloop.eval.reading import first_turn_reading
from worldloop.eval.stats import wilson_interval

log = logging.getLogger("worldloop.evaluator")

POLL_S = 0.2
FINAL_FETCH_S = 120.0  # how long a stopping evaluator waits for the learner's final version
FINAL_CHUNK = 64  # the final evaluation's episodes between looks at the run's deadline
OBSERVE_S = 2.0  # the run's CPU is read from the heartbeats (sent every 2 s) at most this often


def held_out_specs(cfg: Config, episodes: int | None = None) -> list[EpisodeSpec]:
    """The fixed evaluation set: ``episodes`` (default ``trainer.eval_episodes``) held-out seeds per
    env of ``actor.envs``."""
    out = []
    for e in cfg.actor.envs:
        for i in range(cfg.trainer.eval_episodes if episodes is None else episodes):
            out.append(EpisodeSpec(env_id=e.id, seed=cfg.eval.seed_start + i, env_kwargs=dict(e.kwargs or {}),
                                   env_name=e.name or env_name(e.id), max_turns=cfg.actor.max_turns))
    return out


def summarize(trajs: list, version: int, seconds: float) -> dict:
    """The ``eval`` record of one evaluation (success rate and 95% Wilson interval per env and all)."""
    by_env: dict[str, list] = {}
    for t in trajs:
        by_env.setdefault(t.env_name, []).append(t)
    by_env["all"] = list(trajs)
    success, ci, n, k = {}, {}, {}, {}
    for name, ts in by_env.items():
        k[name] = sum(1 for t in ts if t.success)
        n[name] = len(ts)
        success[name] = k[name] / n[name] if ts else None
        ci[name] = list(wilson_interval(k[name], n[name])) if ts else None
    rewards = [sum(total_turn_reward(turn) for turn in t.turns) for t in trajs]
    return {"policy_version": version, "step": version, "time": time.time(), "episodes": n, "successes": k,
            "success_rate": success, "ci95": ci, "reward_mean": sum(rewards) / len(rewards) if rewards else None,
            "seconds": seconds}


def evaluate(backend, cfg: Config, specs: list[EpisodeSpec]) -> list:
    return play_episodes(backend, specs, concurrency=cfg.actor.num_envs,
                         sampling=Sampling(cfg.eval.temperature, cfg.actor.top_p, cfg.actor.max_new_tokens),
                         max_model_len=cfg.model.max_model_len, actor_id="evaluator", sample_seed=cfg.run.seed,
                         keyed_sampling=cfg.eval.sampling == "keyed")


def checkpoint_weights(cfg: Config, run_dir: Path, version: int) -> dict | None:
    """The policy weights of ``version`` from the run's newest complete checkpoint, or None when there
    is none or it holds another version (the learner writes one after its last step)."""
    from worldloop.common.contracts.modeling import load_policy
    from worldloop.common.lora import enabled as lora_enabled
    from worldloop.common.lora import load_adapter_dir
    from worldloop.eval.model import ModelNotFound, resolve_model

    try:
        ref = resolve_model(str(run_dir / "checkpoints"), base_url=None, cfg=cfg, scratch=run_dir / "eval_scratch")
    except ModelNotFound as e:
        log.info("no checkpoint to take v%d from: %s", version, e)
        return None
    if ref.policy_version != version:
        log.info("the newest checkpoint holds v%s, not the final v%d", ref.policy_version, version)
        return None
    try:
        adapter = ref.path.parent / "adapter"
        if lora_enabled(cfg.model.lora):  # a LoRA run: the adapter, as the learner publishes it
            return load_adapter_dir(adapter)
        return {k: t.detach() for k, t in load_policy(ref.path).state_dict().items()}
    except Exception as e:  # an unreadable export: fall back to the weight channel
        log.warning("cannot load v%d from %s: %s: %s", version, ref.path, type(e).__name__, e)
        return None


def idle_core_threads(cfg: Config, idle=idle_cores) -> int:
    """The final evaluation runs once the actors have stopped and the learner waits: an HF backend's
    torch takes the cores idle now (``idle()``, rounded down unless within 0.25 of the next), when
    that is more than the share ``worldloop up`` gave each child (``OMP_NUM_THREADS``). Never the
    busy ones: torch's threads wait for each other at every operation, so one that other work (at a
    higher priority than the evaluator's ``trainer.eval_nice``) keeps off its core stalls them all
    (measured: a 512-episode final evaluation beside one busy process took 241 s and 280 CPU s on 2
    threads, against 50 s and 90 CPU s on 2 idle cores). A vLLM engine keeps its own threads.
    Returns torch's thread count."""
    import torch

    if cfg.actor.backend not in ("hf", "server"):  # make_backend(local=True): HF for both
        return torch.get_num_threads()
    free = idle()
    want = 1 if free is None else max(1, int(free + 0.25))
    if want > torch.get_num_threads():
        log.info("the final evaluation takes the %d idle cores (%.2f idle): %d torch threads (were %d)", want,
                 free, want, torch.get_num_threads())
        torch.set_num_threads(want)
    return torch.get_num_threads()


def final_episodes(cfg: Config) -> int:
    """Held-out episodes per env of the final evaluation (``trainer.final_eval_episodes``, or else
    ``trainer.eval_episodes``)."""
    return cfg.trainer.final_eval_episodes or cfg.trainer.eval_episodes


def write_record(run_dir: Path, rec: dict) -> None:
    line = json.dumps({"eval": rec}) + "\n"
    for name in ("eval.jsonl", "metrics.jsonl"):
        append_lines(run_dir / name, [line])
    for env, rate in rec["success_rate"].items():
        if rate is not None:
            metric("worldloop_eval_success_rate").labels(env=env).set(rate)
    for env, rate in (rec.get("first_turn_reading") or {}).get("rate", {}).items():
        if rate is not None:
            metric("worldloop_eval_first_turn_reading_accuracy").labels(env=env).set(rate)
    share = (rec.get("cpu_at_stop") or rec.get("cpu") or {}).get("in_run_eval_share")
    if share is not None:
        metric("worldloop_eval_cpu_share").set(share)
    metric("worldloop_eval_policy_version").set(rec["policy_version"])
    metric("worldloop_eval_episodes").inc(rec["episodes"]["all"])


def run(cfg: Config, args: argparse.Namespace | None = None) -> int:
    _check_config(cfg)
    from worldloop.common.transport.weights import subscriber_from_config

    run_dir = run_dir_of(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.trainer.eval_nice:
        os.nice(cfg.trainer.eval_nice)  # the actors and the learner come first
    proc_id = f"evaluator-{default_proc_id()}"
    backend = subscriber = fetcher = None
    fetch_stop = threading.Event()  # the fetcher outlives a stop request: the final version still comes
    with ProcessScaffold(cfg, "evaluator", proc_id, stop_message="evaluating the final version, then exiting",
                         cpu_seconds=lambda: time.process_time() + _children_cpu()) as proc:  # the final's forks too
        try:
            proc.set_phase("loading the generation backend")
            backend = make_backend(cfg, local=True)  # weights it sets itself: hf for actor.backend=server
            subscriber = subscriber_from_config(cfg)
            fetcher = WeightFetcher(subscriber, fetch_stop, have=backend.version)
            fetcher.start()
            proc.ready()
            evals = Evaluations(cfg, proc, backend, run_dir, CpuBudget(cfg.trainer.eval_cpu_share))
            _evaluate_until_final(cfg, proc, backend, fetcher, evals)
        finally:
            fetch_stop.set()
            if fetcher is not None:
                fetcher.join(timeout=1.0)
            for obj in (subscriber if fetcher is None or not fetcher.is_alive() else None, backend):
                if obj is not None:
                    try:
                        obj.close()
                    except Exception as e:  # best-effort teardown
                        log.warning("closing %s: %s", type(obj).__name__, e)
    return 0


def _check_config(cfg: Config) -> None:
    if cfg.trainer.eval_every <= 0:
        raise ConfigError("trainer.eval_every", "the evaluator needs eval_every > 0 (evaluate every N versions)")
    if not cfg.redis.url:
        raise ConfigError("redis.url", "the evaluator needs the run's Redis (worldloop up sets it)")
    if not cfg.model.path or not (Path(cfg.model.path) / "config.json").exists():
        raise ConfigError("model.path", f"no model directory at {cfg.model.path!r} (no config.json)")


class Evaluations:
    """The evaluations of one evaluator: in-run ones within the CPU budget, and the final one."""

    def __init__(self, cfg: Config, proc, backend, run_dir: Path, budget: CpuBudget):
        from worldloop.common.transport.streams import connect

        self.cfg, self.proc, self.backend, self.run_dir, self.budget = cfg, proc, backend, run_dir, budget
        self.in_run = held_out_specs(cfg)
        self.final = held_out_specs(cfg, final_episodes(cfg))
        self.redis = connect(cfg.redis.url, cfg.redis.socket_timeout_s)
        self.observed_at = float("-inf")
        self.at_stop: dict | None = None  # the CPU when the run stopped: the in-run evaluations' share

    def observe(self, force: bool = False) -> None:
        """Read the run's CPU from the heartbeats (at most every OBSERVE_S unless ``force``)."""
        if force or time.monotonic() - self.observed_at >= OBSERVE_S:
            self.observed_at = time.monotonic()
            try:
                self.budget.observe(list_processes(self.redis, self.proc.keys), f"evaluator:{self.proc.proc_id}")
            except Exception as e:  # Redis away: decide on what was seen
                log.debug("reading the heartbeats: %s", e)

    def may_start(self) -> bool:
        """Whether the CPU budget lets an in-run evaluation start now."""
        self.observe()
        return self.budget.allows()

    def stopped(self) -> None:
        """The run stopped: what the in-run evaluations took of its CPU is final now."""
        self.observe(force=True)
        self.at_stop = self.budget.snapshot()
        log.info("the run stopped: the in-run evaluations took %.1f of its %.1f CPU seconds (%s)",
                 self.at_stop["in_run_eval_s"], self.at_stop["run_s"], self.at_stop["in_run_eval_share"])

    def evaluate(self, final: bool) -> int:
        """One evaluation of the backend's version (the final set, or an in-run one charged to the
        budget), recorded; returns that version."""
        specs = self.final if final else self.in_run
        v = self.backend.version
        self.proc.set_phase(f"evaluating v{v} on {len(specs)} held-out episodes" + (" (final)" if final else ""))
        t0, cpu0 = time.monotonic(), time.process_time()
        cut = None
        kids0 = _children_cpu()
        if final:
            processes = final_eval_processes(self.cfg, cuda=str(getattr(self.backend, "device", "cpu")).startswith("cuda"))
            if processes == 1:
                idle_core_threads(self.cfg)  # more processes take one thread each
            trajs, cut = play_final_split(self.backend, self.cfg, specs, self.proc.control.get("final_eval_by", 0.0),
                                          processes, self.run_dir / "eval_scratch")
        else:
            trajs = evaluate(self.backend, self.cfg, specs)
        rec = summarize(trajs, v, time.monotonic() - t0)
        if cut is not None:
            rec["cut"] = cut
        rec["first_turn_reading"] = first_turn_reading(trajs, self.cfg.judge)
        rec["cpu_s"] = round(time.process_time() - cpu0 + _children_cpu() - kids0, 2)  # the forks' too
        if final:
            rec["processes"] = processes
        if not final:
            self.budget.charge(rec["cpu_s"])
        rec.update(final=final, cpu=self.budget.snapshot())
        if final and self.at_stop is not None:
            rec["cpu_at_stop"] = self.at_stop
        write_record(self.run_dir, rec)
        log.info("v%d held-out success %s, first-turn reading %s (n=%d, %.0fs, %.1f CPU s; in-run evaluation "
                 "share of the run's CPU %s)%s", v,
                 {k: round(x, 3) for k, x in rec["success_rate"].items() if x is not None},
                 {k: round(x, 3) for k, x in rec["first_turn_reading"]["rate"].items() if x is not None},
                 rec["episodes"]["all"], rec["seconds"], rec["cpu_s"], rec["cpu"]["in_run_eval_share"],
                 " (final)" if final else "")
        return v


def play_final(backend, cfg: Config, specs: list[EpisodeSpec], by: float,
               chunk: int = FINAL_CHUNK) -> tuple[list, dict | None]:
    """The final evaluation's episodes, in chunks of ``chunk`` (:data:`FINAL_CHUNK`) with the envs interleaved
    (seed 0 of every env, then seed 1, ...), and ``(trajectories, None)``. With a deadline ``by``
    (``time.time()``; the learner's ``final_eval_by``, 0 = none) a chunk that would end past it,
    judged by the last chunk's time, is not started: the run's budget holds on a slow or loaded
    machine, and the evaluation says what it played, ``cut = {planned, played, by}``. The first
    chunk always runs."""
    order = sorted(specs, key=lambda s: s.seed)  # stable: within a seed, the envs in their order
    trajs: list = []
    last = 0.0
    for i in range(0, len(order), chunk):
        if i and by > 0 and time.time() + last > by:
            log.warning("the final evaluation stops after %d of %d episodes: another %d would end past the "
                        "run's budget (final_eval_by, %.0fs from now; the last chunk took %.0fs)", len(trajs),
                        len(order), chunk, by - time.time(), last)
            return trajs, {"planned": len(order), "played": len(trajs), "by": round(by, 1)}
        t = time.monotonic()
        trajs += evaluate(backend, cfg, order[i:i + chunk])
        last = time.monotonic() - t
    return trajs, None


def _children_cpu() -> float:
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return kids.ru_utime + kids.ru_stime


def play_final_split(backend, cfg: Config, specs: list[EpisodeSpec], by: float, processes: int,
                     scratch: Path) -> tuple[list, dict | None]:
    """:func:`play_final` in ``processes`` processes (:func:`worldloop.learner.trackers.final_eval_processes`):
    this one and ``processes - 1`` copies of it made by ``os.fork``, which hold its backend and weights
    as they are now; each plays every ``processes``-th episode of the seed order on one torch thread, with
    the same deadline. The decode loop is Python-bound on the tiny presets, so a second torch thread
    did little (the 512 episodes of a 2-core run took 107 s and 108 CPU s) where two processes took
    75 s. A copy writes its trajectories (the trajectory schema, msgpack) to a file in ``scratch``
    and exits; one that fails or writes nothing has its episodes played here afterwards, within the
    deadline. The copies die with this process (``PR_SET_PDEATHSIG``). Returns the trajectories in the
    seed order and the ``cut`` of :func:`play_final` over all of them (or None)."""
    import torch

    order = sorted(specs, key=lambda s: s.seed)
    if processes <= 1 or len(order) < 2:
        return play_final(backend, cfg, order, by)
    parts = [order[k::processes] for k in range(processes) if order[k::processes]]
    scratch.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    kids, waiting = [], set()  # waiting: the copies not yet reaped (never signal a reaped pid: it may be reused)
    parent = os.getpid()
    try:
        for k, part in enumerate(parts[1:], 1):
            path = scratch / f"final-{parent}-{k}.msgpack"
            pid = os.fork()
            if pid == 0:  # the copy: play, write, and leave without running the parent's exit handlers
                code = 1
                try:
                    _die_with_parent(parent)
                    got, cut = play_final(backend, cfg, part, by)
                    tmp = path.with_suffix(".tmp")
                    tmp.write_bytes(packb({"trajectories": [encode_trajectory(t) for t in got], "cut": cut}))
                    os.replace(tmp, path)
                    code = 0
                except BaseException:
                    log.exception("the final evaluation's process %d of %d failed", k + 1, len(parts))
                finally:
                    os._exit(code)
            kids.append((pid, path, part))
            waiting.add(pid)
        log.info("the final evaluation plays %d episodes in %d processes (this one and %d forks)", len(order),
                 len(parts), len(kids))
        trajs, cuts = [], []
        got, cut = play_final(backend, cfg, parts[0], by)
        trajs += got
        cuts.append(cut)
        for pid, path, part in kids:
            got, cut = _collect_fork(pid, path)
            waiting.discard(pid)
            if got is None:
                log.warning("the final evaluation's process %d brought nothing back: its %d episodes are played here",
                            pid, len(part))
                got, cut = play_final(backend, cfg, part, by)
            trajs += got
            cuts.append(cut)
    finally:
        torch.set_num_threads(threads)
        for pid in waiting:  # a copy still running when this one failed: stop it
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
    rank = {(s.env_name, s.seed): i for i, s in enumerate(order)}
    trajs.sort(key=lambda t: rank.get((t.env_name, t.seed), len(rank)))
    if all(c is None for c in cuts):
        return trajs, None
    return trajs, {"planned": len(order), "played": len(trajs), "by": round(by, 1)}


def _collect_fork(pid: int, path: Path) -> tuple[list | None, dict | None]:
    """Wait for a copy of :func:`play_final_split` and read what it wrote: (trajectories, cut), or
    (None, None) when it failed or its file does not decode."""
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    try:
        if code != 0:
            log.warning("the final evaluation's process %d exited %d", pid, code)
            return None, None
        data = unpackb(path.read_bytes())
        return [decode_trajectory(b) for b in data["trajectories"]], data["cut"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("the final evaluation's process %d wrote nothing readable: %s: %s", pid, type(e).__name__, e)
        return None, None
    finally:
        path.unlink(missing_ok=True)


def _die_with_parent(parent: int) -> None:
    """Linux: this process gets SIGKILL when its parent dies (prctl PR_SET_PDEATHSIG), so a copy of a
    killed evaluator does not play on alone; elsewhere nothing. A parent already gone ends it at once."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # it died before the prctl took effect
        os._exit(1)


def _evaluate_until_final(cfg: Config, proc, backend, fetcher, evals: Evaluations) -> None:
    """Evaluate every ``trainer.eval_every`` versions as the weights arrive and the CPU budget
    allows; once the run stops, play the final evaluation of the learner's final version (from the
    channel or its checkpoint) and return."""
    done: int | None = None
    final: int | None = None  # the learner's version when the run stopped
    final_by = 0.0
    from_disk = False  # tried the final checkpoint already
    seen = None  # the control record's version at the last look
    while True:
        fetcher.check()  # its thread stopped on a fatal error: exit non-zero, the supervisor restarts us
        got = fetcher.take()
        if got is not None and (final is None or got[0] >= final):  # stopping: only the final version
            backend.update_weights(got[1], got[0])
        learner = int(proc.control.get("policy_version") or 0)
        if seen is not None and learner < seen:
            # the learner restarted from an older checkpoint and reuses version numbers:
            # take what it publishes now (as actors do)
            fetcher.resync()
            done = None if done is None else min(done, learner)
        seen = learner
        if final is None and proc.should_stop():
            final = int(proc.control.get("policy_version") or backend.version)
            final_by = time.monotonic() + FINAL_FETCH_S
            evals.stopped()
        if final is not None and backend.version < final and not from_disk:
            from_disk = True
            proc.set_phase(f"loading the final version v{final} from its checkpoint")
            got = checkpoint_weights(cfg, evals.run_dir, final)
            if got is not None:
                backend.update_weights(got, final)
                log.info("took the final version v%d from the run's checkpoint", final)
                continue
        if final is not None and backend.version < final and time.monotonic() < final_by:
            proc.set_phase(f"fetching the final version v{final}")
            time.sleep(POLL_S)
            continue
        if final is not None:
            if done != backend.version or final_episodes(cfg) != cfg.trainer.eval_episodes:
                evals.evaluate(final=True)
            return
        if done is None or backend.version >= done + cfg.trainer.eval_every:
            if evals.may_start():
                done = evals.evaluate(final=False)
                continue
            proc.set_phase(f"v{backend.version} due: waiting for the CPU budget (trainer.eval_cpu_share)")
        else:
            proc.set_phase(f"waiting for version {done + cfg.trainer.eval_every}")
        time.sleep(POLL_S)
