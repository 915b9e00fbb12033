"""The steps that make the model a run starts from: (config, empty directory) -> model.

Public API::

    build_model(cfg, model_dir) -> Iterator[(step, report)]   # the steps below, in order
    make_tiny(cfg, model_dir) -> Path                 # 1. the embedded tiny model
    ground(cfg, model_dir) -> dict                    # 2. grounding pre-training (grounding.json)
    warm_start(cfg, model_dir, probe_prompts=SFT_PROBE_SEEDS) -> dict   # 3. SFT (sft.json)
    env_specs(cfg) -> list[dict]                      # the envs grounding and SFT play
    grounds_outlook(cfg) -> bool                      # grounding reads the move outlook too
    demonstrations(cfg, codec, n, seed_start) -> list[Trajectory]   # SFT's, as warm_start plays them

The steps read the config here and call the config-free libraries ``tiny_model``, ``grounding``
and ``sft`` with explicit arguments. Which model a run uses, where it is kept and how a build is
made reproducible and recorded is :mod:`worldloop.bootstrap.store`'s business; what in the config
decides the model is :mod:`worldloop.bootstrap.recipe`'s.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Iterator

from worldloop.common.contracts.config import GROUNDING_EVAL_BOARDS, SFT_PROBE_SEEDS, Config

# the steps import torch and transformers inside them: ``worldloop up`` on a model that exists
# never loads them into the supervising process

log = logging.getLogger(__name__)


def build_model(cfg: Config, model_dir: Path) -> Iterator[tuple[str, dict]]:
    """Make the model in ``model_dir``: the tiny model, then grounding (when
    ``model.tiny_grounding_steps``) and SFT (when ``sft.enabled``), yielding ``("grounding", report)``
    and ``("sft", report)`` as each of those ends."""
    make_tiny(cfg, model_dir)
    if cfg.model.tiny_grounding_steps:
        yield "grounding", ground(cfg, model_dir)
    if cfg.sft.enabled:
        log.info("model: SFT warm start on %d solver demonstrations", cfg.sft.episodes)
        report = warm_start(cfg, model_dir)
        log.info("model: SFT done: %s", report)
        yield "sft", report


def make_tiny(cfg: Config, model_dir: Path) -> Path:
    """Step 1: the embedded tiny model (``run.seed``, ``model.tiny_copy_pretrain_steps``)."""
    from worldloop.bootstrap.tiny_model import make_tiny_model

    return make_tiny_model(model_dir, seed=cfg.run.seed, copy_pretrain_steps=cfg.model.tiny_copy_pretrain_steps)


def env_specs(cfg: Any) -> list[dict]:
    """``{"id", "kwargs"}`` of every env of ``actor.envs``: what grounding and SFT play (``kwargs``
    as they are; ``train_kwargs`` are the actors' alone)."""
    return [{"id": e.id, "kwargs": dict(e.kwargs)} for e in cfg.actor.envs]


def grounds_outlook(cfg: Any) -> bool:
    """Whether grounding pre-training also reads the move outlook: the demonstrations will have the
    agent write it as its reasoning (``sft.concise_reasoning: outlook``)."""
    return bool(cfg.sft.enabled and cfg.sft.concise_reasoning == "outlook")


def ground(cfg: Any, model_dir: str | Path) -> dict:
    """Step 2: grounding pre-training of a newly made tiny model on the run's own envs
    (``cfg.actor.envs``, in the render mode and state format the actors use), with the
    ``model.tiny_grounding_*`` settings; logs progress ten times and the accuracy before/after."""
    from worldloop.bootstrap.grounding import grounding_pretrain

    m = cfg.model
    every = max(1, m.tiny_grounding_steps // 10)
    log.info("model: grounding pre-training, %d steps of %d levels (seeds %d on)", m.tiny_grounding_steps,
             m.tiny_grounding_batch_size, m.tiny_grounding_seed_start)

    def progress(p: dict) -> None:
        if p["step"] % every == 0:
            log.info("grounding: step %d/%d loss %.3f", p["step"], p["steps"], p["loss"])

    report = grounding_pretrain(model_dir, env_specs(cfg), m.tiny_grounding_steps,
                                seed_start=m.tiny_grounding_seed_start, max_image_side=m.max_image_side,
                                batch_size=m.tiny_grounding_batch_size, lr=m.tiny_grounding_lr, seed=cfg.run.seed,
                                freeze_vision=m.freeze_vision, eval_boards=GROUNDING_EVAL_BOARDS, progress=progress,
                                prompt="observation", agent_every=m.tiny_grounding_agent_every,
                                agent_batch_size=m.tiny_grounding_agent_batch_size,
                                outlook=grounds_outlook(cfg))
    log.info("model: grounding done in %.0fs: in the actors' first turn, the first relation is right on %.0f%% of "
             "held-out boards (before %.0f%%) and the whole description on %.0f%%", report["seconds"],
             100 * report["after_agent"]["first"], 100 * report["before_agent"]["first"],
             100 * report["after_agent"]["exact"])
    return report


def demonstrations(cfg: Any, codec: Any, n: int, seed_start: int) -> list:
    """``n`` SFT demonstrations on seeds ``seed_start`` on, exactly as :func:`warm_start` plays them
    (the config's envs, ``actor.max_turns``, ``sft.turn_plan``, ``sft.level_pool`` and answer style)."""
    from worldloop.bootstrap.sft import demonstration_style, make_demonstrations

    s = cfg.sft
    return make_demonstrations(env_specs(cfg), n, seed_start, codec, cfg.actor.max_turns,
                               distinct_moves=s.turn_plan == "distinct", level_pool=s.level_pool, **demonstration_style(s))


def warm_start(cfg: Any, model_dir: str | Path, *, probe_prompts: int = SFT_PROBE_SEEDS) -> dict:
    """Step 3: SFT of a freshly made model on solver demonstrations of the run's own envs.

    ``cfg.sft.episodes`` expert episodes cycle over ``cfg.actor.envs`` with seeds ``sft.seed_start``
    onwards (a range the config loader checks is disjoint from the RL seeds and the held-out eval
    seeds), ``actor.max_turns`` turns each, in the envs' own prompt format, so the
    ``<observation>``/``<prediction>`` fields hold the true states (cut short with
    ``sft.answer_style: concise``). Trains in place; returns ``run_sft``'s report plus
    ``format_ok_before``/``format_ok_after``: the share of well-formed answers sampled (at the
    actor's temperature) for the first-turn prompts of ``probe_prompts`` further demonstration-range seeds.
    """
    import numpy as np

    from worldloop.bootstrap.sft import demonstration_style, format_ok_rate, make_demonstrations, run_sft
    from worldloop.common.contracts.modeling import ChatCodec

    model_dir = Path(model_dir)
    s, a = cfg.sft, cfg.actor
    codec = ChatCodec(model_dir, max_image_side=cfg.model.max_image_side)
    specs = env_specs(cfg)
    start = time.monotonic()
    style = demonstration_style(s)
    demos = demonstrations(cfg, codec, s.episodes, s.seed_start)
    probes = make_demonstrations(specs, probe_prompts, s.seed_start + s.level_pool * s.episodes, codec, 1, **style)
    log.info("sft: %d demonstrations (%d turns) in %.1fs", len(demos), sum(len(d.turns) for d in demos),
             time.monotonic() - start)
    lengths = [len(t.response_ids) for d in demos for t in d.turns]
    too_long = sum(n > a.max_new_tokens for n in lengths)
    if too_long:
        log.warning("sft: %d of %d demonstration answers are longer than actor.max_new_tokens=%d (longest %d): "
                    "sampled answers will be cut off before </answer>; raise actor.max_new_tokens",
                    too_long, len(lengths), a.max_new_tokens, max(lengths))

    def rate() -> float:
        return format_ok_rate(model_dir, probes, temperature=a.temperature, top_p=a.top_p,
                              max_new_tokens=a.max_new_tokens, seed=cfg.run.seed)

    before = rate()
    every = max(1, (s.epochs * -(-len(demos) // s.batch_size)) // 10)

    def progress(p: dict) -> None:
        if p["step"] % every == 0:
            log.info("sft: epoch %d step %d loss %.3f", p["epoch"] + 1, p["step"], p["loss"])

    report = run_sft(model_dir, demos, s.epochs, s.lr, s.batch_size, seed=cfg.run.seed, codec=codec, progress=progress,
                     freeze_vision=cfg.model.freeze_vision)
    report.update(format_ok_before=before, format_ok_after=rate(), demonstrations=len(demos),
                  success_rate_of_demonstrations=float(np.mean([d.success for d in demos])),
                  answer_tokens_max=max(lengths), answers_longer_than_max_new_tokens=too_long)
    return report
