"""The ``worldloop`` command: one subcommand per role.

    worldloop up [CONFIG] [key.sub=value ...]        a whole local run (Redis, model, learner, actors, judge)
    worldloop actor --config CONFIG [overrides]      a rollout actor
    worldloop judge --config CONFIG [overrides]      a judge worker process
    worldloop learner --config CONFIG [overrides]    the DeepSpeed learner
    worldloop eval --model PATH --envs a,b ...       evaluate a model on the env suite
    worldloop status --config CONFIG                 streams, lag, versions, actors, failures

Every subcommand loads the config first, so a bad key or value fails here,
before any process starts, with the key and the reason.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import logging
import signal
import sys
from typing import Callable

from common.config import Config, ConfigError, load_config

# subcommand -> (module, function, one-line help, long description)
COMMANDS: dict[str, tuple[str, str, str, str]] = {
    "up": (
        "common.up", "run",
        "run a whole local training job",
        "Start everything a training run needs on this machine: a local Redis when redis.url is null, "
        "the embedded tiny model when model.path does not exist (with a short SFT warm start), then the "
        "learner, up.num_actors actors and up.num_judges judges as child processes. Shows a live progress "
        "line, stops on Ctrl-C or after trainer.total_steps, and leaves run_dir with metrics.jsonl, a plot, "
        "checkpoints and logs.",
    ),
    "actor": (
        "actor.process", "run",
        "run a rollout actor",
        "Play num_envs episodes at once with the configured generation backend (hf or vllm), push finished "
        "trajectories to the rollouts stream (or scored when the judge is off), and apply new weights from "
        "the learner's ZeroMQ channel between generations. Needs redis.url, weights.host and model.path.",
    ),
    "judge": (
        "judge.process", "run",
        "run a judge worker",
        "Consume the rollouts stream, score each turn's <observation> and <prediction> against the true "
        "states (rule, llm or hybrid scorers), write the scored trajectory to the scored stream, then ack. "
        "Run as many as needed; they share one consumer group.",
    ),
    "learner": (
        "learner.process", "run",
        "run the DeepSpeed learner",
        "Read the scored stream, build PPO batches (bounded staleness, dedup by trajectory id), update "
        "policy and critic with DeepSpeed, publish each new policy version over ZeroMQ, checkpoint. "
        "Use --resume (or trainer.resume=true) to continue from the newest checkpoint.",
    ),
    "eval": (
        "actor.evaluate", "run",
        "evaluate a model on the env suite",
        "Run held-out seeds for a local model directory, a learner checkpoint or an OpenAI-compatible "
        "endpoint and print a success-rate table in the layout of the VAGEN paper's Table 2.",
    ),
    "status": (
        "common.status", "run",
        "show the state of a run",
        "Print stream lengths, pending counts, consumer lag, the policy version, recently seen actors and "
        "judge failures of the run whose redis.url/namespace the config names.",
    ),
}


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", default=None, help="YAML config file (presets in configs/)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides, values parsed as YAML")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="worldloop",
        description="Asynchronous actor-learner RL for VLM agents with world-model reasoning.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, _, short, long) in COMMANDS.items():
        p = sub.add_parser(name, help=short, description=long)
        if name == "up":
            p.add_argument("config_file", nargs="?", default=None, help="YAML config (e.g. configs/tiny-sokoban.yaml)")
            p.add_argument("--config", "-c", default=None, help=argparse.SUPPRESS)
            p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides, values parsed as YAML")
        elif name == "eval":
            p.add_argument("--config", "-c", default=None, help="YAML config file")
            p.add_argument("--model", default=None, help="local model dir, learner checkpoint dir, or a model name at --base-url")
            p.add_argument("--envs", default=None, help="comma-separated env presets (sokoban,frozenlake,...), gymnasium ids, or the suites vagen / wmact")
            p.add_argument("--episodes", type=int, default=None, help="episodes per env (default eval.episodes)")
            p.add_argument("--base-url", default=None, help="OpenAI-compatible endpoint; key from $OPENAI_API_KEY")
            p.add_argument("--backend", choices=["hf", "vllm"], default=None, help="local generation backend")
            p.add_argument("--prompt-format", default=None, help="reasoning strategy (e.g. grounding_worldmodeling)")
            p.add_argument("--state-format", default=None, help="state representation (natural_language, symbolic, structured)")
            p.add_argument("--single-turn", action="store_true", help="WMAct single-turn protocol")
            p.add_argument("--output", default=None, help="output directory (JSONL, table .md/.csv); resumable")
            p.add_argument("--render-mode", choices=["vision", "text"], default=None, help="image or text observations")
            p.add_argument("--max-turns", type=int, default=None, help="turns per episode (default: the paper's per env)")
            p.add_argument("--max-tokens", type=int, default=None, help="max tokens per response (default eval.max_tokens)")
            p.add_argument("--temperature", type=float, default=None, help="sampling temperature (default eval.temperature)")
            p.add_argument("--concurrency", type=int, default=None, help="episodes in flight (default eval.concurrency)")
            p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")
        else:
            _add_common(p)
            if name == "learner":
                p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
                # the deepspeed launcher passes --local_rank=N (torchrun sets LOCAL_RANK instead)
                p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level, logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s",
        stream=sys.stderr,
    )


def install_stack_dumps() -> bool:
    """A crash in native code prints the Python stacks, and ``kill -USR1 <pid>`` prints the stacks of
    every thread of a live process to its log (stderr) without stopping it: the first thing to look at
    when an actor, judge or learner seems stuck. Only for a process of its own (see :func:`run`):
    False, and nothing installed, when stderr is not a real file (e.g. captured by a caller)."""
    try:
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return False
    faulthandler.enable(file=sys.stderr, all_threads=True)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)
    return True


def _entry(command: str) -> Callable[[Config, argparse.Namespace], int] | None:
    module, func, _, _ = COMMANDS[command]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and (e.name == module or module.startswith(e.name + ".")):
            return None
        raise
    return getattr(mod, func, None)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    config_path = getattr(args, "config_file", None) or args.config
    try:
        cfg = load_config(config_path, args.overrides or [])
    except ConfigError as e:
        print(f"worldloop {args.command}: bad configuration: {e}", file=sys.stderr)
        return 2
    setup_logging(cfg.run.log_level)
    fn = _entry(args.command)
    if fn is None:
        print(f"worldloop {args.command}: not built yet in this version of worldloop", file=sys.stderr)
        return 2
    try:
        rc = fn(cfg, args)
    except ConfigError as e:
        print(f"worldloop {args.command}: bad configuration: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return int(rc or 0)


def run() -> None:
    """The process entry point (the ``worldloop`` script and ``python -m common.cli``): stack dumps
    on, then :func:`main`. Callers inside another program call :func:`main` instead."""
    install_stack_dumps()
    sys.exit(main())


if __name__ == "__main__":  # pragma: no cover
    run()
