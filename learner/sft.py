"""Supervised warm start on expert demonstrations (issue 7: used by ``worldloop up`` on a fresh model).

Public API::

    make_demonstrations(env_specs, n_episodes, seed, codec, max_turns) -> list[dict]
    run_sft(model_dir, demos, epochs, lr, batch_size, out_dir=None, *, seed=0, codec=None,
            progress=None) -> dict
    sequence_loss(model, demos, codec, batch_size=8) -> float
    answer_format_ok(text) -> bool
    format_ok_rate(model_dir, demos, *, temperature=0.7, top_p=1.0, max_new_tokens=96, seed=0) -> float
    warm_start(cfg, model_dir) -> dict    # worldloop up: SFT of a fresh model on the run's envs

Demonstrations are played with ``env.unwrapped.expert_response()`` as the response of every turn
(the env contract: ``gymnasium.make(id, **kwargs)``, ``obs = {"text", "image"}``,
``env.unwrapped.system_prompt()``, ``env.step(response_text)``), so they carry the
``<observation>``/``<prediction>`` fields of the env's prompt format. Each demonstration is a
trajectory-like dict (``turns[i]`` with ``index``, ``policy_version`` 0, ``obs_ids``,
``response_ids``, ``logprobs`` (zeros), ``images``, ``response_text``; plus ``env_id``, ``seed``,
``success``) that :func:`common.modeling.build_sequence` accepts, laid out exactly as the actors
lay out their episodes.

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

from common.modeling import ChatCodec, build_sequence, collate, load_policy, token_logprobs
from envs.base import observation_parts

log = logging.getLogger(__name__)

_FORMAT = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)
_MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors")


# --------------------------------------------------------------------------- demonstrations


def _spec_fields(spec: Any) -> tuple[str, dict]:
    """(env id, kwargs) of an EnvSpec, a mapping with ``id``/``kwargs``, or a bare id string."""
    if isinstance(spec, str):
        return spec, {}
    if isinstance(spec, dict):
        return str(spec["id"]), dict(spec.get("kwargs") or {})
    return str(spec.id), dict(getattr(spec, "kwargs", None) or {})


def _play_episode(env_id: str, kwargs: dict, seed: int, codec: ChatCodec, max_turns: int) -> dict:
    import gymnasium

    import envs  # noqa: F401  (registers worldloop/* ids)

    env = gymnasium.make(env_id, **kwargs)
    try:
        obs, _ = env.reset(seed=seed)
        system = str(env.unwrapped.system_prompt())
        turns: list[dict] = []
        success, ended = False, True
        for t in range(max_turns):
            text, images = observation_parts(obs)
            seg = codec.encode_obs(text, images, system=system, first=t == 0, prev_response_ended=ended)
            response = str(env.unwrapped.expert_response())
            ids = codec.encode_response(response)
            turns.append(
                {"index": t, "policy_version": 0, "obs_ids": seg.ids, "response_ids": ids,
                 "logprobs": [0.0] * len(ids), "images": seg.images, "response_text": response}
            )
            obs, _, terminated, truncated, info = env.step(response)
            success = bool(info.get("success", False)) if isinstance(info, dict) else False
            if terminated or truncated:
                break
        return {"env_id": env_id, "env_kwargs": kwargs, "seed": seed, "turns": turns, "success": success}
    finally:
        env.close()


def make_demonstrations(
    env_specs: Sequence[Any], n_episodes: int, seed: int, codec: ChatCodec, max_turns: int
) -> list[dict]:
    """Play ``n_episodes`` expert episodes, cycling over ``env_specs``, seeds ``seed, seed+1, ...``."""
    if not env_specs:
        raise ValueError("make_demonstrations needs at least one env spec")
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    specs = [_spec_fields(s) for s in env_specs]
    demos = []
    for k in range(n_episodes):
        env_id, kwargs = specs[k % len(specs)]
        demos.append(_play_episode(env_id, kwargs, seed + k, codec, max_turns))
    return demos


# --------------------------------------------------------------------------- training


def _batches(demos: Sequence[dict], batch_size: int, order: Iterable[int]) -> Iterable[list[dict]]:
    order = list(order)
    for s in range(0, len(order), batch_size):
        yield [demos[i] for i in order[s : s + batch_size]]


def _batch_loss(model: torch.nn.Module, demos: list[dict], codec: ChatCodec) -> tuple[torch.Tensor, int]:
    """Mean negative log-likelihood of the response tokens of ``demos``, and their count."""
    batch = collate([build_sequence(d) for d in demos], codec)
    lp, _ = token_logprobs(model, batch)
    mask = batch["response_mask"].to(lp.device)
    n = int(mask.sum())
    return -(lp * mask).sum() / max(n, 1), n


@torch.no_grad()
def sequence_loss(model: torch.nn.Module, demos: Sequence[dict], codec: ChatCodec, batch_size: int = 8) -> float:
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
    demos: Sequence[dict],
    epochs: int,
    lr: float,
    batch_size: int,
    out_dir: str | Path | None = None,
    *,
    seed: int = 0,
    codec: ChatCodec | None = None,
    progress: Callable[[dict], None] | None = None,
) -> dict:
    """Fine-tune on the demonstrations' response tokens; save; return loss before/after etc."""
    if not demos:
        raise ValueError("run_sft needs at least one demonstration")
    if epochs < 0 or batch_size < 1 or lr <= 0:
        raise ValueError(f"need epochs >= 0, batch_size >= 1, lr > 0 (got {epochs}, {batch_size}, {lr})")
    model_dir = Path(model_dir)
    codec = codec or ChatCodec(model_dir)
    model = load_policy(model_dir, dtype="float32")
    start = time.monotonic()
    before = sequence_loss(model, demos, codec, batch_size)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    steps = tokens = 0
    for epoch in range(epochs):
        for chunk in _batches(demos, batch_size, torch.randperm(len(demos), generator=gen).tolist()):
            loss, n = _batch_loss(model, chunk, codec)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            steps, tokens = steps + 1, tokens + n
            if progress is not None:
                progress({"epoch": epoch, "step": steps, "loss": float(loss.detach())})
        log.info("sft epoch %d/%d done, %d steps", epoch + 1, epochs, steps)
    model.eval()
    after = sequence_loss(model, demos, codec, batch_size)
    _save(model, model_dir, Path(out_dir) if out_dir is not None else model_dir)
    return {"loss_before": before, "loss_after": after, "steps": steps, "epochs": epochs,
            "tokens": tokens, "seconds": time.monotonic() - start}


# --------------------------------------------------------------------------- evaluation


def answer_format_ok(text: str) -> bool:
    """``<think>...</think><answer>...</answer>`` with a non-empty answer (VAGEN's format check)."""
    m = _FORMAT.fullmatch(text)
    return bool(m and m.group(2).strip())


def format_ok_rate(
    model_dir: str | Path,
    demos: Sequence[dict],
    *,
    temperature: float = 0.7,
    top_p: float = 1.0,
    max_new_tokens: int = 96,
    seed: int = 0,
) -> float:
    """Fraction of well-formed answers sampled for the first-turn prompts of ``demos``."""
    from actor.backends import GenRequest, HFBackend

    backend = HFBackend(model_dir)
    try:
        reqs = [GenRequest(d["turns"][0]["obs_ids"], d["turns"][0]["images"]) for d in demos]
        results = backend.generate(reqs, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed)
    finally:
        backend.close()
    return float(np.mean([answer_format_ok(r.text) for r in results])) if results else 0.0


# --------------------------------------------------------------------------- worldloop up


def warm_start(cfg: Any, model_dir: str | Path, *, probe_prompts: int = 8) -> dict:
    """SFT of a freshly made model on solver demonstrations of the run's own envs (``worldloop up``).

    ``cfg.sft.episodes`` expert episodes cycle over ``cfg.actor.envs`` with seeds from the start of
    the training range (``actor.seed_start``, never the held-out eval seeds), ``actor.max_turns``
    turns each, in the envs' own prompt format, so the ``<observation>``/``<prediction>`` fields
    hold the true states. Trains in place; returns ``run_sft``'s report plus
    ``format_ok_before``/``format_ok_after``: the share of well-formed answers sampled (at the
    actor's temperature) for the first-turn prompts of ``probe_prompts`` other training seeds.
    """
    model_dir = Path(model_dir)
    s, a = cfg.sft, cfg.actor
    codec = ChatCodec(model_dir, max_image_side=cfg.model.max_image_side)
    specs = [{"id": e.id, "kwargs": dict(e.kwargs)} for e in a.envs]
    start = time.monotonic()
    demos = make_demonstrations(specs, s.episodes, a.seed_start, codec, a.max_turns)
    probes = make_demonstrations(specs, probe_prompts, a.seed_start + s.episodes, codec, 1)
    log.info("sft: %d demonstrations (%d turns) in %.1fs", len(demos), sum(len(d["turns"]) for d in demos),
             time.monotonic() - start)
    lengths = [len(t["response_ids"]) for d in demos for t in d["turns"]]
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

    report = run_sft(model_dir, demos, s.epochs, s.lr, s.batch_size, seed=cfg.run.seed, codec=codec, progress=progress)
    report.update(format_ok_before=before, format_ok_after=rate(), demonstrations=len(demos),
                  success_rate_of_demonstrations=float(np.mean([d["success"] for d in demos])),
                  answer_tokens_max=max(lengths), answers_longer_than_max_new_tokens=too_long)
    return report
