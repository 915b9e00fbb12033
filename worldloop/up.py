"""``worldloop up``: a whole training run on one machine, for a newcomer.

Steps, each logged:

1. run directory ``run.run_dir`` (default ``runs/<config>-<YYYYmmdd-HHMMSS>``) with ``logs/`` and
   ``versions.json`` (Python's and the learning-relevant packages' versions, :func:`worldloop.common.versions.package_versions`);
2. Redis: ``redis.url`` when given, else a private ``redis-server`` (system or bundled) whose data
   (an append-only file fsynced by ``redis.appendfsync``) lives in the run directory;
3. model: :func:`worldloop.bootstrap.store.prepare_model`: an existing ``model.path`` as it is, else
   the warm start of the config's recipe: shipped with the package (used at once), cached on this
   machine, or made on the spot (the tiny model, grounding pre-training and SFT) and cached;
   ``model.json`` says which (source and recipe hash), ``grounding.json`` and ``sft.json`` hold the
   recipe's reports;
4. time budget: with ``up.time_limit_s``, what is left of it after the model is made, less
   ``up.final_reserve_s``, becomes the learner's ``trainer.time_limit_s`` (it stops before an update
   that would end past it), so the whole run ends within the budget on a slower machine too;
5. children: the learner, ``up.num_actors`` actors and ``up.num_judges`` judges (none when
   ``judge.enabled`` is false), and with ``actor.backend=server`` and no ``actor.servers`` one
   inference server (:func:`worldloop.serve.plan_local_servers`), each ``python -m worldloop
   <role>`` with the resolved config written to ``<run_dir>/config.yaml``, output in
   ``<run_dir>/logs/<name>.log``; a crashed actor, judge or server is restarted (at most
   ``MAX_RESTARTS`` times each), a crashed learner too, with ``--resume``;
6. a live progress line (step, episodes/s, success rate, reward, staleness) built from the learner's
   ``metrics.jsonl`` and from scraping every child's ``/metrics`` (the URLs come from the process
   heartbeats in Redis);
7. the end: after ``trainer.total_steps`` or the time limit (the learner exits 0) or on Ctrl-C/SIGTERM the control
   record says ``stopped``, children get SIGTERM (then SIGKILL), ``training.png`` is drawn from
   ``metrics.jsonl`` (:mod:`worldloop.plot`), ``scrapes.json`` records which processes were scraped and
   ``process_metrics.json`` the last scrape of each (its metric sums: idle seconds, episodes, ...)
   and ``cpu.json`` the CPU seconds per role and the evaluator's share of them (the evaluator process's
   own: the final evaluation's forks are counted in its record's ``cpu_s``).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from worldloop.bootstrap.store import prepare_model
from worldloop.common.contracts.config import Config, to_dict
from worldloop.common.transport.control import list_processes, read_control, write_control
from worldloop.common.transport.key_migration import migrate_legacy_keys
from worldloop.common.contracts.keys import Keys
from worldloop.common.secrets import password_to_env, redacted
from worldloop.common.versions import write_versions
from worldloop.eval.cpu import usable_cores
from worldloop.plot import plot_metrics
from worldloop.serve import plan_local_servers

if TYPE_CHECKING:
    from worldloop.common.transport.redis_local import LocalRedis

log = logging.getLogger("worldloop.up")

MAX_RESTARTS = 5
RATE_WINDOW_S = 30.0  # episodes/s on the progress line: over this window
QUIET_PRINT_S = 30.0  # without a terminal, an unchanged progress line is repeated this rarely
LEARNER_QUIET_S = 20.0  # the progress line says what the learner waits on once it has for this long
FINAL_EVAL_WAIT_S = 600.0  # at most this long for the evaluator's last evaluation after the last step


@dataclass
class Child:
    name: str
    role: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None
    restarts: int = 0
    log_file: object | None = None
    finished: bool = False  # exited cleanly after the run was stopped: not restarted

    def start(self, env: dict) -> None:
        self.log_file = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.argv, stdout=self.log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.info("started %s (pid %d), log %s", self.name, self.proc.pid, self.log_path)

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        if self.log_file is not None:
            self.log_file.close()
            self.log_file = None


@dataclass
class Progress:
    """What the live line shows; refreshed from metrics.jsonl and /metrics scrapes."""

    step: int = 0
    episodes: float = 0.0
    episodes_per_s: float = 0.0
    success_rate: float | None = None
    reward: float | None = None
    staleness: float | None = None
    learner_phase: str | None = None  # from the learner's heartbeat: what it is doing or waiting on
    learner_phase_s: float = 0.0  # for how long
    learner_silent_s: float | None = None  # seconds since its last heartbeat (None: never seen)
    learner_restarts: int = 0
    held_out: float | None = None  # the evaluator's newest held-out success rate
    held_out_version: int | None = None
    scraped: dict[str, int] = field(default_factory=dict)
    # the last scrape of every process ("role:id" -> time, metric sums): process_metrics.json
    last_values: dict[str, dict] = field(default_factory=dict)
    # (monotonic time, episodes) samples of the last RATE_WINDOW_S: episodes arrive in bursts
    _samples: deque = field(default_factory=deque)

    def line(self, total_steps: int) -> str:
        def fmt(x, spec):
            return "-" if x is None else format(x, spec)

        out = (
            f"step {self.step}/{total_steps} | episodes {self.episodes:.0f} ({self.episodes_per_s:.2f}/s) | "
            f"success {fmt(self.success_rate, '.2f')} | reward {fmt(self.reward, '.3f')} | "
            f"staleness {fmt(self.staleness, '.2f')}"
        )
        if self.held_out is not None:
            out += f" | held-out {self.held_out:.2f} @v{self.held_out_version}"
        if self.learner_restarts:
            out += f" | learner restarted {self.learner_restarts}x (resumed)"
        return out + self.learner_note()

    def learner_note(self) -> str:
        """Where a learner that makes no progress is: its heartbeat's phase once it has lasted
        LEARNER_QUIET_S, or how long it has been silent."""
        if self.learner_silent_s is not None and self.learner_silent_s > LEARNER_QUIET_S:
            return f" | learner: no heartbeat for {self.learner_silent_s:.0f}s (see logs/learner.log)"
        if self.learner_phase and self.learner_phase_s >= LEARNER_QUIET_S:
            return f" | learner: {self.learner_phase} for {self.learner_phase_s:.0f}s"
        return ""


def default_run_dir(cfg: Config) -> Path:
    stem = Path(cfg.source).stem if cfg.source else cfg.run.name
    return Path("runs") / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def _children(cfg: Config, config_path: Path, run_dir: Path) -> list[Child]:
    py = sys.executable
    base = [py, "-m", "worldloop"]
    logs = run_dir / "logs"
    out = [Child("learner", "learner", base + ["learner", "--config", str(config_path)], logs / "learner.log")]
    for i in range(cfg.up.num_actors):
        name = f"actor-{i}"
        out.append(Child(name, "actor", base + ["actor", "--config", str(config_path), f"actor.actor_id={name}"],
                         logs / f"{name}.log"))
    if cfg.trainer.eval_every > 0:
        out.append(Child("evaluator", "evaluator", base + ["evaluator", "--config", str(config_path)],
                         logs / "evaluator.log"))
    if cfg.judge.enabled:
        for i in range(cfg.up.num_judges):
            name = f"judge-{i}"
            out.append(Child(name, "judge", base + ["judge", "--config", str(config_path)], logs / f"{name}.log"))
    return out


def _scrape(url: str, timeout: float = 2.0) -> dict[str, float]:
    """Sum every sample of a /metrics page by name (labels folded)."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        text = resp.read().decode()
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0]
        try:
            sums[name] = sums.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return sums


def _last_jsonl(path: Path) -> dict | None:
    if not path.exists():
        return None
    last = None
    with open(path, "rb") as f:
        for line in f:
            line = line.strip()
            if line:
                last = line
    if last is None:
        return None
    try:
        return json.loads(last)
    except ValueError:
        return None


def _last_step_record(path: Path) -> dict | None:
    """The newest learner step line of metrics.jsonl (the evaluator's ``eval`` lines are skipped)."""
    if not path.exists():
        return None
    for line in reversed(path.read_text(errors="replace").splitlines()):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if "step" in rec:
            return rec
    return None


def _refresh(progress: Progress, r, keys: Keys, run_dir: Path) -> None:
    rec = _last_step_record(run_dir / "metrics.jsonl")
    last_eval = (_last_jsonl(run_dir / "eval.jsonl") or {}).get("eval")
    if last_eval:
        progress.held_out = last_eval["success_rate"].get("all")
        progress.held_out_version = last_eval["policy_version"]
    if rec:
        progress.step = int(rec.get("step", progress.step))
        progress.reward = rec.get("reward", {}).get("total") if isinstance(rec.get("reward"), dict) else rec.get("reward")
        sr = rec.get("success_rate")
        progress.success_rate = sr.get("all") if isinstance(sr, dict) else sr
        progress.staleness = rec.get("staleness_mean", rec.get("staleness"))
    episodes = 0.0
    procs = list_processes(r, keys)
    learners = [p for p in procs if p.get("role") == "learner"]
    if learners:
        newest = max(learners, key=lambda p: float(p.get("seen_at", 0)))
        progress.learner_silent_s = max(0.0, time.time() - float(newest.get("seen_at", 0)))
        progress.learner_phase = newest.get("phase")
        progress.learner_phase_s = max(0.0, time.time() - float(newest.get("phase_since", time.time())))
    for p in procs:
        url = p.get("metrics_url")
        if not url or time.time() - float(p.get("seen_at", 0)) > 30:
            continue
        try:
            sums = _scrape(url)
        except OSError:
            continue
        key = f"{p.get('role')}:{p.get('id')}"
        progress.scraped[key] = progress.scraped.get(key, 0) + 1
        progress.last_values[key] = {"time": time.time(), "started_at": p.get("started_at"), "metrics": sums}
        episodes += sums.get("worldloop_actor_episodes_total", 0.0)
    now = time.monotonic()
    if episodes < progress.episodes:  # an actor restarted and its counter began again: restart the window
        progress._samples.clear()
    progress._samples.append((now, episodes))
    while len(progress._samples) > 2 and now - progress._samples[1][0] >= RATE_WINDOW_S:
        progress._samples.popleft()
    t0, e0 = progress._samples[0]
    progress.episodes_per_s = (episodes - e0) / (now - t0) if now > t0 else 0.0
    progress.episodes = max(progress.episodes, episodes)


def run(cfg: Config, args) -> int:
    from worldloop.common.transport.streams import connect

    started = time.monotonic()
    run_dir = _open_run_dir(cfg)
    # the password of an external redis.url goes to the children in the environment, never in
    # config.yaml or on a command line (common/secrets.py)
    password_to_env(cfg, os.environ)
    local_redis = _local_services(cfg, run_dir)
    children: list[Child] = []
    stop = {"flag": False, "preparing": True}
    old = {s: signal.signal(s, _signal_handler(stop)) for s in (signal.SIGINT, signal.SIGTERM)}
    r = connect(cfg.redis.url, cfg.redis.socket_timeout_s)
    keys = Keys(cfg.redis.namespace)
    progress = Progress()
    rc = 0
    try:
        prepare_model(cfg, run_dir)
        stop["preparing"] = False
        learner_time_budget(cfg, time.monotonic() - started)
        config_path = run_dir / "config.yaml"
        servers = plan_local_servers(cfg, config_path)  # actor.backend=server: sets actor.servers
        config_path.write_text(yaml.safe_dump(redacted(to_dict(cfg)), sort_keys=False))
        migrate_legacy_keys(r, keys)  # a run of an older worldloop: its keys get their {namespace} names first
        write_control(r, keys, run_state="running")
        children = _children(cfg, config_path, run_dir)
        children += [Child(name, "server", argv, run_dir / "logs" / f"{name}.log") for name, argv in servers]
        env = _child_env(len(children))
        for c in children:
            c.start(env)
        rc = _supervise(cfg, children, env, r, keys, run_dir, progress, stop)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        _finish(r, keys, children, progress, run_dir)
        if local_redis is not None:
            local_redis.close()
    return rc


def _open_run_dir(cfg: Config) -> Path:
    """``run.run_dir`` (or :func:`default_run_dir`) with ``logs/`` and ``versions.json``; the config
    then names it."""
    run_dir = Path(cfg.run.run_dir) if cfg.run.run_dir else default_run_dir(cfg)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    cfg.run.run_dir = str(run_dir)
    print(f"worldloop up: run directory {run_dir}", flush=True)
    write_versions(run_dir)
    return run_dir


def _local_services(cfg: Config, run_dir: Path) -> LocalRedis | None:
    """A private redis-server when ``redis.url`` is null (returned, to close at the end; else None)
    and free ports for the weight channel's ports left at 0, so several local runs can share a
    machine; the config is updated to name them."""
    from worldloop.common.metrics import unassigned_port
    from worldloop.common.transport.redis_local import LocalRedis

    local_redis = None
    if cfg.redis.url is None:
        # persisted (AOF, redis.appendfsync): a Redis that dies with the run loses nothing acknowledged
        local_redis = LocalRedis(data_dir=str(run_dir / "redis"), persist=True, appendfsync=cfg.redis.appendfsync).start()
        cfg.redis.url = local_redis.url
        print(f"worldloop up: started a local redis-server at {cfg.redis.url}", flush=True)
    # every child is told these ports before the learner binds them, and a learner restarted on a
    # taken port fails again: drawn below the ephemeral range, where no client socket lands meanwhile
    if cfg.weights.pub_port == 0:
        cfg.weights.pub_port = unassigned_port()
    if cfg.weights.fetch_port == 0:
        cfg.weights.fetch_port = unassigned_port()
        while cfg.weights.fetch_port == cfg.weights.pub_port:
            cfg.weights.fetch_port = unassigned_port()
    return local_redis


def _signal_handler(stop: dict):
    """SIGINT/SIGTERM: set ``stop["flag"]``; while the model is prepared (``stop["preparing"]``),
    interrupt at once."""

    def on_signal(signum, _frame):
        stop["flag"] = True
        if stop["preparing"]:
            stop["preparing"] = False  # a second signal during the clean-up only sets the flag
            # grounding and SFT run here, in this process, for minutes, and look at no flag: stop now
            raise KeyboardInterrupt(f"signal {signum} while preparing the model")

    return on_signal


def _child_env(n_children: int) -> dict:
    """The environment of every child: this one, unbuffered output, DeepSpeed's op cache and a
    thread count that shares the machine's cores between the children."""
    env = dict(os.environ)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.cwd() / ".torch_extensions"))
    env["PYTHONUNBUFFERED"] = "1"
    # one machine's cores shared by every child: torch's default (a thread per core in each
    # process) oversubscribes them, measured 10-20x slower per step on 2 cores; a user's own
    # OMP_NUM_THREADS wins
    env.setdefault("OMP_NUM_THREADS", str(child_threads(n_children)))
    return env


def _finish(r, keys: Keys, children: list[Child], progress: Progress, run_dir: Path) -> None:
    """The end of every run: the control record says stopped, the children are stopped, and the
    run directory gets scrapes.json, process_metrics.json and training.png."""
    import redis

    try:
        write_control(r, keys, run_state="stopped")
    except redis.RedisError:
        pass
    _stop_children(children)
    (run_dir / "scrapes.json").write_text(json.dumps(progress.scraped, indent=2))
    (run_dir / "process_metrics.json").write_text(json.dumps(progress.last_values, indent=1))
    _cpu_summary(progress, run_dir)
    drew = plot_metrics(run_dir / "metrics.jsonl", run_dir / "training.png")
    print(f"\nworldloop up: {'plot' if drew else 'empty plot'} in {run_dir / 'training.png'}", flush=True)


def _cpu_summary(progress: Progress, run_dir: Path) -> dict:
    """``cpu.json``: CPU seconds per role from the last scrape of every process (the evaluator's
    final evaluation included when the learner waited for it) and, by the evaluator's own count,
    the in-run evaluations' share of the run's CPU until the run stopped (the final record's
    ``cpu_at_stop``, else the newest record's ``cpu``); printed in one line."""
    from worldloop.eval.cpu import cpu_by_role

    cpu = cpu_by_role(progress.last_values)
    records = [rec["eval"] for rec in _eval_records(run_dir / "eval.jsonl")]
    last = records[-1] if records else {}
    cpu["in_run_eval"] = last.get("cpu_at_stop") or last.get("cpu")
    (run_dir / "cpu.json").write_text(json.dumps(cpu, indent=2))
    if cpu["total_s"]:
        share = cpu["share"].get("evaluator")
        line = (f"worldloop up: CPU seconds by role {cpu['seconds']}"
                + (f"; the evaluator's share {share:.1%} (its final evaluation included)" if share is not None else ""))
        in_run = (cpu["in_run_eval"] or {}).get("in_run_eval_share")
        if in_run is not None:
            line += f"; in-run evaluations {in_run:.1%} of the run's CPU (budget {cpu['in_run_eval']['budget_share']:.0%})"
        print(line, flush=True)
    return cpu


def _eval_records(path: Path) -> list[dict]:
    """The readable lines of a JSONL file that hold an ``eval`` record (none: no file)."""
    out = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("eval"), dict):
                out.append(rec)
    return out


@dataclass
class _LinePrinter:
    """Prints the progress line every ``up.progress_interval_s``: in place on a terminal; to a log
    file once per learner step, and otherwise once every QUIET_PRINT_S."""

    interval_s: float
    total_steps: int
    tty: bool = field(default_factory=lambda: sys.stdout.isatty())
    last_print: float = 0.0
    last_shown: float = 0.0
    shown: str = ""

    def tick(self, progress: Progress, r, keys: Keys, run_dir: Path) -> None:
        if time.monotonic() - self.last_print < self.interval_s:
            return
        self.last_print = time.monotonic()
        try:
            _refresh(progress, r, keys, run_dir)
        except Exception as e:  # progress display must never end the run
            log.debug("progress refresh failed: %s", e)
        line = progress.line(self.total_steps)
        if self.tty:
            print("\r" + line, end="", flush=True)
        elif line.split(" | ")[0] != self.shown.split(" | ")[0] or self.last_print - self.last_shown >= QUIET_PRINT_S:
            print(line, flush=True)
            self.shown, self.last_shown = line, self.last_print


def _supervise(cfg, children, env, r, keys, run_dir, progress, stop) -> int:
    """Watch the children until the learner finishes (0), gives up (its exit code), another child
    gives up (1) or a signal stops the run (130); crashed children are restarted."""
    printer = _LinePrinter(cfg.up.progress_interval_s, cfg.trainer.total_steps)
    learner = children[0]
    while not stop["flag"]:
        time.sleep(0.5)
        code = learner.poll()
        if code == 0:
            _learner_finished(cfg, children, r, keys, run_dir, progress, stop, printer.tty)
            return 0
        if code is not None and not stop["flag"]:
            if not _restart_learner(learner, code, env, progress):
                return code
            continue
        if not _restart_crashed(children[1:], env, r, keys, stop):
            return 1
        printer.tick(progress, r, keys, run_dir)
    print("\nworldloop up: stopping", flush=True)
    return 130


def _learner_finished(cfg, children, r, keys, run_dir, progress, stop, tty: bool) -> None:
    """The learner exited 0: the last progress line, why it stopped, the final evaluation."""
    _refresh(progress, r, keys, run_dir)
    print(("\r" if tty else "") + progress.line(cfg.trainer.total_steps), flush=True)
    final = _final_version(run_dir)
    if final is not None and final < cfg.trainer.total_steps:
        print(f"worldloop up: learner stopped at trainer.time_limit_s after {final} of "
              f"{cfg.trainer.total_steps} updates", flush=True)
    else:
        print("worldloop up: learner finished trainer.total_steps", flush=True)
    evaluator = next((c for c in children if c.role == "evaluator"), None)
    if evaluator is not None:
        _wait_final_eval(evaluator, run_dir, stop)


def _restart_learner(learner: Child, code: int, env: dict, progress: Progress) -> bool:
    """A crashed learner continues from its newest checkpoint (``--resume``), like any other child
    within the restart budget: what it had not checkpointed is still pending and is trained again.
    False when the budget is spent."""
    learner.close()
    if learner.restarts >= MAX_RESTARTS:
        print(f"\nworldloop up: learner exited with {code} {learner.restarts} times; giving up; see "
              f"{learner.log_path}", flush=True)
        return False
    learner.restarts += 1
    progress.learner_restarts = learner.restarts
    if "--resume" not in learner.argv:
        learner.argv = learner.argv + ["--resume"]
    print(f"\nworldloop up: learner exited with {code}; restarting with --resume "
          f"({learner.restarts}/{MAX_RESTARTS}); see {learner.log_path}", flush=True)
    learner.start(env)
    return True


def _restart_crashed(children: list[Child], env: dict, r, keys: Keys, stop: dict) -> bool:
    """Restart every exited actor, judge and evaluator within its restart budget; one that exits
    cleanly after the run was stopped is left finished. False when a budget is spent."""
    for c in children:
        code = c.poll()
        if code is None or stop["flag"] or c.finished:
            continue
        if code == 0 and _run_stopped(r, keys):
            # the learner finished and said stopped: actors and judges exit cleanly while it
            # waits for the final evaluation; the run is over, nothing to restart
            print(f"\nworldloop up: {c.name} finished (run_state stopped)", flush=True)
            c.close()
            c.finished = True
            continue
        c.close()
        if c.restarts >= MAX_RESTARTS:
            print(f"\nworldloop up: {c.name} exited with {code} {c.restarts} times; giving up", flush=True)
            return False
        c.restarts += 1
        print(f"\nworldloop up: {c.name} exited with {code}; restarting ({c.restarts}/{MAX_RESTARTS})", flush=True)
        c.start(env)
    return True


def _run_stopped(r, keys: Keys) -> bool:
    try:
        return read_control(r, keys).get("run_state") == "stopped"
    except Exception:  # Redis away: treat the exit as a crash (restarted, as before)
        return False


def learner_time_budget(cfg: Config, elapsed_s: float) -> float | None:
    """``up.time_limit_s``: set ``trainer.time_limit_s`` to what is left of it after ``elapsed_s``
    (making the model) and ``up.final_reserve_s`` (the final evaluation), at least 1 s, or to the
    config's own ``trainer.time_limit_s`` if that is smaller; returns the learner's limit."""
    budget = cfg.up.time_limit_s
    if budget is not None:
        left = max(1.0, budget - elapsed_s - cfg.up.final_reserve_s)
        own = cfg.trainer.time_limit_s
        cfg.trainer.time_limit_s = left if own is None else min(own, left)
        print(f"worldloop up: {elapsed_s:.0f}s of up.time_limit_s={budget:.0f} spent making the model; "
              f"the learner stops within {cfg.trainer.time_limit_s:.0f}s (trainer.total_steps="
              f"{cfg.trainer.total_steps} or fewer)", flush=True)
    return cfg.trainer.time_limit_s


def child_threads(n_children: int, cores: int | None = None) -> int:
    """Threads per child process so that the children together use about every core once."""
    return max(1, (usable_cores() if cores is None else cores) // max(1, n_children))


def _final_version(run_dir: Path) -> int | None:
    rec = _last_jsonl(run_dir / "learner_ledger.jsonl")
    return None if rec is None else int(rec["policy_version"])


def _wait_final_eval(evaluator: Child, run_dir: Path, stop: dict, limit_s: float = FINAL_EVAL_WAIT_S) -> None:
    """After the last step: let the evaluator play the final version before the run is stopped
    (the learner set run_state stopped, which makes the evaluator evaluate it and exit)."""
    final = _final_version(run_dir)
    print(f"worldloop up: held-out evaluation of the final version v{final} ...", flush=True)
    deadline = time.monotonic() + limit_s
    while not stop["flag"] and time.monotonic() < deadline and evaluator.poll() is None:
        time.sleep(0.5)
    last = (_last_jsonl(run_dir / "eval.jsonl") or {}).get("eval")
    if last is not None and last["policy_version"] == final:
        lo, hi = last["ci95"]["all"]
        cut = last.get("cut")
        print(f"worldloop up: held-out success at v{final}: {last['success_rate']['all']:.3f} "
              f"[{lo:.3f}, {hi:.3f}] over {last['episodes']['all']} episodes"
              + (f" (cut from {cut['planned']} at the run's time budget)" if cut else ""), flush=True)
    else:
        print(f"worldloop up: the final held-out evaluation did not finish; see {evaluator.log_path}", flush=True)


def _stop_children(children: list[Child], grace_s: float = 20.0) -> None:
    for c in reversed(children):
        c.stop(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for c in children:
        if c.proc is None:
            continue
        try:
            c.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.stop(signal.SIGKILL)
            c.proc.wait()
        c.close()
