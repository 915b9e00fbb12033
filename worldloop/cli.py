"""The ``worldloop`` command: one subcommand per role.

    worldloop up [CONFIG] [key.sub=value ...]        a whole local run (Redis, model, learner, actors, judge)
    worldloop actor --config CONFIG [overrides]      a rollout actor
    worldloop serve --config CONFIG [--port P]       a vLLM inference server (actor.backend=server)
    worldloop judge --config CONFIG [overrides]      a judge worker process
    worldloop learner --config CONFIG [overrides]    the DeepSpeed learner
    worldloop eval --model PATH --envs a,b ...       evaluate a model on the env suite
    worldloop status --config CONFIG                 streams, lag, versions, actors, failures
    worldloop config show [CONFIG] [overrides]       the resolved config as YAML (or what is wrong)
    worldloop show PATH [--out FILE]                 an HTML page of eval / sampled episodes
    worldloop model build CONFIG [overrides] [--out DIR]   build the model a run of CONFIG starts from
    worldloop model resolve CONFIG [overrides]       print where that model is (shipped, cached or built)
    worldloop model export RUN --merged [--out DIR]  the run's newest checkpoint as a plain HF model (LoRA merged)
    worldloop --version                              the installed version

Every subcommand but ``show`` loads the config first, so a bad key or value fails here,
before any process starts, with the key and the reason (exit code 2).
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import logging
import os
import signal
import sys
from typing import Any, Callable

from worldloop import __version__
from worldloop.common.contracts.config import Config, ConfigError, load_config, to_dict
from worldloop.common.transport.lease import LeaseHeld
from worldloop.common.transport.redis_link import REDIS_PASSWORD_ENV, Fenced
from worldloop.common.secrets import redacted, redacted_override, url_password
from worldloop.common.transport.streams import RedisUnreachable

# subcommand -> (module, function, one-line help, long description)
COMMANDS: dict[str, tuple[str, str, str, str]] = {
    "up": (
        "worldloop.up", "run",
        "run a whole local training job",
        "Start everything a training run needs on this machine: a local Redis when redis.url is null, "
        "the model (model.path when it exists, else the warm start of the config's recipe: shipped, cached, or "
        "made on the spot by grounding pre-training and SFT), then the "
        "learner, up.num_actors actors and up.num_judges judges as child processes. Shows a live progress "
        "line, stops on Ctrl-C or after trainer.total_steps, and leaves run_dir with metrics.jsonl, a plot, "
        "checkpoints and logs.",
    ),
    "actor": (
        "worldloop.actor.process", "run",
        "run a rollout actor",
        "Play num_envs episodes at once with the configured generation backend (hf, vllm or server), push finished "
        "trajectories to the rollouts stream (or scored when the judge is off), and apply new weights from "
        "the learner's ZeroMQ channel between generations. Needs redis.url, weights.host and model.path.",
    ),
    "serve": (
        "worldloop.serve", "run",
        "run a vLLM inference server for actor.backend=server",
        "Start `vllm serve` for model.path with worldloop's worker extension: the server loads every policy "
        "version from the learner's ZeroMQ channel between requests, tags each response with the version that "
        "produced it and answers GET /worldloop/info; actors reach it through actor.servers. Host and port "
        "from serve.host/serve.port or --host/--port; vLLM settings from model.*, actor.vllm_* and serve.*.",
    ),
    "judge": (
        "worldloop.judge.process", "run",
        "run a judge worker",
        "Consume the rollouts stream, score each turn's <observation> and <prediction> against the true "
        "states (rule, llm or hybrid scorers), write the scored trajectory to the scored stream, then ack. "
        "Run as many as needed; they share one consumer group.",
    ),
    "learner": (
        "worldloop.learner.process", "run",
        "run the DeepSpeed learner",
        "Read the scored stream, build PPO batches (bounded staleness, dedup by trajectory id), update "
        "policy and critic with DeepSpeed, publish each new policy version over ZeroMQ, checkpoint. "
        "Use --resume (or trainer.resume=true) to continue from the newest checkpoint.",
    ),
    "evaluator": (
        "worldloop.heldout", "run",
        "evaluate held-out seeds while a run trains",
        "Play trainer.eval_episodes held-out seeds per env (from eval.seed_start on) with the newest "
        "weights every trainer.eval_every policy versions, taking the weights from the learner's ZeroMQ "
        "channel like an actor; append the results to <run_dir>/eval.jsonl and metrics.jsonl and export "
        "them on /metrics. worldloop up starts it when trainer.eval_every > 0.",
    ),
    "eval": (
        "worldloop.eval.evaluate", "run",
        "evaluate a model on the env suite",
        "Run held-out seeds for a local model directory, a learner checkpoint or an OpenAI-compatible "
        "endpoint and print a success-rate table in the layout of the VAGEN paper's Table 2.",
    ),
    "status": (
        "worldloop.status", "run",
        "show the state of a run",
        "Print stream lengths, pending counts, consumer lag, the policy version, recently seen actors and "
        "judge failures of the run whose redis.url/namespace the config names.",
    ),
    "config": (
        "worldloop.cli", "config_command",
        "print the resolved config",
        "`worldloop config show [CONFIG] [key.sub=value ...]` loads CONFIG (or the defaults) with the "
        "overrides, validates it as every process does at start-up, and prints the resolved config as YAML, "
        "every default filled in. A bad key or value prints the key and the reason and exits 2.",
    ),
    "show": (
        "worldloop.show", "run",
        "write an HTML page of episodes",
        "Write one self-contained HTML page (images inlined, no network) from an eval output folder "
        "(its episodes.jsonl) or a JSONL file of sampled trajectories: per turn the image, the agent's "
        "<observation> beside the true state, its <prediction> beside the next true state, the judge's "
        "scores, the actions and the rewards. Needs no config.",
    ),
    "model": (
        "worldloop.bootstrap.store", "model_command",
        "build or locate the model a run starts from",
        "`worldloop model build CONFIG [key.sub=value ...] [--out DIR]` makes the warm start of CONFIG's recipe "
        "(the tiny model, grounding pre-training, SFT) reproducibly, with a recipe.json beside the weights, into DIR "
        "or the user's cache. `worldloop model resolve CONFIG [...]` prints the directory a run of CONFIG starts "
        "from (model.path, a shipped model, the cache, or built into the cache), for processes started by hand. "
        "`worldloop model export RUN --merged [--config C] [--out DIR]` writes the newest checkpoint of RUN (a run "
        "directory or a checkpoint) as a plain HF model directory, a LoRA adapter folded into its base model.",
    ),
    "sd": (
        "worldloop.sd", "run",
        "write Prometheus file_sd targets from the heartbeats",
        "Write the /metrics address of every live process of the run (learner, actors, judges on any "
        "machine) to a Prometheus file_sd JSON file, labelled role, namespace, host and process_id; with "
        "--interval keep refreshing it. deploy/prometheus.yml reads that file.",
    ),
}

# subcommands that take no config (everything else loads and validates one first)
NO_CONFIG: frozenset[str] = frozenset({"show"})
# subcommands that load model.path: a null one is resolved first (shipped or cached, never built here)
NEEDS_MODEL: frozenset[str] = frozenset({"actor", "learner", "evaluator"})


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
    parser.add_argument("--version", action="version", version=f"worldloop {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, _, short, long) in COMMANDS.items():
        p = sub.add_parser(name, help=short, description=long)
        if name == "up":
            p.add_argument("config_file", nargs="?", default=None, help="YAML config (e.g. configs/tiny-sokoban.yaml)")
            p.add_argument("--config", "-c", default=None, help=argparse.SUPPRESS)
            p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides, values parsed as YAML")
        elif name == "model":
            p.add_argument("action", choices=["build", "resolve", "export"],
                           help="build: make the model afresh; resolve: print where a run's model is; export: a run's "
                                "newest checkpoint as a plain HF model directory")
            p.add_argument("config_file", nargs="?", default=None,
                           help="YAML config or preset (e.g. tiny-frozenlake); export: the run directory or checkpoint")
            p.add_argument("--config", "-c", default=None, help="export: the run's config (for model.path)")
            p.add_argument("--out", "-o", default=None, help="build: the folder to write (default: the user's cache); "
                                                              "export: the folder to write (default: <checkpoint>/merged)")
            p.add_argument("--merged", action="store_true", help="export: fold a LoRA adapter into its base model")
            p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides, values parsed as YAML")
        elif name == "config":
            p.add_argument("action", choices=["show"], help="show: print the resolved config as YAML")
            p.add_argument("config_file", nargs="?", default=None, help="YAML config (default: the built-in defaults)")
            p.add_argument("--config", "-c", default=None, help=argparse.SUPPRESS)
            p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides, values parsed as YAML")
        elif name == "show":
            p.add_argument("path", help="an eval output folder (episodes.jsonl) or a JSONL file of trajectories")
            p.add_argument("--out", "-o", default=None,
                           help="HTML file to write (default: episodes.html in the folder / beside the file)")
            p.add_argument("--max-episodes", type=int, default=200, help="at most this many episodes (default 200)")
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
            elif name == "serve":
                p.add_argument("--host", default=None, help="address to bind (default serve.host)")
                p.add_argument("--port", type=int, default=None, help="port to listen on (default serve.port)")
            elif name == "sd":
                p.add_argument("--out", required=True, help="file_sd JSON file to write (replaced atomically)")
                p.add_argument("--interval", type=float, default=None, help="refresh every S seconds until stopped")
                p.add_argument("--timeout", type=float, default=None, help="drop processes silent this long (s, default 30)")
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
    if args.command in NO_CONFIG:
        fn = _entry(args.command)
        if fn is None:
            print(f"worldloop {args.command}: not built yet in this version of worldloop", file=sys.stderr)
            return 2
        try:
            return int(fn(None, args) or 0)
        except KeyboardInterrupt:
            return 130
    config_file = getattr(args, "config_file", None)
    if args.command == "model" and args.action == "export":  # the positional is the run, not a config
        config_file = None
    if config_file and "=" in config_file and not os.path.exists(config_file):
        # `worldloop up a.b=1` / `config show a.b=1`: no config file, the first word is an override
        args.overrides = [config_file, *(args.overrides or [])]
        config_file = args.config_file = None
    config_path = config_file or args.config
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
        _resolve_model_path(cfg, args.command)
        rc = fn(cfg, args)
    except FileNotFoundError as e:  # no model to start from (and none may be made here)
        if args.command != "model" and (args.command not in NEEDS_MODEL or cfg.model.path):
            raise
        print(f"worldloop {args.command}: {e}", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"worldloop {args.command}: bad configuration: {e}", file=sys.stderr)
        return 2
    except RedisUnreachable as e:  # a wrong redis.url: say so instead of retrying for ever
        print(f"worldloop {args.command}: {e}", file=sys.stderr)
        return 2
    except LeaseHeld as e:  # a second learner on a namespace: name the first
        print(f"worldloop {args.command}: {e}", file=sys.stderr)
        return 2
    except Fenced as e:  # this learner's namespace was taken over: it stopped writing
        print(f"worldloop {args.command}: stopped: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 130
    return int(rc or 0)


def _resolve_model_path(cfg: Config, command: str) -> None:
    """A role that loads ``model.path`` gets the model of the config's recipe for a null one."""
    if command in NEEDS_MODEL and not cfg.model.path:
        if cfg.redis.url is None:
            return  # every such role needs the run's Redis first and says so itself, naming redis.url
        from worldloop.bootstrap.store import resolve_model

        cfg.model.path = str(resolve_model(cfg, build=False).path)


def _plain(obj: Any) -> Any:
    """Tuples and other sequences as lists, so that yaml.safe_dump writes plain YAML."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [_plain(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


def config_command(cfg: Config, args: argparse.Namespace) -> int:
    """``worldloop config show``: the resolved (validated) config as YAML on stdout; loadable again
    with ``worldloop ... --config`` since every key it prints is a config key."""
    import yaml

    source = getattr(args, "config_file", None) or getattr(args, "config", None) or "(built-in defaults)"
    overrides = " ".join(redacted_override(o) for o in args.overrides or []) or "none"
    sys.stdout.write(f"# worldloop {__version__}: resolved config of {source}; overrides: {overrides}\n")
    if cfg.redis.url and url_password(cfg.redis.url):
        sys.stdout.write(f"# redis.url's password is not printed: give it in ${REDIS_PASSWORD_ENV}\n")
    sys.stdout.write(yaml.safe_dump(_plain(redacted(to_dict(cfg))), sort_keys=False, default_flow_style=False, width=100))
    sys.stdout.flush()
    return 0


def run() -> None:
    """The process entry point (the ``worldloop`` script and ``python -m worldloop``): stack dumps
    on, then :func:`main`. Callers inside another program call :func:`main` instead."""
    install_stack_dumps()
    sys.exit(main())


if __name__ == "__main__":  # pragma: no cover
    run()
