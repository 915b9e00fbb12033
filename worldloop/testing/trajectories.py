"""Every synthetic trajectory of the tests and benches: one module, outside the roles.

Two builders of ``worldloop.trajectory/1`` messages:

    make_turn(index, n_resp=3) -> Turn / make_trajectory(tid="t-1", turns=2) -> Trajectory
        fixed small messages that need no model (stream, schema, judge and admission tests);
    one_turn_trajectory(obs_ids, response_ids, images=None, logprobs=None) -> Trajectory
        a one-turn message holding exactly the given token ids;
    synthetic_trajectory(codec, *, trajectory_id, turns=2, response_tokens=12, image_side=56,
                         policy_version=0, env_name="sokoban", seed=0, group_id=None,
                         env_reward=1.0, format_reward=0.5, reasoning_reward=None,
                         success=False, logprobs=None, filler_tokens=0) -> Trajectory
        a token-exact episode built from a :class:`worldloop.common.contracts.modeling.ChatCodec`;
    behaviour_logprobs_from(model, codec, temperature) -> callable for ``logprobs=``

``synthetic_trajectory``'s token layout is exactly the actors' (``ChatCodec.encode_obs`` for every
turn, the first with a system prompt, every user message with one ``<image>`` when the model is a
vision model), the responses are ``response_tokens`` ordinary vocabulary tokens plus
``<|im_end|>``, and the behaviour log-probs are ``log(1/1024)`` unless ``logprobs`` gives a callable
``(turn_index, context_ids, response_ids, images_so_far) -> list[float]`` (tests pass the model's
own log-probs there, from ``behaviour_logprobs_from``, so that the importance weight is known).
Every result passes :func:`worldloop.common.contracts.schemas.check_trajectory` (and encodes).
The learner harness that trains on them is ``worldloop.testing.learner``.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import numpy as np

from worldloop.common.contracts.modeling import IMAGE_PLACEHOLDER, ChatCodec, collate, token_logprobs
from worldloop.common.contracts.schemas import TRAJECTORY_SCHEMA, State, Trajectory, Turn, empty_state


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
    """One token-exact episode of ``turns`` turns (see the module docstring).

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
        from worldloop.common.contracts.modeling import SequenceLayout

        ids = torch.tensor(context + response)
        zeros = torch.zeros(len(ids))
        layout = SequenceLayout(ids, zeros, zeros, torch.full((len(ids),), -1), zeros, torch.full((len(ids),), -1),
                                [0], [(len(context), len(ids))], list(images))
        with torch.no_grad():
            lp, _ = token_logprobs(model, collate([layout], codec), temperature=temperature,
                                   masked_ids=codec.prompt_only_ids)
        return lp[0, len(context) : len(ids)].tolist()

    return score


# ---------------------------------------------------------------- fixed small messages
def make_turn(index: int, n_resp: int = 3) -> Turn:
    return Turn(
        index=index,
        policy_version=2,
        obs_ids=[1, 2, 3, 4],
        response_ids=list(range(10, 10 + n_resp)),
        logprobs=[-0.5] * n_resp,
        images=[b"\x89PNG fake"],
        response_text="<think>...</think><answer>Up</answer>",
        observation="the box is left of the player",
        reasoning=None,
        prediction="the player moves up",
        actions=["Up"],
        format_ok=True,
        env_reward=-0.1,
        format_reward=0.5,
        done=False,
        success=False,
        state_before=empty_state(),
        state_after=State(relations=["box left of player"], symbolic="#P#", structured={"player": [1, 2]}),
        actions_total=1,
        actions_effective=1,
    )


def make_trajectory(tid: str = "t-1", turns: int = 2) -> Trajectory:
    """A valid worldloop.trajectory/1 message (used by the stream tests too)."""
    return Trajectory(
        schema=TRAJECTORY_SCHEMA,
        trajectory_id=tid,
        group_id="g-1",
        env_id="worldloop/Sokoban-v0",
        env_name="sokoban",
        env_kwargs={"dim_room": [6, 6]},
        seed=7,
        actor_id="a-1",
        created_at=1.5,
        prompt_format="grounding_worldmodeling",
        max_turns=3,
        turns=[make_turn(i) for i in range(turns)],
        success=False,
        scored=False,
    )


def one_turn_trajectory(obs_ids: list[int], response_ids: list[int], images: list[bytes] | None = None,
                        logprobs: list[float] | None = None) -> Trajectory:
    """A valid one-turn trajectory holding exactly these token ids (and images): what a test that
    scores or trains on given ids needs."""
    import msgspec

    turn = msgspec.structs.replace(make_turn(0, n_resp=len(response_ids)), policy_version=0, obs_ids=list(obs_ids),
                                   response_ids=list(response_ids), images=list(images or []),
                                   logprobs=list(logprobs) if logprobs is not None else [0.0] * len(response_ids))
    return msgspec.structs.replace(make_trajectory(turns=0), turns=[turn])
