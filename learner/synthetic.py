"""Schema-valid trajectories built from a :class:`worldloop.common.modeling.ChatCodec`, for tests and benches.

Public API::

    synthetic_trajectory(codec, *, trajectory_id, turns=2, response_tokens=12, image_side=56,
                         policy_version=0, env_name="sokoban", seed=0, group_id=None,
                         env_reward=1.0, format_reward=0.5, reasoning_reward=None,
                         success=False, logprobs=None) -> Trajectory

The token layout is exactly the actors' (``ChatCodec.encode_obs`` for every turn, the first with a
system prompt, every user message with one ``<image>`` when the model is a vision model), the
responses are ``response_tokens`` ordinary vocabulary tokens plus ``<|im_end|>``, and the behaviour
log-probs are ``log(1/1024)`` unless ``logprobs`` gives a callable ``(turn_index, response_ids) ->
list[float]`` (tests pass the model's own log-probs there so that the importance weight is known).
The result passes :func:`worldloop.common.schemas.check_trajectory` (and encodes).

    behaviour_logprobs_from(model, codec, temperature) -> callable for ``logprobs=``
    tiny_learner_config(model_dir, redis_url, run_dir, namespace="wl", **trainer) -> Config
    train_until_stopped(cfg, trajectories) -> (Learner, int)

``behaviour_logprobs_from`` scores each response with a Hugging Face model under the actors'
log-prob convention (``worldloop.common.modeling.token_logprobs`` at ``temperature``), i.e. what an actor
running that model would have recorded. ``tiny_learner_config`` is a CPU-sized learner config
(small batches, metrics server off, ephemeral weight ports) for tests and the CPU bench smoke run.
``train_until_stopped`` puts trajectories into that config's ``scored`` stream and runs a learner's
loop until it stops by itself (total_steps, time_limit_s), then closes it.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import numpy as np

from worldloop.common.config import Config, config_from_dict
from worldloop.common.modeling import IMAGE_PLACEHOLDER, ChatCodec, collate, token_logprobs
from worldloop.common.schemas import TRAJECTORY_SCHEMA, State, Trajectory, Turn


def _state(step: int) -> State:
    return State(relations=[f"box0 is above the player (step {step})"], symbolic=None, structured={})


def synthetic_trajectory(
    codec: ChatCodec,
    *,
    trajectory_id: str,
    turns: int = 2,
    response_tokens: int = 12,
    image_side: int = 56,
    policy_version: int | list[int] = 0,
    env_name: str = "sokoban",
    seed: int = 0,
    group_id: str | None = None,
    env_reward: float = 1.0,
    format_reward: float = 0.5,
    reasoning_reward: float | None = None,
    success: bool = False,
    logprobs: Callable[[int, list[int], list[int], list[bytes]], list[float]] | None = None,
    filler_tokens: int = 0,
) -> Trajectory:
    """One episode of ``turns`` turns (see the module docstring).

    ``policy_version`` may be one int for every turn or a list, one per turn. ``logprobs``, when
    given, is called as ``logprobs(turn, context_ids, response_ids, images_so_far)``.
    ``filler_tokens`` ordinary tokens are added to every observation (long sequences for benches).
    """
    if turns < 1 or response_tokens < 1:
        raise ValueError("turns and response_tokens must be >= 1")
    versions = list(policy_version) if isinstance(policy_version, (list, tuple)) else [policy_version] * turns
    if len(versions) != turns:
        raise ValueError(f"{len(versions)} policy versions for {turns} turns")
    rng = np.random.default_rng(seed)
    # plain tokens come after every special one (prompt-only tokens are never sampled by an actor)
    vocab, first_plain = len(codec.tokenizer), max(*codec.prompt_only_ids, codec.im_end_id) + 1
    context: list[int] = []
    images_so_far: list[bytes] = []
    out_turns: list[Turn] = []
    for t in range(turns):
        seg = _observation(codec, rng, t, seed, image_side, filler_tokens, first_plain, vocab)
        response = [int(x) for x in rng.integers(first_plain, vocab, response_tokens)] + [codec.im_end_id]
        context += seg.ids
        images_so_far += seg.images
        lps = logprobs(t, list(context), response, list(images_so_far)) if logprobs else [math.log(1 / 1024)] * len(response)
        context += response
        out_turns.append(_turn(codec, t, int(versions[t]), seg, response, lps, last=t == turns - 1, success=success,
                               env_reward=env_reward, format_reward=format_reward, reasoning_reward=reasoning_reward))
    return Trajectory(
        schema=TRAJECTORY_SCHEMA,
        trajectory_id=trajectory_id,
        group_id=group_id or trajectory_id,
        env_id=f"worldloop/{env_name.capitalize()}-v0",
        env_name=env_name,
        env_kwargs={}, seed=int(seed), actor_id="synthetic", created_at=time.time(),
        prompt_format="grounding_worldmodeling", max_turns=turns, turns=out_turns, success=bool(success),
        scored=reasoning_reward is not None,
    )


def _observation(codec: ChatCodec, rng, t: int, seed: int, image_side: int, filler_tokens: int, first_plain: int,
                 vocab: int):
    """Turn ``t``'s observation segment: one random image on a vision model, ``filler_tokens``
    ordinary tokens at the end of the user message (before its ``<|im_end|>``)."""
    image = rng.integers(0, 256, (image_side, image_side, 3), dtype=np.uint8) if codec.is_vision else None
    text = f"[Observation {t}]:\n{IMAGE_PLACEHOLDER}\nDecide your next action." if image is not None else f"[Observation {t}]: room {seed}"
    seg = codec.encode_obs(text, [image] if image is not None else [], system="You are a test agent." if t == 0 else None, first=t == 0)
    if filler_tokens:
        at = len(seg.ids) - 1 - seg.ids[::-1].index(codec.im_end_id)
        seg.ids[at:at] = [int(x) for x in rng.integers(first_plain, vocab, filler_tokens)]
    return seg


def _turn(codec: ChatCodec, t: int, version: int, seg, response: list[int], lps, *, last: bool, success: bool,
          env_reward: float, format_reward: float, reasoning_reward: float | None) -> Turn:
    return Turn(
        index=t,
        policy_version=version,
        obs_ids=seg.ids,
        response_ids=response,
        logprobs=[float(x) for x in lps],
        images=seg.images,
        response_text=codec.decode(response),
        observation="box0 is above the player",
        reasoning="push it",
        prediction="box0 is on the target",
        actions=["Up"],
        format_ok=True,
        env_reward=float(env_reward),
        format_reward=float(format_reward),
        done=last,
        success=bool(success and last),
        state_before=_state(t),
        state_after=_state(t + 1),
        actions_total=1,
        actions_effective=1,
        truncated_response=False,
        reasoning_reward=reasoning_reward,
    )


def behaviour_logprobs_from(model, codec: ChatCodec, temperature: float) -> Callable:
    """A ``logprobs=`` callable: the response's log-probs under ``model`` given the context."""
    import torch

    def score(turn: int, context: list[int], response: list[int], images: list[bytes]) -> list[float]:
        from worldloop.common.modeling import SequenceLayout

        ids = torch.tensor(context + response)
        zeros = torch.zeros(len(ids))
        layout = SequenceLayout(ids, zeros, zeros, torch.full((len(ids),), -1), zeros, torch.full((len(ids),), -1),
                                [0], [(len(context), len(ids))], list(images))
        with torch.no_grad():
            lp, _ = token_logprobs(model, collate([layout], codec), temperature=temperature,
                                   masked_ids=codec.prompt_only_ids)
        return lp[0, len(context) : len(ids)].tolist()

    return score


def tiny_learner_config(model_dir, redis_url: str, run_dir, namespace: str = "wl", max_image_side: int = 112,
                        **trainer) -> Config:
    """A learner config for the tiny model on CPU: 4 trajectories per update, 2 per mini-batch."""
    base = {"train_batch_size": 4, "ppo_mini_batch_size": 2, "micro_batch_size": 1, "total_steps": 2,
            "checkpoint_every": 2, "actor_lr": 1e-3, "critic_lr": 1e-3, "device": "cpu"}
    base.update(trainer)
    return config_from_dict({
        "run": {"run_dir": str(run_dir)},
        "redis": {"url": redis_url, "namespace": namespace, "block_ms": 200},
        "model": {"path": str(model_dir), "max_image_side": max_image_side, "make_tiny_if_missing": False},
        "metrics": {"enabled": False},
        "weights": {"pub_port": 0, "fetch_port": 0},
        "trainer": base,
    })


def train_until_stopped(cfg: Config, trajectories) -> tuple:
    """Add ``trajectories`` to ``cfg``'s ``scored`` stream, run ``Learner.run_loop`` and close the
    learner; returns ``(learner, run_loop's exit code)`` (the learner closed, its state readable)."""
    from worldloop.common.keys import Keys
    from worldloop.common.schemas import encode_trajectory
    from worldloop.common.streams import StreamProducer
    from worldloop.learner.engine import init_distributed
    from worldloop.learner.process import Learner

    prod = StreamProducer(cfg.redis.url, Keys(cfg.redis.namespace).scored, 100)
    for t in trajectories:
        prod.add(encode_trajectory(t))
    learner = Learner(cfg, init_distributed(cfg))
    try:
        rc = learner.run_loop()
    finally:
        learner.close()
    return learner, rc
