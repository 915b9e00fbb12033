"""Supervised warm start on expert demonstrations: the last step of making a fresh model
(:func:`worldloop.bootstrap.pipeline.warm_start` reads the config and calls what is here).

Public API::

    make_demonstrations(env_specs, n_episodes, seed, codec, max_turns) -> list[Trajectory]
    demonstration_seeds(env_specs, n_episodes, seed, level_pool) -> list[(spec index, seed)]
    run_sft(model_dir, demos, epochs, lr, batch_size, out_dir=None, *, seed=0, codec=None,
            progress=None, loss_sample=64) -> dict
    sequence_loss(model, demos, codec, batch_size=8) -> float
    answer_format_ok(text, prompt_format=None) -> bool
    format_ok_rate(model_dir, demos, *, temperature=0.7, top_p=1.0, max_new_tokens=96, seed=0) -> float

Demonstrations are played with ``env.unwrapped.expert_response()`` as the response of every turn
(the env contract: ``gymnasium.make(id, **kwargs)``, ``obs = {"text", "image"}``,
``env.unwrapped.system_prompt()``, ``env.step(response_text)``), so they carry the
``<observation>``/``<prediction>`` fields of the env's prompt format. Each demonstration is a
:class:`worldloop.common.contracts.schemas.Trajectory` (``policy_version`` 0, ``logprobs`` zeros, the parsed
fields, rewards and states from the env's ``info``; ``actor_id`` "sft") that
:func:`worldloop.common.contracts.modeling.build_sequence` accepts, laid out exactly as the actors lay out
their episodes.

``run_sft`` minimises the mean cross-entropy of the response tokens only (plain ``torch.optim.AdamW``,
fp32, CPU or the model's device) and saves the model (``save_pretrained``) in place or into
``out_dir`` (with the tokenizer / image-processor files copied), returning
``{"loss_before", "loss_after", "steps", "epochs", "tokens", "seconds"}``.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from worldloop.common.contracts.modeling import ChatCodec, build_sequence, collate, freeze_vision_tower, load_policy, token_logprobs
from worldloop.common.contracts.schemas import TRAJECTORY_SCHEMA, Trajectory, Turn, state_from_info
from worldloop.envs.base import move_outlook_of, observation_parts
from worldloop.envs.parsing import parse_response

log = logging.getLogger(__name__)

_FORMAT = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)
_MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors")
CONCISE_REASONING = ("empty", "plan", "outlook")  # sft.concise_reasoning


# --------------------------------------------------------------------------- demonstrations


def _spec_fields(spec: Any) -> tuple[str, dict]:
    """(env id, kwargs) of an EnvSpec, a mapping with ``id``/``kwargs``, or a bare id string."""
    if isinstance(spec, str):
        return spec, {}
    if isinstance(spec, dict):
        return str(spec["id"]), dict(spec.get("kwargs") or {})
    return str(spec.id), dict(getattr(spec, "kwargs", None) or {})


def _opt_str(x: Any) -> str | None:
    return None if x is None else str(x)


def _first_sentences(text: str | None, n: int | None) -> str | None:
    if text is None or n is None:
        return text
    kept = [p.strip().rstrip(".") for p in text.split(". ") if p.strip()][:n]
    return ". ".join(kept) + ("." if kept else "")


def concise_response(response: str, prompt_format: str, observation_relations: int | None, reasoning: str = "empty",
                     outlook: str | None = None) -> str:
    """The same answer in the same format, with the observation and prediction cut to their first
    ``observation_relations`` sentences (fewer tokens to sample and learn; None: kept whole, as an env
    with ``relation_prompt="local"`` writes exactly what its prompt asks for). ``reasoning`` "empty": an
    empty reasoning; "plan": the reasoning is the turn's actions as the answer writes them, so the
    choice is made right after the observation and the prediction and the answer follow from it; "outlook":
    the reasoning is ``outlook``, what each move would run into (the env's ``move_outlook()``), so the
    answer can follow from words the model wrote rather than from the image."""
    if reasoning not in CONCISE_REASONING:
        raise ValueError(f"reasoning must be one of {CONCISE_REASONING}, got {reasoning!r}")
    if reasoning == "outlook" and not outlook:
        raise ValueError("reasoning 'outlook' needs the env's move_outlook() text")
    from worldloop.envs.parsing import parse_response
    from worldloop.envs.prompts import build_response

    p = parse_response(response, prompt_format)
    if not p.format_ok:
        return response
    return build_response(prompt_format, answer=str(p.answer), think="",
                          observation=_first_sentences(p.observation, observation_relations),
                          reasoning=str(p.answer) if reasoning == "plan" else outlook if reasoning == "outlook" else "",
                          prediction=_first_sentences(p.prediction, observation_relations))


def _play_episode(env_id: str, kwargs: dict, seed: int, codec: ChatCodec, max_turns: int,
                  style: str = "expert", observation_relations: int = 2, distinct_moves: bool = False,
                  reasoning: str = "empty") -> Trajectory:
    import gymnasium

    from worldloop import envs  # noqa: F401  (registers worldloop/* ids)
    from worldloop.actor.rollout import env_name

    env = gymnasium.make(env_id, **kwargs)
    try:
        obs, info = env.reset(seed=seed)
        system = str(env.unwrapped.system_prompt())
        prompt_format = str(getattr(env.unwrapped, "prompt_format", "grounding_worldmodeling"))
        state = state_from_info(info)
        # only relation sentences are cut: the local relation prompt asks for exactly the env's
        # description, and a symbolic grid or a structured dict is one whole (cut, a grid got a ".")
        whole = (getattr(env.unwrapped, "relation_prompt", None) == "local"
                 or getattr(env.unwrapped, "state_format", "natural_language") != "natural_language")
        kept = None if whole else observation_relations
        turns: list[Turn] = []
        success, ended, end_reason = False, True, "max_turns"
        for t in range(max_turns):
            text, images = observation_parts(obs)
            seg = codec.encode_obs(text, images, system=system, first=t == 0, prev_response_ended=ended)
            # envs of their own may define expert_response() without the keyword: ask only when on
            response = str(env.unwrapped.expert_response(distinct_moves=True) if distinct_moves
                           else env.unwrapped.expert_response())
            if style == "concise":
                outlook = move_outlook_of(env, env_id) if reasoning == "outlook" else None
                response = concise_response(response, prompt_format, kept, reasoning, outlook)
            ids = codec.encode_response(response)
            obs, _, terminated, truncated, info = env.step(response)
            info = info if isinstance(info, dict) else {}
            success = bool(info.get("success", False))
            after = state_from_info(info)
            actions = [str(a) for a in info.get("actions") or []]
            turns.append(Turn(
                index=t, policy_version=0, obs_ids=seg.ids, response_ids=ids, logprobs=[0.0] * len(ids),
                images=seg.images, response_text=response, observation=_opt_str(info.get("observation")),
                reasoning=_opt_str(info.get("reasoning")), prediction=_opt_str(info.get("prediction")),
                actions=actions, format_ok=bool(info.get("format_ok", False)),
                env_reward=float(info.get("env_reward", 0.0)), format_reward=float(info.get("format_reward", 0.0)),
                done=bool(terminated or truncated), success=success, state_before=state, state_after=after,
                actions_total=int(info.get("actions_executed", len(actions))),
                actions_effective=int(info.get("actions_effective", 0))))
            state = after
            if terminated or truncated:
                end_reason = "done"
                break
        return Trajectory(schema=TRAJECTORY_SCHEMA, trajectory_id=f"sft-{env_id}-{seed}", group_id=f"sft-{env_id}-{seed}",
                          env_id=env_id, env_name=env_name(env_id),
                          env_kwargs=dict(kwargs), seed=int(seed), actor_id="sft", created_at=time.time(),
                          prompt_format=prompt_format, max_turns=int(max_turns), turns=turns, success=success,
                          scored=False, end_reason=end_reason)
    finally:
        env.close()


def demonstration_style(sft_cfg: Any) -> dict:
    """The answer-style keywords of :func:`make_demonstrations` that an ``sft`` config section sets."""
    return dict(style=sft_cfg.answer_style, observation_relations=sft_cfg.observation_relations,
                reasoning=sft_cfg.concise_reasoning)


def demonstration_seeds(env_specs: Sequence[Any], n_episodes: int, seed: int, level_pool: int = 1) -> list[tuple[int, int]]:
    """(spec index, seed) of ``n_episodes`` demonstrations drawn from the ``level_pool * n_episodes`` seeds
    ``seed, seed+1, ...`` (each seed's spec cycling over ``env_specs`` by its offset): with ``level_pool`` 1 all
    of them; else first every level whose first state tempts a dead end (the env's ``tempting_dead_end()``),
    then the others, each in seed order. ValueError naming the env where it does not say."""
    if level_pool < 1:
        raise ValueError(f"level_pool must be >= 1, got {level_pool}")
    specs = [_spec_fields(s) for s in env_specs]
    pool = [(k % len(specs), seed + k) for k in range(level_pool * n_episodes)]
    if level_pool == 1:
        return pool
    import gymnasium

    from worldloop import envs  # noqa: F401  (registers worldloop/* ids)

    made = [gymnasium.make(env_id, **kwargs) for env_id, kwargs in specs]
    try:
        tempting = []
        for i, s in pool:
            made[i].reset(seed=s)
            verdict = made[i].unwrapped.tempting_dead_end()
            if verdict is None:
                raise ValueError(f"{specs[i][0]} has no tempting_dead_end(): sft.level_pool > 1 needs to know "
                                 "which levels tempt a dead end")
            tempting.append(bool(verdict))
    finally:
        for env in made:
            env.close()
    return ([p for p, t in zip(pool, tempting) if t] + [p for p, t in zip(pool, tempting) if not t])[:n_episodes]


def make_demonstrations(
    env_specs: Sequence[Any], n_episodes: int, seed: int, codec: ChatCodec, max_turns: int,
    *, style: str = "expert", observation_relations: int = 2, distinct_moves: bool = False, reasoning: str = "empty",
    level_pool: int = 1,
) -> list[Trajectory]:
    """Play ``n_episodes`` expert episodes, cycling over ``env_specs``, seeds ``seed, seed+1, ...``.

    ``style`` "expert": the env's ``expert_response()``; "concise": :func:`concise_response` of it
    (with ``reasoning``; ``observation_relations`` sentences kept, all of them for an env with
    ``relation_prompt="local"``, whose description is exactly what its prompt asks for).
    ``distinct_moves``: the env's ``expert_response(distinct_moves=True)``, one step per direction
    per turn (such an episode can run out of turns: it is kept, an imperfect demonstrator).
    ``level_pool``: the levels of :func:`demonstration_seeds`."""
    if not env_specs:
        raise ValueError("make_demonstrations needs at least one env spec")
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    if style not in ("expert", "concise"):
        raise ValueError(f"style must be 'expert' or 'concise', got {style!r}")
    specs = [_spec_fields(s) for s in env_specs]
    demos = []
    for i, level in demonstration_seeds(env_specs, n_episodes, seed, level_pool):
        env_id, kwargs = specs[i]
        demos.append(_play_episode(env_id, kwargs, level, codec, max_turns, style, observation_relations,
                                   distinct_moves, reasoning))
    return demos


# --------------------------------------------------------------------------- training


def _batches(demos: Sequence[Trajectory], batch_size: int, order: Iterable[int]) -> Iterable[list[Trajectory]]:
    order = list(order)
    for s in range(0, len(order), batch_size):
        yield [demos[i] for i in order[s : s + batch_size]]


def _batch_loss(model: torch.nn.Module, demos: list[Trajectory], codec: ChatCodec) -> tuple[torch.Tensor, int]:
    """Mean negative log-likelihood of the response tokens of ``demos``, and their count."""
    batch = collate([build_sequence(d) for d in demos], codec)
    lp, _ = token_logprobs(model, batch, only=batch["response_mask"], masked_ids=codec.prompt_only_ids)
    mask = batch["response_mask"].to(lp.device)
    n = int(mask.sum())
    return -(lp * mask).sum() / max(n, 1), n


@torch.no_grad()
def sequence_loss(model: torch.nn.Module, demos: Sequence[Trajectory], codec: ChatCodec, batch_size: int = 8) -> float:
    """Token-weighted mean response cross-entropy over all ``demos``."""
    total, count = 0.0, 0
    for chunk in _batches(demos, batch_size, range(len(demos))):
        loss, n = _batch_loss(model, chunk, codec)
        total += float(loss) * n
        count += n
    return total / max(count, 1)


def _save(model: torch.nn.Module, model_dir: Path, out_dir: Path) -> None:
    if out_dir.resolve() != model_dir.resolve():
        out_dir.mkdir(parents=True, exist_ok=True)
        for f in model_dir.iterdir():
            if f.is_file() and f.name not in _MODEL_FILES and not f.name.endswith(".safetensors"):
                shutil.copy2(f, out_dir / f.name)
    model.save_pretrained(str(out_dir), safe_serialization=True)


def run_sft(
    model_dir: str | Path,
    demos: Sequence[Trajectory],
    epochs: int,
    lr: float,
    batch_size: int,
    out_dir: str | Path | None = None,
    *,
    seed: int = 0,
    codec: ChatCodec | None = None,
    progress: Callable[[dict], None] | None = None,
    loss_sample: int = 64,
    freeze_vision: bool = False,
) -> dict:
    """Fine-tune on the demonstrations' response tokens; save; return loss before/after etc.

    ``loss_before``/``loss_after`` are measured on the first ``loss_sample`` demonstrations (all of
    them when 0): a full pass over a large demonstration set would cost as much as an epoch."""
    if not demos:
        raise ValueError("run_sft needs at least one demonstration")
    if epochs < 0 or batch_size < 1 or lr <= 0:
        raise ValueError(f"need epochs >= 0, batch_size >= 1, lr > 0 (got {epochs}, {batch_size}, {lr})")
    model_dir = Path(model_dir)
    codec = codec or ChatCodec(model_dir)
    model = load_policy(model_dir, dtype="float32")
    if freeze_vision:
        freeze_vision_tower(model)
    start = time.monotonic()
    probe = list(demos[:loss_sample]) if loss_sample > 0 else list(demos)
    before = sequence_loss(model, probe, codec, batch_size)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    steps = tokens = 0
    for epoch in range(epochs):
        for chunk in _batches(demos, batch_size, torch.randperm(len(demos), generator=gen).tolist()):
            loss, n = _batch_loss(model, chunk, codec)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            steps, tokens = steps + 1, tokens + n
            if progress is not None:
                progress({"epoch": epoch, "step": steps, "loss": float(loss.detach())})
        log.info("sft epoch %d/%d done, %d steps", epoch + 1, epochs, steps)
    model.eval()
    after = sequence_loss(model, probe, codec, batch_size)
    _save(model, model_dir, Path(out_dir) if out_dir is not None else model_dir)
    return {"loss_before": before, "loss_after": after, "steps": steps, "epochs": epochs,
            "tokens": tokens, "seconds": time.monotonic() - start}


# --------------------------------------------------------------------------- evaluation


def answer_format_ok(text: str, prompt_format: str | None = None) -> bool:
    """Without ``prompt_format``: ``<think>...</think><answer>...</answer>`` with a non-empty answer
    (VAGEN's format check). With it: the env's own parse of that strategy's format (what earns the
    format reward), so a No-Think answer (``<answer>`` alone) counts as well-formed."""
    if prompt_format is not None:
        return parse_response(text, prompt_format).format_ok
    m = _FORMAT.fullmatch(text)
    return bool(m and m.group(2).strip())


def format_ok_rate(
    model_dir: str | Path,
    demos: Sequence[Trajectory],
    *,
    temperature: float = 0.7,
    top_p: float = 1.0,
    max_new_tokens: int = 96,
    seed: int = 0,
) -> float:
    """Fraction of well-formed answers (in each demonstration's own prompt format) sampled for the
    first-turn prompts of ``demos``."""
    from worldloop.actor.generation import GenRequest
    from worldloop.actor.hf_backend import HFBackend

    backend = HFBackend(model_dir)
    try:
        reqs = [GenRequest(d.turns[0].obs_ids, d.turns[0].images) for d in demos]
        results = backend.generate(reqs, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed)
    finally:
        backend.close()
    return float(np.mean([answer_format_ok(r.text, d.prompt_format) for r, d in zip(results, demos)])) if results else 0.0
