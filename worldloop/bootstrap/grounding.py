"""Grounding pre-training of the embedded tiny model: learn to describe a board from its image.

Public API::

    grounding_examples(env_specs, n, seed_start, codec, prompt="image") -> list[GroundingExample]
    grounding_accuracy(model, examples, codec, batch_size=64) -> dict
    answer_loss(model, examples, codec) -> torch.Tensor
    grounding_pretrain(model_dir, env_specs, steps, *, seed_start, max_image_side, batch_size=32,
                       lr=3e-3, seed=0, freeze_vision=True, eval_boards=128, progress=None,
                       agent_every=0, agent_batch_size=8, prompt="image") -> dict

A pretrained vision-language model arrives able to say what is where in an image; the tiny model
made on the spot does not, and a few hundred SFT demonstrations do not teach it (docs/learning-history.md
"Why the tiny model could not see"). So before SFT, ``worldloop up`` trains the newly made model
(:func:`worldloop.bootstrap.pipeline.ground` reads the config and calls :func:`grounding_pretrain`)
on the cheapest grounding task the run's own envs give for free: the first-turn image of a fresh
level followed by the answer prefix ``<think><observation>{the true state, as the env describes
it}</observation>``: exactly the text an ``<observation>`` is judged against. Loss on those answer
tokens only. The user turn is, by ``prompt``: "image", the image alone; "observation", the env's
first observation (its text and image, no system prompt); "agent", the actors' full first turn
(system prompt included). A model trained on the short prompts alone does not carry the skill into
the actors' long prompt, so ``worldloop up`` uses "observation" and every ``agent_every``-th step
a smaller batch in the "agent" form. The levels are new every step (``seed_start``,
``seed_start + 1``, ...; the config checks the range is disjoint from the RL, demonstration and
held-out seeds), so it cannot memorise them.

Nothing of the policy is taught: no action, no reasoning, no prediction. The warm start (SFT) and
RL still have everything to learn about acting; this stage only makes the image readable.

``grounding_accuracy`` reads the model greedily (teacher-forced argmax) on held-out boards and
returns ``first`` (the share of boards whose first described relation is right token for token:
the goal in FrozenLake, the box in Sokoban), ``exact`` (the whole description right) and
``token`` (the share of answer tokens right).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from worldloop.common.contracts.modeling import ChatCodec, SequenceLayout, collate, freeze_vision_tower, load_policy, model_inputs
from worldloop.envs.base import move_outlook_of, observation_parts

PROMPT = "<image>"  # the image alone: the user turn of a pretraining example


@dataclass
class GroundingExample:
    prompt_ids: list[int]
    images: list[bytes]
    answer_ids: list[int]
    first_len: int  # answer tokens up to the end of the first described sentence

    def layout(self) -> SequenceLayout:
        ids = self.prompt_ids + self.answer_ids
        n, k = len(ids), len(self.prompt_ids)
        return SequenceLayout(
            input_ids=torch.tensor(ids, dtype=torch.long),
            response_mask=torch.tensor([0.0] * k + [1.0] * (n - k)),
            turn_end_mask=torch.zeros(n),
            turn_index=torch.full((n,), -1, dtype=torch.long),
            behaviour_logprobs=torch.zeros(n),
            policy_version=torch.full((n,), -1, dtype=torch.long),
            turn_policy_version=[0],
            turn_spans=[(k, n)],
            images=list(self.images),
        )


def _spec(spec: Any) -> tuple[str, dict]:
    if isinstance(spec, dict):
        return str(spec["id"]), dict(spec.get("kwargs") or {})
    return str(spec.id), dict(getattr(spec, "kwargs", None) or {})


def grounding_examples(env_specs: Sequence[Any], n: int, seed_start: int, codec: ChatCodec,
                       _envs: dict | None = None, prompt: str = "image", outlook: bool = False) -> list[GroundingExample]:
    """``n`` examples cycling over ``env_specs`` on seeds ``seed_start, seed_start + 1, ...``;
    ``prompt`` "image": the image alone in the user turn (Qwen's default system turn); "agent": the
    env's own first turn (its system prompt and observation text), as the actors send it.
    ``outlook``: the answer goes on into ``<reasoning>{the env's move_outlook()}</reasoning>``, what
    the agent writes there with ``sft.concise_reasoning: outlook``."""
    import gymnasium

    from worldloop import envs  # noqa: F401  (registers worldloop/* ids)

    if not env_specs:
        raise ValueError("grounding_examples needs at least one env spec")
    specs = [_spec(s) for s in env_specs]
    cache = _envs if _envs is not None else {}
    out = []
    for k in range(n):
        key = k % len(specs)
        env_id, kwargs = specs[key]
        env = cache.get(key)
        if env is None:
            env = cache[key] = gymnasium.make(env_id, **kwargs)
        obs, info = env.reset(seed=seed_start + k)
        text, images = observation_parts(obs)
        if not images:
            raise ValueError(f"{env_id} gives no image: grounding pre-training needs render_mode vision")
        if prompt in ("agent", "observation"):
            system = str(env.unwrapped.system_prompt()) if prompt == "agent" else None
            seg = codec.encode_obs(text, images, system=system, first=True)
        else:
            seg = codec.encode_obs(PROMPT, images[:1], system=None, first=True)
        state = info["state"]
        truth = str(env.unwrapped.describe_state(state))
        rel = list(state.get("relations") or [])
        tail = f"<reasoning>{move_outlook_of(env, env_id)}</reasoning>" if outlook else ""
        answer = codec.encode_response(f"<think><observation>{truth}</observation>{tail}", eos=False)
        first = codec.encode_response(f"<think><observation>{rel[0]}" if rel else "", eos=False)
        first_len = len(first) if rel and answer[: len(first)] == first else len(answer)
        out.append(GroundingExample(seg.ids, seg.images, answer, first_len))
    if _envs is None:
        for env in cache.values():
            env.close()
    return out


def _forward(model: torch.nn.Module, examples: Sequence[GroundingExample], codec: ChatCodec) -> tuple[dict, torch.Tensor]:
    """The collated batch of ``examples`` and the backbone's last hidden states (no LM head: callers
    apply it where they need logits)."""
    batch = collate([e.layout() for e in examples], codec)
    p = next(model.parameters())
    return batch, model.model(**model_inputs(batch, p.device, p.dtype), use_cache=False).last_hidden_state


@torch.no_grad()
def grounding_accuracy(model: torch.nn.Module, examples: Sequence[GroundingExample], codec: ChatCodec,
                       batch_size: int = 64) -> dict:
    """Teacher-forced greedy accuracy on ``examples`` (see the module docstring)."""
    was_training = model.training
    model.eval()
    first = exact = right = total = 0
    for s in range(0, len(examples), batch_size):
        chunk = list(examples[s : s + batch_size])
        batch, hidden = _forward(model, chunk, codec)
        pred = model.get_output_embeddings()(hidden[:, :-1]).argmax(-1).cpu()
        target = batch["input_ids"][:, 1:]
        for i, e in enumerate(chunk):
            k = len(e.prompt_ids) - 1  # prediction of answer token j sits at k + j
            ok = (pred[i, k : k + len(e.answer_ids)] == target[i, k : k + len(e.answer_ids)])
            right += int(ok.sum())
            total += len(e.answer_ids)
            exact += int(bool(ok.all()))
            first += int(bool(ok[: e.first_len].all()))
    model.train(was_training)
    n = max(len(examples), 1)
    return {"first": first / n, "exact": exact / n, "token": right / max(total, 1), "boards": len(examples)}


def answer_loss(model: torch.nn.Module, examples: Sequence[GroundingExample], codec: ChatCodec) -> torch.Tensor:
    """Mean cross-entropy of the answer tokens; the LM head runs on the answer positions only (the
    prompt, most of each sequence, needs no logits)."""
    batch, hidden = _forward(model, examples, codec)
    mask = batch["response_mask"][:, 1:].to(hidden.device) > 0  # position i predicts token i + 1
    logits = model.get_output_embeddings()(hidden[:, :-1][mask]).float()
    return torch.nn.functional.cross_entropy(logits, batch["input_ids"][:, 1:].to(hidden.device)[mask])


def grounding_pretrain(
    model_dir: str | Path,
    env_specs: Sequence[Any],
    steps: int,
    *,
    seed_start: int,
    max_image_side: int,
    batch_size: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
    freeze_vision: bool = True,
    eval_boards: int = 128,
    progress: Callable[[dict], None] | None = None,
    agent_every: int = 0,
    agent_batch_size: int = 8,
    prompt: str = "image",
    outlook: bool = False,
) -> dict:
    """Train the model in ``model_dir`` in place for ``steps`` AdamW steps (``batch_size`` fresh
    levels each, 50 warm-up steps, gradient norm clipped at 1); return
    ``{"steps", "batch_size", "lr", "seconds", "loss", "before", "after", "before_agent",
    "after_agent"}``: :func:`grounding_accuracy` on ``eval_boards`` levels played after the training
    ones (``seed_start + steps * batch_size`` on), in the ``prompt`` form and in the "agent" form.
    ``progress`` gets ``{"step", "steps", "loss"}`` after every step; ``outlook``: the answers go on
    into the env's move outlook (:func:`grounding_examples`)."""
    if steps < 1 or batch_size < 1 or lr <= 0:
        raise ValueError(f"need steps >= 1, batch_size >= 1, lr > 0 (got {steps}, {batch_size}, {lr})")
    model_dir = Path(model_dir)
    codec = ChatCodec(model_dir, max_image_side=max_image_side)
    model = load_policy(model_dir, dtype="float32")
    if freeze_vision:
        freeze_vision_tower(model)
    start = time.monotonic()
    envs: dict = {}

    def examples(n: int, first_seed: int, form: str) -> list[GroundingExample]:
        return grounding_examples(env_specs, n, first_seed, codec, envs, prompt=form, outlook=outlook)

    def batch(step: int) -> list[GroundingExample]:
        if agent_every and step % agent_every == agent_every - 1:
            return examples(agent_batch_size, seed_start + step * batch_size, "agent")
        return examples(batch_size, seed_start + step * batch_size, prompt)

    try:
        eval_seed = seed_start + steps * batch_size
        held = (examples(eval_boards, eval_seed, prompt), examples(eval_boards, eval_seed, "agent"))
        before, before_agent = _held_out_accuracy(model, held, codec)
        loss_value = _fit(model, batch, codec, steps, lr, seed, progress)
    finally:
        for env in envs.values():
            env.close()
    after, after_agent = _held_out_accuracy(model, held, codec)
    model.save_pretrained(str(model_dir), safe_serialization=True)
    return {"steps": steps, "batch_size": batch_size, "lr": lr, "seconds": time.monotonic() - start,
            "before": before, "after": after, "before_agent": before_agent, "after_agent": after_agent,
            "loss": loss_value}


def _held_out_accuracy(model: torch.nn.Module, held: tuple[list, list], codec: ChatCodec) -> tuple[dict, dict]:
    """:func:`grounding_accuracy` on the held-out boards in the trained prompt form and in the actors'
    "agent" form (long prompts: smaller batches)."""
    return grounding_accuracy(model, held[0], codec), grounding_accuracy(model, held[1], codec, batch_size=16)


def _fit(model: torch.nn.Module, batch: Callable[[int], list[GroundingExample]], codec: ChatCodec, steps: int,
         lr: float, seed: int, progress: Callable[[dict], None] | None) -> float:
    """``steps`` AdamW steps on :func:`answer_loss` of ``batch(step)`` (50 warm-up steps, gradient
    norm clipped at 1) of the trainable parameters; leaves the model in eval mode and returns the
    last step's loss."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warmup = min(50, steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / warmup))
    torch.manual_seed(seed)
    model.train()
    loss_value = float("nan")
    for step in range(steps):
        loss = answer_loss(model, batch(step), codec)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        loss_value = float(loss.detach())
        if progress is not None:
            progress({"step": step + 1, "steps": steps, "loss": loss_value})
    model.eval()
    return loss_value
