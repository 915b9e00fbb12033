"""Does RL improve on the SFT warm start? The tiny run of `worldloop up`, evaluated before and after.

    python bench/learning.py [--envs frozenlake,sokoban] [--episodes 2048] [--sampling keyed|batch] [--steps N]
                             [--seed-start S] [--eval-backend hf|vllm]
                             [--out runs/bench-learning] [key.sub=value ...]

For each env this runs, as a user would, ``worldloop up configs/tiny-<env>.yaml`` with a fresh
model directory (the embedded tiny model is made, warm-started by SFT on solver demonstrations,
then trained by the preset's learner steps, or ``--steps``, with 2 actors and 1 judge), and then
``worldloop eval`` twice on the same held-out seeds (``--seed-start``, default ``eval.seed_start``,
onwards): the SFT model (``model.path``, which the learner never writes) is the baseline, the
newest learner checkpoint the result. The held-out range is checked, before anything runs, to be
disjoint from every seed the run trains on (``worldloop.common.contracts.config.training_seed_ranges``: the RL
seeds ``[actor.seed_start, actor.seed_end)``, the demonstration seeds and the grounding pre-training
levels). Temperature, max tokens and max
turns are the actor's; top-p is eval's default 1.0 (as the presets' actors sample), the same for
both models. Extra ``key.sub=value`` arguments go to ``worldloop up`` and ``worldloop eval`` alike
(for tuning runs; report runs use the presets as shipped). Tune with a ``--seed-start`` other than
the default and report on the default held-out seeds once.

Resume: rerun with the same ``--out``: a finished ``up`` (its ``up.done`` marker) is not rerun, the
evaluations resume from their ``episodes.jsonl``, and a finished env's row (``row-<sampling>.json``) is
reused. The same ``--out`` with the other ``--sampling`` evaluates the same two models again
(``eval-<model>`` folders for batch, ``eval-<model>-keyed`` for keyed).
Progress goes to stdout.

The table gives both success rates with Wilson 95% intervals, the difference, the paired outcome
(seeds only RL solved / only SFT solved: a sign test on those is the fair test of a difference
on shared seeds) and the wall time. Everything is written to ``--out`` (runs, logs, episodes,
``learning.md``). Nothing here is a pass/fail check: it reports what happened.

Why 2,048 held-out seeds: each seed is one sampled episode, and on Sokoban RL's gain measured on
tuning seeds was 4-5 points with ~22 % of seeds discordant (2,048 tuning seeds: 271 only RL / 174
only SFT, and 287 / 200 for another run). At those rates the sign test reaches p < 0.01 with
probability 0.36 / 0.24 on 512 seeds and 0.98 / 0.91 on 2,048
(``worldloop.eval.stats.sign_test_power``), so 512 seeds, the default until 2026-11-26, could not
resolve the effect it was meant to test. The size was chosen from those tuning-seed rates before the
report seeds were played again.

Sampling (``--sampling``, default ``keyed``): both evaluations use keyed sampling (``worldloop eval``,
docs/operations.md "Evaluation"), so the two models share their noise seed by seed; each model's
success rate is estimated as before, and the seeds only one of them solved come from their
difference rather than from sampling luck. ``batch`` is the per-call seeding every report before
2026-11-26 used.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from worldloop.eval.compare import outcomes, paired  # noqa: E402
from worldloop.common.contracts.config import ConfigError, check_held_out_seeds, load_config  # noqa: E402


def _cli(args: list[str], log: Path) -> float:
    """Run ``worldloop <args>``, output to ``log``; return its wall time; raise on failure."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    start = time.monotonic()
    with open(log, "wb") as f:
        rc = subprocess.run([sys.executable, "-m", "worldloop", *args], cwd=ROOT, env=env, stdout=f,
                            stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"worldloop {args[0]} exited {rc}; see {log}\n{tail}")
    return time.monotonic() - start


def bench_env(env: str, steps: int | None, episodes: int, seed_start: int | None, out: Path,
              overrides: list[str], sampling: str = "keyed", eval_backend: str | None = None) -> dict:
    config = ROOT / "configs" / f"tiny-{env}.yaml"
    cfg = load_config(config, overrides)
    seed_start = cfg.eval.seed_start if seed_start is None else seed_start
    try:  # the evaluated seeds must miss every seed the run trains on (RL, demonstrations, grounding)
        check_held_out_seeds(cfg, seed_start, episodes, key="--seed-start")
    except ConfigError as e:
        raise SystemExit(str(e)) from None
    base = out / env
    row_file = base / f"row-{sampling}.json"
    if row_file.exists():
        print(f"== {env}: done before, reusing {row_file}", flush=True)
        return json.loads(row_file.read_text())
    run_dir = base / "run"
    base.mkdir(parents=True, exist_ok=True)
    # the run's own periodic evaluator plays the bench's range too: a tuning run (--seed-start on
    # another range) must not show its curve on the report seeds
    ups = [f"eval.seed_start={seed_start}", *overrides] + ([f"trainer.total_steps={steps}"] if steps else [])
    if (base / "up.done").exists():
        up_s = float((base / "up.done").read_text())
        print(f"== {env}: worldloop up finished before ({up_s:.0f} s), reusing {run_dir}", flush=True)
    else:
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)  # an interrupted up: start it again from scratch
        print(f"== {env}: worldloop up ({steps or cfg.trainer.total_steps} learner steps) -> {run_dir}", flush=True)
        up_s = _cli(["up", str(config), f"run.run_dir={run_dir}", *ups], base / "up.log")
        (base / "up.done").write_text(f"{up_s:.1f}")
        print(f"== {env}: worldloop up took {up_s:.0f} s", flush=True)
    sft = json.loads((run_dir / "sft.json").read_text())
    # the learner's step records (metrics.jsonl also holds the evaluator's {"eval": ...} lines)
    curve = [rec for rec in (json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip())
             if "step" in rec]
    common = ["--config", str(config), "--episodes", str(episodes), "--max-tokens", str(cfg.actor.max_new_tokens),
              "--max-turns", str(cfg.actor.max_turns), "--temperature", str(cfg.actor.temperature), "--concurrency", "32",
              f"eval.seed_start={seed_start}", f"eval.sampling={sampling}", *overrides]
    if eval_backend:  # e.g. hf for a run whose actors generated on servers: eval plays locally
        common += ["--backend", eval_backend]
    results = {}
    # the warm start the run started from: shipped, cached or made by up (model.json says which)
    model_dir = json.loads((run_dir / "model.json").read_text())["path"]
    for name, model in (("sft", model_dir), ("rl", run_dir)):
        # batch-mode folders keep the names they had before keyed sampling existed (resumable)
        eval_dir = base / (f"eval-{name}" if sampling == "batch" else f"eval-{name}-{sampling}")
        print(f"== {env}: worldloop eval {name}, {sampling} sampling (held-out seeds {seed_start}.."
              f"{seed_start + episodes - 1}) -> {eval_dir}", flush=True)
        t0 = time.monotonic()
        _cli(["eval", "--model", str(model), "--output", str(eval_dir), *common], eval_dir.with_suffix(".log"))
        results[name] = outcomes(eval_dir)
        k = sum(results[name].values())
        print(f"== {env}: {name} solved {k}/{len(results[name])} ({time.monotonic() - t0:.0f} s)", flush=True)
    pair = paired(results["sft"], results["rl"])
    row = {"env": env, "steps": curve[-1]["step"] if curve else 0, "episodes": pair.n, "up_seconds": up_s,
           "seed_start": seed_start, "sampling": sampling, "overrides": overrides,
           "sft_format_ok": sft.get("format_ok_after"), "rl_wins": pair.wins, "rl_losses": pair.losses,
           "sign_test_p": pair.p,
           "train_success_first": curve[0]["success_rate"]["all"] if curve else None,
           "train_success_last": curve[-1]["success_rate"]["all"] if curve else None}
    for name, which in (("sft", "base"), ("rl", "new")):
        lo, hi = pair.interval(which)
        row[name] = {"rate": pair.rate(which), "lo": lo, "hi": hi}
    row_file.write_text(json.dumps(row, indent=2))
    print(render([row]), flush=True)
    return row


def _p_text(p: float) -> str:
    """A p-value for the table: 3 decimals, or 1 significant digit below 0.001 (not "0.000")."""
    return f"{p:.3f}" if p >= 0.001 else f"{p:.0e}"


def render(rows: list[dict]) -> str:
    head = ("| env | RL steps | held-out episodes | sampling | SFT success (95% CI) | SFT+RL success (95% CI) | difference | "
            "seeds only RL / only SFT solved | sign test p | train-batch success first -> last step | up wall s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        s, q = r["sft"], r["rl"]
        lines.append(
            f"| {r['env']} | {r['steps']} | {r['episodes']} | {r.get('sampling', 'batch')} | {s['rate']:.3f} [{s['lo']:.3f}, {s['hi']:.3f}] | "
            f"{q['rate']:.3f} [{q['lo']:.3f}, {q['hi']:.3f}] | {q['rate'] - s['rate']:+.3f} | "
            f"{r['rl_wins']} / {r['rl_losses']} | {_p_text(r['sign_test_p'])} | "
            f"{r['train_success_first']:.3f} -> {r['train_success_last']:.3f} | {r['up_seconds']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--envs", default="frozenlake,sokoban", help="configs/tiny-<env>.yaml presets")
    ap.add_argument("--steps", type=int, default=None, help="learner steps of the RL run (default: the preset's)")
    ap.add_argument("--episodes", type=int, default=2048,
                    help="held-out episodes per model (at least 128; 2048 resolves a 4-point gain, see the docstring)")
    ap.add_argument("--sampling", choices=["keyed", "batch"], default="keyed",
                    help="eval.sampling of both evaluations (keyed: common random numbers, see worldloop eval)")
    ap.add_argument("--seed-start", type=int, default=None,
                    help="first held-out seed (default eval.seed_start; tune on another range)")
    ap.add_argument("--out", default=f"runs/bench-learning-{time.strftime('%Y%m%d-%H%M%S')}",
                    help="output folder; rerun with the same folder to resume")
    ap.add_argument("--eval-backend", choices=["hf", "vllm"], default=None,
                    help="the evaluations' local backend (default: the config's actor.backend; hf to compare a "
                         "run whose actors used servers with the others, which evaluate on hf)")
    ap.add_argument("overrides", nargs="*", help="key.sub=value config overrides for up and eval (tuning only)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [bench_env(env, args.steps, args.episodes, args.seed_start, out, args.overrides, args.sampling,
                      args.eval_backend)
            for env in args.envs.split(",")]
    table = render(rows)
    print(table)
    (out / "learning.md").write_text(table + "\n")
    (out / "learning.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
