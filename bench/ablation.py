"""The VAGEN paper's comparisons in miniature, on the embedded tiny model.

    python bench/ablation.py [--suite methods|strategies|all] [--envs sokoban,frozenlake]
                             [--seeds 3] [--steps N] [--eval-episodes 64] [--warm-start build|shipped]
                             [--arms A,B] [--paired BASE,NEW [--paired-episodes 1024]]
                             [--out runs/bench-ablation] [key.sub=value ...]

Two suites, every arm on the same compute budget (the preset's batch, the same ``--steps`` learner
updates) and ``--seeds`` run seeds (``run.seed``: the tiny model's initialisation, the SFT data
order and all sampling):

* ``methods`` — VAGEN Table 4 with the paper's RL baselines of Table 2, every arm with the
  Grounding-WorldModeling prompt:
  VAGEN-Full (``bilevel_gae`` + the judge's reasoning reward), VAGEN-Base (token GAE with masking,
  ``masked_gae``, no reasoning reward), Turn-PPO w/ mask (``turn_ppo``), GRPO w/ mask (``grpo``,
  groups of ``actor.n_samples_per_seed``) and Vanilla-PPO (``vanilla_ppo``: no observation
  masking), the last three without reasoning reward, as in the paper; and worldloop's own recipe
  (``gigpo`` with per-turn step groups, the judge's reasoning reward, and ``<observation>`` tokens
  paid for their grounding score: ``trainer.observation_advantage: grounding``). Every paper arm
  has ``observation_advantage: task`` (its tokens all share the estimator's advantage).
* ``strategies`` — the five reasoning strategies of the paper's Table 2 (No-Think, Free-Think,
  Grounding, WorldModeling, Grounding-WorldModeling), each trained the way the paper trains them:
  VAGEN-Base (``masked_gae``, format and task rewards, no reasoning reward). The SFT warm start
  uses demonstrations in the arm's own format.

``--warm-start shipped`` starts every arm and run seed from the preset's shipped warm start
(``worldloop/warmstarts/tiny-<env>``, the Grounding-WorldModeling model ``worldloop up`` starts from;
the methods suite only): the run seeds then differ in RL's sampling and not in the model. The
default ``build`` makes the models as below.

Each (arm, env, seed) is one ``worldloop up`` of the env's preset (``tiny-<env>``) with the arm's
overrides and the evaluator on (``trainer.eval_every = --steps``): held-out success of the warm
start (v0) and of the final policy on the same ``--eval-episodes`` held-out seeds. The models are
prepared by the bench, as ``worldloop up`` would prepare them, in two cached stages: the tiny model
is made and grounding pre-trained once per (env, seed), in the Grounding-WorldModeling first turn
(the suite's one "pre-trained base", as the paper trains every strategy from one base model), then
warm-started by SFT once per (env, seed, prompt format) in that format. So the arms of a suite
start from the same model, and the strategies from the same grounded base. The table follows the
paper's layout (rows = arms, columns = envs and overall); each cell is the mean over run seeds
with its 95% t-interval and, beside it, the warm start's mean. Every row names the judge's scoring
mode (``judge.rule_mode``) and the estimator.

``--arms`` runs only the named arms of the chosen suite. ``--paired BASE,NEW`` adds the paired test
of two of them: after the runs, each arm's final policy of each (env, run seed) plays
``--paired-episodes`` held-out seeds with ``worldloop eval`` (keyed sampling, the run's own config:
``eval.seed_start`` on, checked disjoint from its training seeds), and the two arms' outcomes are
paired by (env, run seed, held-out seed): seeds only NEW solved against seeds only BASE solved, the
two-sided sign test (``worldloop.eval.compare``), per run seed and pooled. The pooled test holds the
trained policies fixed: it asks whether these policies differ, while the spread between run seeds
(the t-intervals of the table) is what says how much a method's result varies from run to run.
With ``--warm-start shipped`` the shipped warm start plays the same seeds once per env (into
``<out>/warm-start-<env>-eval-paired``), and a second table pairs each of the two arms' final
policies with it: whether the method moved the model it began from at all.

Resume: every finished run leaves ``done.json`` in its folder and is not run again; progress goes
to stdout, and ``ablation-<suite>.md`` (and ``.json``) is rewritten after every run with the runs
finished so far. Nothing here is a pass/fail check: it reports what happened, whichever way it goes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent

from worldloop.common.contracts.config import load_config, to_dict  # noqa: E402
from worldloop.common.contracts.algorithms import estimator_spec  # noqa: E402
from worldloop.eval.stats import mean_interval  # noqa: E402

GWM = "grounding_worldmodeling"
METHODS = {  # arm -> (estimator, reasoning reward from the judge, prompt format[, observation advantage])
    "VAGEN-Full": ("bilevel_gae", True, GWM),
    "VAGEN-Base": ("masked_gae", False, GWM),
    "Turn-PPO w/ mask": ("turn_ppo", False, GWM),
    "GRPO w/ mask": ("grpo", False, GWM),
    "Vanilla-PPO": ("vanilla_ppo", False, GWM),
    "GiGPO + grounded observation (worldloop)": ("gigpo", True, GWM, "grounding"),
}
STRATEGIES = {
    "No-Think": ("masked_gae", False, "no_think"),
    "Free-Think": ("masked_gae", False, "free_think"),
    "Grounding": ("masked_gae", False, "grounding"),
    "WorldModeling": ("masked_gae", False, "worldmodeling"),
    "Grounding-WorldModeling": ("masked_gae", False, GWM),
}
ENV_TITLES = {"frozenlake": "FrozenLake", "sokoban": "Sokoban"}


def arm_config(env: str, arm: tuple[str, bool, str], seed: int, steps: int, eval_episodes: int, run_dir: Path,
               model: Path, overrides: list[str]) -> dict:
    """The resolved config of one run: the env's preset with the arm's settings."""
    estimator, reasoning, prompt_format = arm[:3]
    cfg = to_dict(load_config(f"tiny-{env}", overrides))
    for e in cfg["actor"]["envs"]:
        e["kwargs"] = dict(e.get("kwargs") or {}, prompt_format=prompt_format)
    cfg["run"].update(name=f"ablation-{env}", seed=seed, run_dir=str(run_dir))
    cfg["model"]["path"] = str(model)
    cfg["redis"]["url"] = None
    cfg["redis"]["namespace"] = f"ablation-{run_dir.name}"
    cfg["judge"]["enabled"] = bool(reasoning)
    # the critic is the baseline of every estimator but the group ones (which normalise within a group)
    cfg["trainer"].update(estimator=estimator, total_steps=steps, eval_every=steps, eval_episodes=eval_episodes,
                          resume=False, use_critic=estimator_spec(estimator).reads_values,
                          observation_advantage=arm[3] if len(arm) > 3 else "task")
    if estimator_spec(estimator).grouped and cfg["actor"]["n_samples_per_seed"] < 2:
        cfg["actor"]["n_samples_per_seed"] = 2  # a group of one has no baseline
    return cfg


def _stage(target: Path, build) -> None:
    """Build ``target`` in ``<target>.partial`` and move it there only when whole (a bench stopped
    half-way leaves no half-made model that a resumed bench would take as finished)."""
    if target.exists():
        return
    work = target.with_name(target.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    build(work)
    work.rename(target)


def prepare_model(cfg: dict, grounded: Path, warm: Path) -> None:
    """The arm's warm start in ``warm``: the tiny model made and grounding pre-trained once per (env,
    seed) in ``grounded`` (in the Grounding-WorldModeling first turn), then SFT in the arm's format."""
    from worldloop.bootstrap.pipeline import ground, make_tiny, warm_start
    from worldloop.common.contracts.config import config_from_dict

    arm = config_from_dict(cfg)
    base = config_from_dict(cfg)
    for e in base.actor.envs:
        e.kwargs["prompt_format"] = GWM

    # the stages are not named ``ground``: that name is the pipeline's step, which the stage calls
    def grounding_stage(work: Path) -> None:
        make_tiny(base, work)
        report = ground(base, work) if base.model.tiny_grounding_steps else {}
        (work / "grounding.json").write_text(json.dumps(report, indent=2))

    def sft_stage(work: Path) -> None:
        shutil.copytree(grounded, work)
        report = warm_start(arm, work) if arm.sft.enabled else {}
        (work / "sft.json").write_text(json.dumps(report, indent=2))

    _stage(grounded, grounding_stage)
    _stage(warm, sft_stage)


def shipped_warm_start(env: str, overrides: list[str]) -> Path:
    """The preset's shipped warm start (``worldloop model resolve tiny-<env>``); an error when the
    overrides change its recipe (then there is none shipped)."""
    from worldloop.bootstrap.store import resolve_model

    resolved = resolve_model(load_config(f"tiny-{env}", overrides), build=False)
    if resolved.source != "shipped":
        raise SystemExit(f"--warm-start shipped: the overrides change tiny-{env}'s recipe, so no shipped model has it")
    return resolved.path


def _worldloop(args: list[str], log: Path) -> None:
    """``python -m worldloop ARGS`` from the repository, its output to ``log``; raise if it fails."""
    with open(log, "wb") as f:
        rc = subprocess.run([sys.executable, "-m", "worldloop", *args], cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                            stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RuntimeError(f"worldloop {args[0]} exited {rc}; see {log}")


def run_one(cfg: dict, run_dir: Path, grounded: Path, warm: Path, shipped: Path | None = None) -> dict:
    """One ``worldloop up``; its warm start is ``shipped`` as is, or else prepared in ``grounded`` / ``warm``."""
    done = run_dir / "done.json"
    if done.exists():
        return json.loads(done.read_text())
    if shipped is None:
        prepare_model(cfg, grounded, warm)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    model = Path(cfg["model"]["path"])
    shutil.copytree(shipped or warm, model)
    for report in ("grounding.json", "sft.json"):
        if (model / report).exists():
            shutil.copy(model / report, run_dir / report)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    t0 = time.monotonic()
    _worldloop(["up", str(run_dir / "config.yaml")], run_dir / "up.log")
    evals = [json.loads(line)["eval"] for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    start = next(e for e in evals if e["policy_version"] == 0)
    final = evals[-1]
    row = {"start": start["success_rate"]["all"], "final": final["success_rate"]["all"],
           "final_version": final["policy_version"], "n": final["episodes"]["all"], "wall_s": time.monotonic() - t0,
           "rule_mode": cfg["judge"]["rule_mode"], "estimator": cfg["trainer"]["estimator"]}
    done.write_text(json.dumps(row))
    return row


def paired_eval(cfg: dict, run_dir: Path, episodes: int, model: Path | None = None, out: Path | None = None) -> dict:
    """The run's final policy (or ``model``) on ``episodes`` held-out seeds, keyed, with the run's
    eval settings (``worldloop eval`` into ``out``, default ``<run_dir>/eval-paired``, resumable):
    ``{(env name, seed): success}``."""
    from worldloop.common.contracts.config import check_held_out_seeds, config_from_dict
    from worldloop.eval.compare import outcomes

    check_held_out_seeds(config_from_dict(cfg), cfg["eval"]["seed_start"], episodes, key="--paired-episodes")
    out = out or run_dir / "eval-paired"
    a = cfg["actor"]
    args = ["eval", "--config", str(run_dir / "config.yaml"), "--model", str(model or run_dir), "--output", str(out),
            "--episodes", str(episodes), "--max-tokens", str(a["max_new_tokens"]), "--max-turns", str(a["max_turns"]),
            "--temperature", str(a["temperature"]), "--concurrency", "32", "eval.sampling=keyed"]
    _worldloop(args, out.with_name(out.name + ".log"))
    return outcomes(out)


def paired_report(base: str, new: str, per_seed: dict) -> str:
    """The paired rows: per (env, run seed) and pooled. ``per_seed``: {(env, seed): (base outcomes,
    new outcomes)}."""
    from worldloop.eval.compare import HEADER, paired

    lines = [f"### paired: {new} (new) against {base} (base), keyed, the same held-out seeds\n", HEADER]
    pooled_base: dict = {}
    pooled_new: dict = {}
    for (env, seed), (b, n) in sorted(per_seed.items()):
        lines.append(paired(b, n).row(f"{ENV_TITLES.get(env, env)}, run seed {seed}"))
        pooled_base.update({(env, seed, *k): v for k, v in b.items()})
        pooled_new.update({(env, seed, *k): v for k, v in n.items()})
    lines.append(paired(pooled_base, pooled_new).row("pooled"))
    return "\n".join(lines)


def start_report(starts: dict, finals: dict) -> str:
    """Each arm's final policies against the warm start they all began from (``--warm-start
    shipped``), per (env, run seed): ``starts`` {env: outcomes of the shipped warm start},
    ``finals`` {(arm, env, seed): outcomes of that run's final policy}."""
    from worldloop.eval.compare import HEADER, paired

    lines = ["### paired: each arm's final policy (new) against the shipped warm start (base), keyed, the same held-out seeds\n",
             HEADER]
    for (name, env, seed), got in finals.items():
        lines.append(paired(starts[env], got).row(f"{name}, {ENV_TITLES.get(env, env)}, run seed {seed}"))
    return "\n".join(lines)


def cell(values: list[float]) -> str:
    if not values:
        return "-"
    m, lo, hi = mean_interval(values)
    return f"{m:.2f} [{lo:.2f}, {hi:.2f}]"


def table(title: str, arms: dict, results: dict, envs: list[str]) -> str:
    head = "| " + title + " | " + " | ".join(ENV_TITLES.get(e, e) for e in envs) + " | Overall | warm start (overall) | estimator | judge | scoring mode |"
    lines = [head, "|" + "---|" * (len(envs) + 6)]
    for name, (estimator, reasoning, *_) in arms.items():
        per_env, overall, starts = [], [], []
        for e in envs:
            rows = results.get((name, e), [])
            per_env.append(cell([r["final"] for r in rows]))
        seeds = sorted({s for (n, e), rows in results.items() if n == name for s in range(len(rows))})
        for s in seeds:
            finals = [results[(name, e)][s]["final"] for e in envs if len(results.get((name, e), [])) > s]
            st = [results[(name, e)][s]["start"] for e in envs if len(results.get((name, e), [])) > s]
            if len(finals) == len(envs):
                overall.append(sum(finals) / len(finals))
                starts.append(sum(st) / len(st))
        mode = next((r["rule_mode"] for e in envs for r in results.get((name, e), [])), "-")
        lines.append(f"| {name} | " + " | ".join(per_env) + f" | {cell(overall)} | {cell(starts)} | {estimator} | "
                     f"{'reasoning reward' if reasoning else 'off'} | {mode if reasoning else '-'} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", choices=["methods", "strategies", "all"], default="all")
    ap.add_argument("--envs", default="sokoban,frozenlake")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=None, help="learner steps per run (default: the preset's)")
    ap.add_argument("--eval-episodes", type=int, default=64)
    ap.add_argument("--warm-start", choices=["build", "shipped"], default="build",
                    help="build: a model per run seed (the docstring); shipped: the preset's shipped warm start")
    ap.add_argument("--arms", default="", help="comma-separated arm names of the suite (default: all)")
    ap.add_argument("--paired", default="", help="BASE,NEW: two arms to compare seed by seed (the docstring)")
    ap.add_argument("--paired-episodes", type=int, default=1024, help="held-out seeds per final policy for --paired")
    ap.add_argument("--out", default="runs/bench-ablation")
    ap.add_argument("overrides", nargs="*", help="key.sub=value for every run")
    args = ap.parse_args()
    # grounding and SFT run in this process: their progress lines (every tenth of the steps) to stdout
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stdout)
    envs = [e.strip() for e in args.envs.split(",") if e.strip()]
    out = Path(args.out).resolve()
    suites = {"methods": METHODS, "strategies": STRATEGIES}
    chosen = list(suites) if args.suite == "all" else [args.suite]
    if args.warm_start == "shipped" and chosen != ["methods"]:
        ap.error("--warm-start shipped: the methods suite only (the strategies need warm starts in their own formats)")
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    pair = [a.strip() for a in args.paired.split(",") if a.strip()]
    known = {name for suite in chosen for name in suites[suite]}
    if set(arms + pair) - known:
        ap.error(f"--arms/--paired: unknown {sorted(set(arms + pair) - known)}; known: {', '.join(sorted(known))}")
    if args.paired and (len(pair) != 2 or (arms and set(pair) - set(arms))):
        ap.error("--paired: two arms, both among --arms when --arms is given")
    if arms:
        suites = {suite: {n: a for n, a in arms_.items() if n in arms} for suite, arms_ in suites.items()}
    plan = [(suite, name, env, seed) for suite in chosen for name in suites[suite] for env in envs
            for seed in range(args.seeds)]
    configs: dict = {}
    results: dict[str, dict] = {s: {} for s in chosen}
    shipped = {env: shipped_warm_start(env, args.overrides) if args.warm_start == "shipped" else None for env in envs}
    t_start = time.monotonic()
    for i, (suite, name, env, seed) in enumerate(plan, 1):
        arm = suites[suite][name]
        steps = args.steps or load_config(f"tiny-{env}", args.overrides).trainer.total_steps
        slug = f"{suite}/{env}/{name.lower().replace(' ', '-').replace('/', '')}/seed{seed}"
        run_dir = out / slug
        grounded = out / "models" / f"{env}-seed{seed}-grounded"
        warm = out / "models" / f"{env}-seed{seed}-{arm[2]}"
        cfg = arm_config(env, arm, seed, steps, args.eval_episodes, run_dir, run_dir / "model", args.overrides)
        status = "cached" if (run_dir / "done.json").exists() else "running"
        print(f"[ablation {i}/{len(plan)}, {time.monotonic() - t_start:.0f}s] {suite}: {name} on {env}, seed {seed} ({status})",
              flush=True)
        row = run_one(cfg, run_dir, grounded, warm, shipped[env])
        configs[(name, env, seed)] = (cfg, run_dir)
        results[suite].setdefault((name, env), []).append(row)
        print(f"    held-out success {row['start']:.3f} -> {row['final']:.3f} (n={row['n']}, {row['wall_s']:.0f}s)", flush=True)
        write_report(out, chosen, suites, results, envs, args.seeds, partial=i < len(plan))
    print(write_report(out, chosen, suites, results, envs, args.seeds, partial=False))
    if pair:
        per_seed = {}
        for env in envs:
            for seed in range(args.seeds):
                got = []
                for name in pair:
                    cfg, run_dir = configs[(name, env, seed)]
                    t0 = time.monotonic()
                    got.append(paired_eval(cfg, run_dir, args.paired_episodes))
                    print(f"[ablation paired] {name} on {env}, seed {seed}: solved {sum(got[-1].values())}/"
                          f"{len(got[-1])} ({time.monotonic() - t0:.0f}s)", flush=True)
                per_seed[(env, seed)] = tuple(got)
        text = paired_report(pair[0], pair[1], per_seed)
        if args.warm_start == "shipped":  # did either arm move the warm start it began from?
            starts = {}
            for env in envs:
                cfg, run_dir = configs[(pair[0], env, 0)]
                starts[env] = paired_eval(cfg, run_dir, args.paired_episodes, model=shipped[env],
                                          out=out / f"warm-start-{env}-eval-paired")
                print(f"[ablation paired] the shipped warm start on {env}: solved {sum(starts[env].values())}/"
                      f"{len(starts[env])}", flush=True)
            finals = {(name, env, seed): per_seed[(env, seed)][i] for i, name in enumerate(pair)
                      for env in envs for seed in range(args.seeds)}
            text += "\n\n" + start_report(starts, finals)
        (out / "ablation-paired.md").write_text(text + "\n")
        print(text)
    return 0


def write_report(out: Path, chosen: list[str], suites: dict, results: dict, envs: list[str], seeds: int,
                 partial: bool) -> str:
    """``ablation-<suite>.md`` / ``ablation-<suite>.json`` per suite from the runs finished so far
    (after every run, so an interrupted bench leaves the table of what it has; ``partial`` says so in
    the heading). One file per suite: a later bench of the other suite into the same ``--out``, which
    reuses its warm starts, leaves this suite's report alone."""
    text = []
    out.mkdir(parents=True, exist_ok=True)
    for suite in chosen:
        title = "Method (Grounding-WorldModeling)" if suite == "methods" else "Reasoning strategy (VAGEN-Base)"
        note = " (partial: not every run has finished)" if partial else ""
        part = (f"### {suite}: held-out success, mean over {seeds} run seeds [95% t-interval]{note}\n\n"
                + table(title, suites[suite], results[suite], envs))
        (out / f"ablation-{suite}.md").write_text(part + "\n")
        (out / f"ablation-{suite}.json").write_text(
            json.dumps({f"{k[0]}|{k[1]}": v for k, v in results[suite].items()}, indent=1))
        text.append(part)
    return "\n\n".join(text)


if __name__ == "__main__":
    sys.exit(main())
