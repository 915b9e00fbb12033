"""``worldloop evaluator``: held-out success while a run trains, off the learner's path.

Every ``trainer.eval_every`` policy versions the evaluator plays one fixed set of held-out episodes
with the newest weights: for each env of ``actor.envs``, ``trainer.eval_episodes`` seeds from
``eval.seed_start`` on (checked disjoint from the training seeds by the config), ``actor.max_turns``
turns, ``eval.temperature``. It is a process of its own, like an actor: it loads ``model.path``
(the start of the run: version 0 is evaluated first, so the curve starts at the SFT warm start),
takes new weights from the learner's ZeroMQ channel in the background, and never slows the
learner (on a small machine it does share the CPU with the actors).

Each evaluation is one line ``{"eval": {...}}`` in ``<run_dir>/eval.jsonl`` and in
``<run_dir>/metrics.jsonl`` (policy version, episodes, successes and the success rate with its 95%
Wilson interval per env and over all, mean episode reward, seconds), and the gauges
``worldloop_eval_success_rate{env}``/``worldloop_eval_policy_version`` on ``/metrics``.
``worldloop up`` starts it when ``trainer.eval_every > 0`` and waits for the evaluation of the
final version before it stops the run; when the control record says ``stopped`` the evaluator
first evaluates the newest version it has not evaluated yet, then exits. The learner writes a
checkpoint after its last step before it says ``stopped`` and then closes its weight channel, so a
stopping evaluator that has not fetched the final version takes it from that checkpoint's ``hf/``
export when it can read the run directory (as under ``worldloop up``); otherwise it waits up to
``FINAL_FETCH_S`` for the channel.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from pathlib import Path

from worldloop.actor.backends import make_backend
from worldloop.actor.process import WeightFetcher
from worldloop.actor.rollout import EpisodeSpec, Sampling, env_name, play_episodes
from worldloop.common.config import Config, ConfigError
from worldloop.common.control import default_proc_id
from worldloop.common.files import append_lines
from worldloop.common.metrics import metric
from worldloop.common.process import ProcessScaffold
from worldloop.common.schemas import total_turn_reward
from worldloop.eval.stats import wilson_interval

log = logging.getLogger("worldloop.evaluator")

POLL_S = 0.2
FINAL_FETCH_S = 120.0  # how long a stopping evaluator waits for the learner's final version


def held_out_specs(cfg: Config) -> list[EpisodeSpec]:
    """The fixed evaluation set: ``trainer.eval_episodes`` held-out seeds per env of ``actor.envs``."""
    out = []
    for e in cfg.actor.envs:
        for i in range(cfg.trainer.eval_episodes):
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
    from worldloop.common.modeling import load_policy
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
        return {k: t.detach() for k, t in load_policy(ref.path).state_dict().items()}
    except Exception as e:  # an unreadable export: fall back to the weight channel
        log.warning("cannot load v%d from %s: %s: %s", version, ref.path, type(e).__name__, e)
        return None


def write_record(run_dir: Path, rec: dict) -> None:
    line = json.dumps({"eval": rec}) + "\n"
    for name in ("eval.jsonl", "metrics.jsonl"):
        append_lines(run_dir / name, [line])
    for env, rate in rec["success_rate"].items():
        if rate is not None:
            metric("worldloop_eval_success_rate").labels(env=env).set(rate)
    metric("worldloop_eval_policy_version").set(rec["policy_version"])
    metric("worldloop_eval_episodes").inc(rec["episodes"]["all"])


def run(cfg: Config, args: argparse.Namespace | None = None) -> int:
    _check_config(cfg)
    from worldloop.common.weights import subscriber_from_config
    from worldloop.learner.process import run_dir_of

    run_dir = run_dir_of(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    specs = held_out_specs(cfg)
    proc_id = f"evaluator-{default_proc_id()}"
    backend = subscriber = fetcher = None
    fetch_stop = threading.Event()  # the fetcher outlives a stop request: the final version still comes
    with ProcessScaffold(cfg, "evaluator", proc_id, stop_message="evaluating the final version, then exiting") as proc:
        try:
            proc.set_phase("loading the generation backend")
            backend = make_backend(cfg, local=True)  # weights it sets itself: hf for actor.backend=server
            subscriber = subscriber_from_config(cfg)
            fetcher = WeightFetcher(subscriber, fetch_stop, have=backend.version)
            fetcher.start()
            proc.ready()
            _evaluate_until_final(cfg, proc, backend, fetcher, specs, run_dir)
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
    if not (Path(cfg.model.path) / "config.json").exists():
        raise ConfigError("model.path", f"no model directory at {cfg.model.path!r} (no config.json)")


def _evaluate_until_final(cfg: Config, proc, backend, fetcher, specs: list[EpisodeSpec], run_dir: Path) -> None:
    """Evaluate every ``trainer.eval_every`` versions as the weights arrive; once the run stops,
    evaluate the learner's final version (from the channel or its checkpoint) and return."""
    done: int | None = None
    final: int | None = None  # the learner's version when the run stopped
    final_by = 0.0
    from_disk = False  # tried the final checkpoint already
    seen = None  # the control record's version at the last look
    while True:
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
        if final is not None and backend.version < final and not from_disk:
            from_disk = True
            proc.set_phase(f"loading the final version v{final} from its checkpoint")
            got = checkpoint_weights(cfg, run_dir, final)
            if got is not None:
                backend.update_weights(got, final)
                log.info("took the final version v%d from the run's checkpoint", final)
                continue
        if final is not None and backend.version < final and time.monotonic() < final_by:
            proc.set_phase(f"fetching the final version v{final}")
            time.sleep(POLL_S)
            continue
        due = done is None or backend.version >= done + cfg.trainer.eval_every
        if due or (final is not None and done != backend.version):
            done = _evaluate_now(cfg, proc, backend, specs, run_dir)
            continue
        if final is not None:
            return
        proc.set_phase(f"waiting for version {done + cfg.trainer.eval_every}")
        time.sleep(POLL_S)


def _evaluate_now(cfg: Config, proc, backend, specs: list[EpisodeSpec], run_dir: Path) -> int:
    """One evaluation of the backend's version, recorded; returns that version."""
    v = backend.version
    proc.set_phase(f"evaluating v{v} on {len(specs)} held-out episodes")
    t0 = time.monotonic()
    rec = summarize(evaluate(backend, cfg, specs), v, time.monotonic() - t0)
    write_record(run_dir, rec)
    log.info("v%d held-out success %s (n=%d, %.0fs)", v,
             {k: round(x, 3) for k, x in rec["success_rate"].items() if x is not None},
             rec["episodes"]["all"], rec["seconds"])
    return v
