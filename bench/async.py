"""Asynchrony against the synchronous loop: the same run at max_staleness 0 (synchronous on-policy
PPO: one batch per version, the actors wait for the next weights), 1, 2 and 4.

    python bench/async.py [--config tiny-frozenlake] [--staleness 0,1,2,4] [--steps 12] [--seeds 1]
                          [--out runs/bench-async] [key.sub=value ...]

Each setting runs ``worldloop up`` as a user would (same preset, same overrides, a fresh copy of
one warm-started model, rollout admission on: ``actor.admission``), with the evaluator playing the
held-out seeds every ``--eval-every`` versions. From the run directory it reads:

* trained trajectories per second: trajectories trained over the wall time from the learner's
  first to its last step (``metrics.jsonl`` times; the first step's wait, which includes start-up
  of the actors, is left out of both);
* learner idle fraction: the learner's time waiting for a batch (``step_seconds.wait``) over that
  wall time;
* actor idle fraction: ``worldloop_actor_idle_seconds`` (no admitted episode running) over each
  actor's lifetime, from the last scrape of every actor (``process_metrics.json``), averaged;
* mean and max staleness of trained turns, dropped (stale/duplicate) and dead-lettered counts;
* held-out success against wall-clock time (the evaluator's ``eval.jsonl``).

It prints a table with each setting's throughput as a ratio to the synchronous one measured in
the same invocation, writes ``async.md``/``async.json`` and plots ``async.png`` (throughput and
off-policyness against the bound; held-out success against wall-clock time). Resume: a setting
whose run finished (``up.done``) is not run again. Nothing here is a pass/fail check.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/_records.py, also when loaded by path
from _records import jsonl_records  # noqa: E402


def _run_up(args: list[str], log: Path) -> float:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    with open(log, "wb") as f:
        rc = subprocess.run([sys.executable, "-m", "worldloop", "up", *args], cwd=ROOT, env=env, stdout=f,
                            stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RuntimeError(f"worldloop up exited {rc}; see {log}\n{log.read_text(errors='replace')[-3000:]}")
    return time.monotonic() - t0


def summarize(run_dir: Path, wall_s: float) -> dict:
    """The row of one run, from its run directory."""
    lines = jsonl_records(run_dir / "metrics.jsonl")
    steps = [x for x in lines if "step" in x]
    if len(steps) < 2:
        raise RuntimeError(f"{run_dir}: fewer than 2 learner steps recorded")
    first, last = steps[0], steps[-1]
    # from the end of step 1 to the end of the last step: start-up (model load, actors' first
    # episodes) is left out of both numerator and denominator
    span = last["time"] - first["time"]
    trained = sum(x["trajectories"] for x in steps[1:])
    waits = sum(x["step_seconds"]["wait"] for x in steps[1:])
    procs = json.loads((run_dir / "process_metrics.json").read_text()) if (run_dir / "process_metrics.json").exists() else {}
    idle = []
    for key, p in procs.items():
        if key.startswith("actor:") and p.get("started_at"):
            life = p["time"] - float(p["started_at"])
            if life > 0:
                idle.append(p["metrics"].get("worldloop_actor_idle_seconds_total", 0.0) / life)
    evals = [x["eval"] for x in jsonl_records(run_dir / "eval.jsonl")]
    t_start = first["time"] - first["step_seconds"]["wait"] - first["step_seconds"]["forward"] - first["step_seconds"]["backward"]
    return {
        "steps": last["step"], "trained": trained, "span_s": span, "up_wall_s": wall_s,
        "trained_per_s": trained / span if span > 0 else None,
        "learner_idle": waits / span if span > 0 else None,
        "actor_idle": sum(idle) / len(idle) if idle else None,
        "staleness_mean": sum(x["staleness_mean"] for x in steps) / len(steps),
        "staleness_max": max(x["staleness_max"] for x in steps),
        "dropped": sum(last.get("dropped", {}).values()) if isinstance(last.get("dropped"), dict) else last.get("dropped"),
        "dead_lettered": sum(last.get("dead_lettered", {}).values()),
        "held_out": [{"t": e["time"] - t_start, "version": e["policy_version"], "success": e["success_rate"]["all"],
                      "ci95": e["ci95"]["all"]} for e in evals],
    }


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(rows: dict[int, dict]) -> str:
    base = rows.get(0, {}).get("trained_per_s")
    out = ["| max_staleness | trained traj/s | vs sync | learner idle | actor idle | staleness mean / max | "
           "dropped | dead-lettered | final held-out success (95% CI) | span s |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for s, r in sorted(rows.items()):
        ratio = r["trained_per_s"] / base if base and r["trained_per_s"] else None
        ho = r["held_out"][-1] if r["held_out"] else None
        ho_s = "-" if ho is None else f"{ho['success']:.3f} [{ho['ci95'][0]:.3f}, {ho['ci95'][1]:.3f}] @v{ho['version']}"
        out.append(f"| {s} | {_fmt(r['trained_per_s'], '.3f')} | {_fmt(ratio, '.2f')}x | {_fmt(r['learner_idle'], '.2f')} | "
                   f"{_fmt(r['actor_idle'], '.2f')} | {r['staleness_mean']:.2f} / {r['staleness_max']} | {r['dropped']} | "
                   f"{r['dead_lettered']} | {ho_s} | {r['span_s']:.0f} |")
    return "\n".join(out)


def plot(rows: dict[int, dict], out_png: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("async.png not drawn: matplotlib is not installed")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ss = sorted(rows)
    axes[0].plot(ss, [rows[s]["trained_per_s"] for s in ss], "o-", label="trained trajectories/s")
    axes[0].set_xlabel("max_staleness")
    axes[0].set_ylabel("trajectories/s")
    ax2 = axes[0].twinx()
    ax2.plot(ss, [rows[s]["staleness_mean"] for s in ss], "s--", color="C1", label="mean staleness (versions)")
    ax2.set_ylabel("mean staleness")
    axes[0].set_title("throughput vs off-policyness")
    axes[0].legend(loc="upper left", fontsize=8)
    ax2.legend(loc="lower right", fontsize=8)
    for s in ss:
        h = rows[s]["held_out"]
        if h:
            axes[1].errorbar([x["t"] for x in h], [x["success"] for x in h],
                             yerr=[[x["success"] - x["ci95"][0] for x in h], [x["ci95"][1] - x["success"] for x in h]],
                             fmt="o-", capsize=2, label=f"max_staleness {s}")
    axes[1].set_xlabel("wall-clock seconds since the run started")
    axes[1].set_ylabel("held-out success")
    axes[1].set_ylim(-0.02, 1.02)
    axes[1].set_title("held-out success against wall-clock time")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny-frozenlake", help="preset name or YAML path")
    ap.add_argument("--staleness", default="0,1,2,4")
    ap.add_argument("--steps", type=int, default=12, help="learner steps per run")
    ap.add_argument("--eval-every", type=int, default=4)
    ap.add_argument("--eval-episodes", type=int, default=32)
    ap.add_argument("--out", default="runs/bench-async")
    ap.add_argument("overrides", nargs="*", help="key.sub=value for every run")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = out / "model"
    rows: dict[int, dict] = {}
    for s in [int(x) for x in args.staleness.split(",") if x.strip()]:
        run_dir = out / f"staleness-{s}"
        done = run_dir / "up.done"
        if not done.exists():
            if run_dir.exists():
                shutil.rmtree(run_dir)
            run_dir.mkdir(parents=True)
            # one warm-started model for every setting: the first run makes it, the others copy it
            model_path = run_dir / "model"
            if model.exists():
                shutil.copytree(model, model_path)
            print(f"[async] max_staleness {s}: worldloop up {args.config} ({args.steps} steps) ...", flush=True)
            wall = _run_up([args.config, f"run.run_dir={run_dir}", f"model.path={model_path}",
                            f"trainer.max_staleness={s}", f"trainer.total_steps={args.steps}",
                            f"trainer.eval_every={args.eval_every}", f"trainer.eval_episodes={args.eval_episodes}",
                            "actor.admission=true", *args.overrides], run_dir / "up.log")
            if not model.exists():
                shutil.copytree(model_path, model)
            done.write_text(json.dumps({"wall_s": wall}))
        row = summarize(run_dir, json.loads(done.read_text())["wall_s"])
        rows[s] = row
        print(f"[async] max_staleness {s}: {row['trained_per_s']:.3f} trained traj/s, learner idle "
              f"{_fmt(row['learner_idle'], '.2f')}, actor idle {_fmt(row['actor_idle'], '.2f')}, "
              f"staleness {row['staleness_mean']:.2f}/{row['staleness_max']}, dropped {row['dropped']}", flush=True)
    text = table(rows)
    print(text)
    (out / "async.md").write_text(text + "\n")
    (out / "async.json").write_text(json.dumps(rows, indent=1))
    plot(rows, out / "async.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
