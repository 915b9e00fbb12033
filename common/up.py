"""``worldloop up``: a whole training run on one machine, for a newcomer.

Steps, each logged:

1. run directory ``run.run_dir`` (default ``runs/<config>-<YYYYmmdd-HHMMSS>``) with ``logs/``;
2. Redis: ``redis.url`` when given, else a private ``redis-server`` (system or bundled) whose data
   lives in the run directory;
3. model: when ``model.path`` does not exist and ``model.make_tiny_if_missing``, the embedded tiny
   Qwen2.5-VL model is made on the spot and, with ``sft.enabled``, warm-started by SFT on solver
   demonstrations (observation/prediction fields included);
4. children: the learner, ``up.num_actors`` actors and ``up.num_judges`` judges (none when
   ``judge.enabled`` is false), each ``python -m common.cli <role>`` with the resolved config written
   to ``<run_dir>/config.yaml``, output in ``<run_dir>/logs/<name>.log``; a crashed actor or judge is
   restarted (at most ``MAX_RESTARTS`` times), a crashed learner ends the run with its exit code;
5. a live progress line (step, episodes/s, success rate, reward, staleness) built from the learner's
   ``metrics.jsonl`` and from scraping every child's ``/metrics`` (the URLs come from the process
   heartbeats in Redis);
6. the end: after ``trainer.total_steps`` (the learner exits 0) or on Ctrl-C/SIGTERM the control
   record says ``stopped``, children get SIGTERM (then SIGKILL), ``training.png`` is drawn from
   ``metrics.jsonl`` and ``scrapes.json`` records which processes were scraped.
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

import yaml

from common.config import Config, to_dict
from common.control import Keys, list_processes, read_control, write_control

log = logging.getLogger("worldloop.up")

MAX_RESTARTS = 5
RATE_WINDOW_S = 30.0  # episodes/s on the progress line: over this window
QUIET_PRINT_S = 30.0  # without a terminal, an unchanged progress line is repeated this rarely


@dataclass
class Child:
    name: str
    role: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None
    restarts: int = 0
    log_file: object | None = None

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
    scraped: dict[str, int] = field(default_factory=dict)
    # (monotonic time, episodes) samples of the last RATE_WINDOW_S: episodes arrive in bursts
    _samples: deque = field(default_factory=deque)

    def line(self, total_steps: int) -> str:
        def fmt(x, spec):
            return "-" if x is None else format(x, spec)

        return (
            f"step {self.step}/{total_steps} | episodes {self.episodes:.0f} ({self.episodes_per_s:.2f}/s) | "
            f"success {fmt(self.success_rate, '.2f')} | reward {fmt(self.reward, '.3f')} | "
            f"staleness {fmt(self.staleness, '.2f')}"
        )


def default_run_dir(cfg: Config) -> Path:
    stem = Path(cfg.source).stem if cfg.source else cfg.run.name
    return Path("runs") / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def _prepare_model(cfg: Config, run_dir: Path) -> None:
    path = Path(cfg.model.path)
    if (path / "config.json").exists():
        log.info("model: %s", path)
        return
    if not cfg.model.make_tiny_if_missing:
        raise FileNotFoundError(f"model.path {str(path)!r} has no config.json and model.make_tiny_if_missing is false")
    from common.tiny_model import make_tiny_model

    log.info("model: making the embedded tiny model in %s", path)
    make_tiny_model(path, seed=cfg.run.seed)
    if cfg.sft.enabled:
        from learner.sft import warm_start

        log.info("model: SFT warm start on %d solver demonstrations", cfg.sft.episodes)
        report = warm_start(cfg, path)
        (run_dir / "sft.json").write_text(json.dumps(report, indent=2))
        log.info("model: SFT done: %s", report)


def _children(cfg: Config, config_path: Path, run_dir: Path) -> list[Child]:
    py = sys.executable
    base = [py, "-m", "common.cli"]
    logs = run_dir / "logs"
    out = [Child("learner", "learner", base + ["learner", "--config", str(config_path)], logs / "learner.log")]
    for i in range(cfg.up.num_actors):
        name = f"actor-{i}"
        out.append(Child(name, "actor", base + ["actor", "--config", str(config_path), f"actor.actor_id={name}"],
                         logs / f"{name}.log"))
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


def _refresh(progress: Progress, r, keys: Keys, run_dir: Path) -> None:
    rec = _last_jsonl(run_dir / "metrics.jsonl")
    if rec:
        progress.step = int(rec.get("step", progress.step))
        progress.reward = rec.get("reward", {}).get("total") if isinstance(rec.get("reward"), dict) else rec.get("reward")
        sr = rec.get("success_rate")
        progress.success_rate = sr.get("all") if isinstance(sr, dict) else sr
        progress.staleness = rec.get("staleness_mean", rec.get("staleness"))
    episodes = 0.0
    for p in list_processes(r, keys):
        url = p.get("metrics_url")
        if not url or time.time() - float(p.get("seen_at", 0)) > 30:
            continue
        try:
            sums = _scrape(url)
        except OSError:
            continue
        key = f"{p.get('role')}:{p.get('id')}"
        progress.scraped[key] = progress.scraped.get(key, 0) + 1
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


def plot_metrics(metrics_path: Path, out_png: Path) -> bool:
    """Draw success rate and reward over steps from metrics.jsonl; False when there is nothing to draw."""
    rows = []
    if metrics_path.exists():
        for line in metrics_path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r.get("step", i) for i, r in enumerate(rows)]

    def series(key: str, sub: str) -> list[float]:
        vals = []
        for r in rows:
            v = r.get(key)
            v = v.get(sub) if isinstance(v, dict) else v
            vals.append(float("nan") if v is None else float(v))
        return vals

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].plot(steps, series("success_rate", "all"), marker="o")
    axes[0].set_title("success rate (training batches)")
    axes[0].set_xlabel("learner step")
    axes[0].set_ylim(-0.02, 1.02)
    for comp in ("total", "env", "format", "reasoning"):
        axes[1].plot(steps, series("reward", comp), marker=".", label=comp)
    axes[1].set_title("mean trajectory reward by component")
    axes[1].set_xlabel("learner step")
    axes[1].legend()
    if not rows:
        for ax in axes:
            ax.text(0.5, 0.5, "no learner steps recorded", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return bool(rows)


def run(cfg: Config, args) -> int:
    import redis

    from common.redis_local import LocalRedis

    run_dir = Path(cfg.run.run_dir) if cfg.run.run_dir else default_run_dir(cfg)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    cfg.run.run_dir = str(run_dir)
    print(f"worldloop up: run directory {run_dir}", flush=True)

    local_redis = None
    if cfg.redis.url is None:
        local_redis = LocalRedis(data_dir=str(run_dir / "redis")).start()
        cfg.redis.url = local_redis.url
        print(f"worldloop up: started a local redis-server at {cfg.redis.url}", flush=True)
    # ports left at 0 are chosen here, so several local runs can share a machine
    from common.metrics import free_port

    if cfg.weights.pub_port == 0:
        cfg.weights.pub_port = free_port()
    if cfg.weights.fetch_port == 0:
        cfg.weights.fetch_port = free_port()
    children: list[Child] = []
    stop = {"flag": False}

    def on_signal(signum, _frame):
        stop["flag"] = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    r = redis.Redis.from_url(cfg.redis.url)
    keys = Keys(cfg.redis.namespace)
    progress = Progress()
    rc = 0
    try:
        _prepare_model(cfg, run_dir)
        config_path = run_dir / "config.yaml"
        config_path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        write_control(r, keys, run_state="running")
        env = dict(os.environ)
        env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.cwd() / ".torch_extensions"))
        env["PYTHONUNBUFFERED"] = "1"
        children = _children(cfg, config_path, run_dir)
        for c in children:
            c.start(env)
        rc = _supervise(cfg, children, env, r, keys, run_dir, progress, stop)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        try:
            write_control(r, keys, run_state="stopped")
        except redis.RedisError:
            pass
        _stop_children(children)
        (run_dir / "scrapes.json").write_text(json.dumps(progress.scraped, indent=2))
        drew = plot_metrics(run_dir / "metrics.jsonl", run_dir / "training.png")
        print(f"\nworldloop up: {'plot' if drew else 'empty plot'} in {run_dir / 'training.png'}", flush=True)
        if local_redis is not None:
            local_redis.close()
    return rc


def _supervise(cfg, children, env, r, keys, run_dir, progress, stop) -> int:
    tty = sys.stdout.isatty()
    last_print = last_shown = 0.0
    shown = ""
    learner = children[0]
    while not stop["flag"]:
        time.sleep(0.5)
        code = learner.poll()
        if code is not None:
            _refresh(progress, r, keys, run_dir)
            print(("\r" if tty else "") + progress.line(cfg.trainer.total_steps), flush=True)
            if code == 0:
                print("worldloop up: learner finished trainer.total_steps", flush=True)
            else:
                print(f"worldloop up: learner exited with {code}; see {learner.log_path}", flush=True)
            return code
        for c in children[1:]:
            code = c.poll()
            if code is not None and not stop["flag"]:
                c.close()
                if c.restarts >= MAX_RESTARTS:
                    print(f"\nworldloop up: {c.name} exited with {code} {c.restarts} times; giving up", flush=True)
                    return 1
                c.restarts += 1
                print(f"\nworldloop up: {c.name} exited with {code}; restarting ({c.restarts}/{MAX_RESTARTS})", flush=True)
                c.start(env)
        if time.monotonic() - last_print >= cfg.up.progress_interval_s:
            last_print = time.monotonic()
            try:
                _refresh(progress, r, keys, run_dir)
            except Exception as e:  # progress display must never end the run
                log.debug("progress refresh failed: %s", e)
            line = progress.line(cfg.trainer.total_steps)
            if tty:
                print("\r" + line, end="", flush=True)
            elif line.split(" | ")[0] != shown.split(" | ")[0] or last_print - last_shown >= QUIET_PRINT_S:
                # a log file gets a line per learner step, and otherwise one every QUIET_PRINT_S
                print(line, flush=True)
                shown, last_shown = line, last_print
    print("\nworldloop up: stopping", flush=True)
    return 130


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
