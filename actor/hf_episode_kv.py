"""Each episode's keys and values kept from one turn to the next, so that the HF decode loop's prefill
computes only what is new since the episode's last call (``actor.hf_decode: cached``).

    store = EpisodeKV(max_episodes=64)
    decode_cached(model, codec, requests, pick, store, *, max_new_tokens, masked_ids)
        -> (tokens [B, T], logits [B, T, V])      # as hf_decode.decode; store updated
    store.clear()                                  # after every weight update: old keys are not the new model's
    store.hits, .misses, .reused_tokens, .prefilled_tokens, .shared_prefills

Why: an episode's request is its whole context every turn (token-in/token-out), so the third turn
of a FrozenLake episode of the preset prefills about 1,200 tokens of which about 900 were there at
the second; on the tiny model the prefill and the images' preprocessing were 38 % of ``loop``'s time
(the 8 batched calls of 24 of the preset's episodes, timed one by one; docs/benchmarks.md "The HF
backend's decode loops").

How: after a call, each request that names its episode (``GenRequest.session``) leaves here the
keys and values of its prompt and of its response less the last token (the one never fed back),
the token ids they belong to, the images they hold, and the next rotary position. At the next
call, a request whose prompt starts with exactly those ids and images (and holds at least one more token)
prefills only the rest: its new tokens and new images, at rotary positions offset by the stored one
(Qwen2.5-VL's positions continue from the largest so far plus one, so a suffix's positions computed
on its own and shifted are the whole sequence's). Each row prefills alone: a first turn's 590
tokens would otherwise pad every later turn's 300 in the same batch, and a row with nothing stored
takes SDPA's causal kernel with no mask at all. Then the rows decode together, right-aligned (a
row's keys, zeros before them, and a mask that hides the zeros). Rows of one call with nothing stored
and the same prompt ids and images share one prefill: a GRPO group's episodes start on one level, so
the first turns of an actor's lockstep batch are one prompt (8 in the presets). The prefill of a row
is the same computation whatever the other rows are, so the shared one gives each row the bits its
own would have (``tests/test_hf_episode_kv.py``).

What changes: the same computation in another order. Keys of response tokens were computed one at a
time, and a prompt's attention runs over a split context, so log-probs differ from a full prefill's
in the last bits (at most 2e-5 in ``bench/generation.py``'s 219 turns), and a sampled token can differ where two were
almost tied: ``cached`` gives ``generate``'s distribution, not its bits (``loop`` gives both). The
learner recomputes every log-prob over the whole sequence in one pass, as for every backend.
A weight update must empty the store (:meth:`HFBackend.update_weights` does): keys computed by one
version are not another's.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch

from worldloop.actor.hf_decode import Pick, _KV, _positions, _sample, additive_mask, vision_batch


@dataclass
class _Entry:
    ids: list[int]
    keys: list[torch.Tensor]  # per layer [kv heads, len(ids), head dim]
    values: list[torch.Tensor]
    images: list[bytes]  # the PNGs the ids hold, in order
    next_pos: int  # the rotary position of the token after ids


class EpisodeKV:
    """The newest keys and values of at most ``max_episodes`` episodes (least recently used out)."""

    def __init__(self, max_episodes: int = 64):
        if max_episodes < 1:
            raise ValueError(f"max_episodes must be >= 1, got {max_episodes}")
        self.max_episodes = max_episodes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self.hits = self.misses = self.reused_tokens = self.prefilled_tokens = 0
        self.shared_prefills = 0  # rows that took an earlier row's prefill in the same call
        self.share_prefill = True  # False: every row prefills on its own (bench/generation.py's baseline)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()

    def lookup(self, session: str | None, prompt_ids: Sequence[int], images: Sequence[bytes]) -> _Entry | None:
        """The entry ``prompt_ids`` and ``images`` continue (the same ids and PNGs, and more ids), or None."""
        e = self._entries.get(session) if session is not None else None
        if (e is None or len(e.ids) >= len(prompt_ids) or len(e.images) > len(images)
                or list(prompt_ids[: len(e.ids)]) != e.ids or list(images[: len(e.images)]) != e.images):
            return None
        return e

    def store(self, session: str, entry: _Entry) -> None:
        self._entries[session] = entry
        self._entries.move_to_end(session)
        while len(self._entries) > self.max_episodes:
            self._entries.popitem(last=False)


def _new_part(model, codec, request, entry: _Entry | None) -> dict:
    """One row's batch of what ``entry`` does not hold: its new tokens and new images."""
    ids = torch.tensor([list(request.prompt_ids[len(entry.ids) if entry else 0 :])], dtype=torch.long)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if codec.is_vision:
        batch.update(vision_batch(codec, ids, list(request.images[len(entry.images) if entry else 0 :]), model.dtype))
    return batch


def _prefill_row(model, codec, request, entry: _Entry | None):
    """Prefill one row's new part after its stored keys: (logits [1, V], its cache, rotary positions
    [3, 1, 1] of its last token). Alone, so no row pads another, and a row with nothing stored takes
    SDPA's causal kernel, no mask at all."""
    from transformers import DynamicCache

    batch = _new_part(model, codec, request, entry)
    new = batch["input_ids"].shape[1]
    rope = _positions(model, batch)[1:] + (entry.next_pos if entry else 0)
    cache = DynamicCache(config=model.config)
    mask = None
    if entry is not None:
        for layer, (k, v) in enumerate(zip(entry.keys, entry.values)):
            cache.update(k.unsqueeze(0), v.unsqueeze(0), layer)
        held = len(entry.ids)
        mask = additive_mask(torch.arange(held + new).view(1, -1) <= (held + torch.arange(new)).view(-1, 1), model.dtype)[None, None]
    vision = {k: batch[k] for k in ("pixel_values", "image_grid_thw", "mm_token_type_ids") if k in batch}
    out = model(input_ids=batch["input_ids"], attention_mask={"full_attention": mask}, position_ids=rope,
                past_key_values=cache, use_cache=True, logits_to_keep=1, **vision)
    return out.logits[:, -1, :], cache, rope[:, :, -1:]


def _prefill_rows(model, codec, requests, entries: list[_Entry | None], share: bool = True) -> tuple[list, int]:
    """Each row's :func:`_prefill_row`, once per distinct (prompt ids, images) among the rows with nothing
    stored (with ``share``); the others take that row's (logits, cache, positions), which nothing after
    changes. Returns the rows and how many were shared."""
    first: dict[tuple, tuple] = {}
    rows, shared = [], 0
    for r, e in zip(requests, entries):
        key = None if e is not None or not share else (tuple(r.prompt_ids), tuple(r.images))
        if key is not None and key in first:
            rows.append(first[key])
            shared += 1
            continue
        row = _prefill_row(model, codec, r, e)
        if key is not None:
            first[key] = row
        rows.append(row)
    return rows, shared


@torch.no_grad()
def decode_cached(model, codec, requests, pick: Pick, store: EpisodeKV, *, max_new_tokens: int,
                  masked_ids: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`worldloop.actor.hf_decode.decode` for ``requests`` (``GenRequest``), prefilling only what
    ``store`` does not hold, one row at a time (one prefill for identical new rows); then all rows decode
    together, right-aligned. Leaves each named episode's keys and values in ``store``. CPU only."""
    entries = [store.lookup(r.session, r.prompt_ids, r.images) for r in requests]
    rows, shared = _prefill_rows(model, codec, requests, entries, store.share_prefill)
    store.shared_prefills += shared
    kv, real = _KV.right_aligned([c for _, c, _ in rows], max_new_tokens)
    width = kv.length
    tokens, raw = _sample(model, torch.cat([lg for lg, _, _ in rows]), torch.cat([p for _, _, p in rows], dim=1),
                          None if bool(real.all()) else real, kv, pick, max_new_tokens=max_new_tokens,
                          eos_token_ids=codec.eos_token_ids, pad_token_id=codec.pad_token_id, masked_ids=masked_ids)
    store.hits += sum(e is not None for e in entries)
    store.misses += sum(e is None for e in entries)
    store.reused_tokens += sum(len(e.ids) for e in entries if e is not None)
    store.prefilled_tokens += sum(len(r.prompt_ids) - (len(e.ids) if e else 0) for r, e in zip(requests, entries))
    eos = set(codec.eos_token_ids)
    for i, r in enumerate(requests):
        if r.session is None:
            continue
        row = tokens[i].tolist()
        n = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
        keep = n - 1  # the last token was never fed back: it has no keys yet
        span = slice(width - len(r.prompt_ids), width + keep)
        store.store(r.session, _Entry(ids=list(r.prompt_ids) + row[:keep],
                                      keys=[buf[i, :, span].clone() for buf in kv.keys],
                                      values=[buf[i, :, span].clone() for buf in kv.values],
                                      images=list(r.images), next_pos=int(rows[i][2][0, 0, 0]) + n))
    return tokens, raw
