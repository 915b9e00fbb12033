"""Micro-batches of the learner: which trajectories share a forward, and how they are laid out.

Public API::

    PAD_TO                                               # default multiple of a micro-batch's length
    token_budget_micro_batches(rows, lengths, budget, pad_to=8) -> list[list[int]]   # padded rows
    packed_micro_batches(rows, lengths, budget, pad_to=8) -> list[list[int]]         # packed rows
    split_micro_batches(micro_batches, lengths, n, pad_to=8, packed=False) -> list[list[int]]
    auto_budget(lengths, micro_batch_size, pad_to) -> int   # micro_batch_tokens auto on CPU
    slots(rows, lengths, pad_to, packed=False) -> int    # token slots a micro-batch computes
    image_patch_rows(batch, image_counts) -> [(patch start, end, image start, end)] per row
    micro_slices(batch, rows, image_counts, pad_to=8) -> dict          # padded [len(rows), L]
    rope_positions(model, batch) -> [B, L, 3] long | None    # Qwen2.5-VL M-RoPE ids, row by row
    packed_slices(batch, rows, image_counts, lengths, pad_to=8) -> dict  # one packed row [1, T]
    place(dst, mb, rows, values)                         # a micro-batch's [*, T] values into [B, L]

Two layouts (``trainer.packing``)
---------------------------------
*Padded* (``packing: false``): a micro-batch is ``len(rows)`` rows, each right-padded to the
longest (rounded up to ``pad_to``), with an attention mask. Its cost is rows x longest.

*Packed* (``packing: true``, the default): a micro-batch is ONE row, the whole trajectories laid
end to end (each trajectory's real tokens only) and right-padded once to a multiple of
``pad_to``; no attention mask. What keeps the trajectories apart:

* position ids restart at 0 at every trajectory. For Qwen2.5-VL they are ``[4, 1, T]``: row 0 the
  text positions (restarting), rows 1-3 the 3D M-RoPE ids, computed for each trajectory alone by
  the model's own ``get_rope_index`` (so an image's temporal/height/width ids depend only on its
  own trajectory: :func:`rope_positions`, once per update on the collated batch) and
  concatenated. Text-only models get ``[1, T]``;
* the first position of each trajectory (``seq_start``) is never a log-prob, entropy or value
  position: a token's log-prob is read from the hidden state before it, which at a trajectory's
  start belongs to the previous trajectory. The padded layout gives 0 there (position 0), and so
  does the packed one (``logprob_mask`` is cleared there, the critic zeroes its values);
* the tail padding forms a "trajectory" of its own (positions 0, 1, ...), every mask 0;
* attention stays within each trajectory by its boundaries (``segments``): the learner's models
  run learner/varlen.py, which costs each trajectory its own length squared and builds no mask.

Packed micro-batches are planned by first-fit decreasing on real token counts: the rows sorted
longest first, each into the first micro-batch it fits (sum of lengths, rounded up to ``pad_to``,
within the budget), so padding is at most ``pad_to - 1`` slots per micro-batch. With a budget of
0 (``micro_batch_tokens: 0``) the fixed groups of ``micro_batch_size`` rows are each packed into
one row. The loss functions are elementwise over masks and weighted sums, so they run on either
layout; :func:`place` puts a micro-batch's per-token values (proximal / reference log-probs,
values) back into the update's [B, L] tensors.
"""

from __future__ import annotations

import inspect

import torch

from worldloop.common.contracts.logprobs import segments_of

PAD_TO = 8  # the default multiple micro-batch lengths are rounded up to (trainer.pad_to_multiple)
_SPANS = ("pixel_values", "image_grid_thw", "image_keys")


def _padded(n: int, pad_to: int) -> int:
    return -(-int(n) // pad_to) * pad_to


def slots(rows: list[int], lengths, pad_to: int, packed: bool = False) -> int:
    """Token slots a micro-batch of ``rows`` computes: packed, the sum of their lengths rounded up
    to ``pad_to``; padded, rows x longest, rounded up to ``pad_to``."""
    if not rows:
        return 0
    if packed:
        return _padded(sum(int(lengths[r]) for r in rows), pad_to)
    return len(rows) * _padded(max(int(lengths[r]) for r in rows), pad_to)


def token_budget_micro_batches(rows: list[int], lengths, budget: int, pad_to: int = PAD_TO) -> list[list[int]]:
    """``rows`` (indices into ``lengths``) split into padded micro-batches of at most ``budget``
    token slots (rows x longest, rounded up to ``pad_to``), longest rows first; ties keep the order
    of ``rows``. A row longer than the budget forms a micro-batch of its own."""
    order = sorted(rows, key=lambda r: -int(lengths[r]))  # stable: ties in the given order
    out: list[list[int]] = []
    cur: list[int] = []
    width = 0
    for r in order:
        if cur and (len(cur) + 1) * width > budget:
            out.append(cur)
            cur = []
        if not cur:
            width = _padded(lengths[r], pad_to)  # the longest of this micro-batch (sorted)
        cur.append(r)
    if cur:
        out.append(cur)
    return out


def packed_micro_batches(rows: list[int], lengths, budget: int, pad_to: int = PAD_TO) -> list[list[int]]:
    """``rows`` packed first-fit decreasing into micro-batches whose summed length, rounded up to
    ``pad_to``, stays within ``budget``; a row longer than the budget goes alone. Rows keep the
    longest-first order inside each micro-batch (ties in the order of ``rows``)."""
    order = sorted(rows, key=lambda r: -int(lengths[r]))
    out: list[list[int]] = []
    used: list[int] = []
    for r in order:
        n = int(lengths[r])
        for i, total in enumerate(used):
            if _padded(total + n, pad_to) <= budget:
                out[i].append(r)
                used[i] += n
                break
        else:
            out.append([r])
            used.append(n)
    return out


def auto_budget(lengths, micro_batch_size: int, pad_to: int) -> int:
    """``micro_batch_tokens: auto`` on CPU: ``micro_batch_size`` rows of the longest length (padded)."""
    return int(micro_batch_size) * _padded(max(int(n) for n in lengths), pad_to)


def split_micro_batches(micro_batches: list[list[int]], lengths, n: int, pad_to: int = PAD_TO,
                        packed: bool = False) -> list[list[int]]:
    """``micro_batches`` split until there are ``n`` of them (every rank must run as many as the
    rank with the most): the one with the most token slots among those of 2+ rows is halved
    (first half first), repeatedly. ValueError when ``n`` exceeds the number of rows."""
    out = [list(m) for m in micro_batches]
    if n > sum(len(m) for m in out):
        raise ValueError(f"cannot make {n} micro-batches of {sum(len(m) for m in out)} rows")
    while len(out) < n:
        i = max((j for j in range(len(out)) if len(out[j]) > 1), key=lambda j: (slots(out[j], lengths, pad_to, packed), -j))
        m = out[i]
        out[i : i + 1] = [m[: (len(m) + 1) // 2], m[(len(m) + 1) // 2 :]]
    return out


# --------------------------------------------------------------------------- padded rows


def image_patch_rows(batch: dict[str, torch.Tensor], image_counts: list[int]) -> list[tuple[int, int, int, int]]:
    """Per sequence, the (start, end) rows of ``pixel_values`` and image index range."""
    grid = batch.get("image_grid_thw")
    spans = []
    img = patch = 0
    patches = grid.prod(-1).tolist() if grid is not None else []
    for n in image_counts:
        p = int(sum(patches[img : img + n]))
        spans.append((patch, patch + p, img, img + n))
        img += n
        patch += p
    return spans


def _images_of(batch: dict[str, torch.Tensor], rows: list[int], image_counts: list[int]) -> dict:
    """``pixel_values`` / ``image_grid_thw`` of ``rows``, in row order, ``image_ids`` (each image's
    index in the collated batch) and, where the batch has them, ``image_keys`` (the index of the
    batch's first image with the same PNG bytes): tuples, the keys of learner/vision.py's cache;
    {} without images."""
    if "pixel_values" not in batch:
        return {}
    spans = image_patch_rows(batch, image_counts)
    pix = [batch["pixel_values"][spans[r][0] : spans[r][1]] for r in rows]
    grid = [batch["image_grid_thw"][spans[r][2] : spans[r][3]] for r in rows]
    if not sum(x.shape[0] for x in pix):
        return {}
    ids = tuple(i for r in rows for i in range(spans[r][2], spans[r][3]))
    out = {"pixel_values": torch.cat(pix), "image_grid_thw": torch.cat(grid), "image_ids": ids}
    if "image_keys" in batch:
        keys = batch["image_keys"].tolist()
        out["image_keys"] = tuple(keys[i] for i in ids)
    return out


def micro_slices(batch: dict[str, torch.Tensor], rows: list[int], image_counts: list[int], pad_to: int = 8) -> dict[str, torch.Tensor]:
    """Rows ``rows`` of a collated batch, trimmed to their longest sequence, images kept with them."""
    idx = torch.tensor(rows, dtype=torch.long)
    length = int(batch["attention_mask"][idx].sum(1).max())
    length = min(batch["attention_mask"].shape[1], -(-length // pad_to) * pad_to)
    out = {k: v[idx, :length] for k, v in batch.items() if k not in _SPANS and v.dim() == 2}
    out.update(_images_of(batch, rows, image_counts))
    return _with_positions(out)


def _with_positions(mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``logprob_rows`` / ``logprob_cols``: where ``logprob_mask[:, 1:]`` is set, found here on the
    host so that the forward needs no device ``nonzero`` (common/contracts/logprobs.py ``positions``)."""
    if "logprob_mask" in mb:
        mb["logprob_rows"], mb["logprob_cols"] = (mb["logprob_mask"][:, 1:] != 0).nonzero(as_tuple=True)
    return mb


# --------------------------------------------------------------------------- packed rows


def _rope_index_fn(model: torch.nn.Module):
    """The model's ``get_rope_index`` (on it or its inner ``.model``), None for a text-only model."""
    inner = getattr(model, "module", model)
    for m in (inner, getattr(inner, "hf", None), getattr(inner, "model", None),
              getattr(getattr(inner, "hf", None), "model", None)):
        fn = getattr(m, "get_rope_index", None) if m is not None else None
        if fn is not None:
            return fn
    return None


@torch.no_grad()
def rope_positions(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """Qwen2.5-VL's 3D M-RoPE position ids of every row of a collated (padded) batch, [B, L, 3]
    long on the batch's device, each row computed from its own tokens and images by the model's
    ``get_rope_index`` (the ids the padded forward uses); None for a model without M-RoPE."""
    fn = _rope_index_fn(model)
    if fn is None:
        return None
    if "mm_token_type_ids" not in batch:  # an M-RoPE model on text-only rows: 3 x the text positions, so
        # that the packed row still carries [4, 1, T] ids (a 2-D one would lose its restarts there)
        width = batch["input_ids"].shape[1]
        return torch.arange(width, device=batch["input_ids"].device).view(1, width, 1).expand(
            batch["input_ids"].shape[0], width, 3).contiguous()
    args = {"input_ids": batch["input_ids"], "mm_token_type_ids": batch["mm_token_type_ids"],
            "image_grid_thw": batch.get("image_grid_thw"), "attention_mask": batch["attention_mask"]}
    accepted = inspect.signature(fn).parameters
    pos, _ = fn(**{k: v for k, v in args.items() if k in accepted})  # [3, B, L]
    return pos.permute(1, 2, 0).contiguous()


def _cat_rows(values: torch.Tensor, rows: list[int], lengths, total: int, fill: float = 0) -> torch.Tensor:
    """The first ``lengths[r]`` entries of each row ``r`` of ``values`` [B, L, ...] end to end,
    padded with ``fill`` to ``total``: [total, ...]."""
    parts = [values[r, : int(lengths[r])] for r in rows]
    n = sum(p.shape[0] for p in parts)
    if total > n:
        parts.append(torch.full((total - n, *values.shape[2:]), fill, dtype=values.dtype, device=values.device))
    return torch.cat(parts)


def packed_slices(batch: dict[str, torch.Tensor], rows: list[int], image_counts: list[int], lengths,
                  pad_to: int = 8) -> dict[str, torch.Tensor]:
    """Rows ``rows`` of a collated batch as ONE packed row (module docstring): every [B, L] field
    as [1, T] (T = sum of the rows' ``lengths`` rounded up to ``pad_to``), ``position_ids``
    ([4, 1, T] with the batch's ``rope_positions``, else [1, T]), ``seq_start`` (1 at each
    trajectory's first token), ``segments`` (the bounds of each trajectory and of the padding
    tail, for learner/varlen.py; not a tensor), ``logprob_mask`` cleared there, ``pack_index`` (the flat [B * L]
    index of every real token, in packed order) and the rows' images."""
    total = _padded(sum(int(lengths[r]) for r in rows), pad_to)
    n_real = sum(int(lengths[r]) for r in rows)
    out = {k: _cat_rows(v, rows, lengths, total)[None] for k, v in batch.items()
           if k not in _SPANS and v.dim() == 2}
    text = torch.cat([torch.arange(int(lengths[r])) for r in rows] + [torch.arange(total - n_real)])
    start = (text == 0).float()
    start[n_real:] = 0.0
    if "rope_positions" in batch:
        rope = _cat_rows(batch["rope_positions"], rows, lengths, total).T  # [3, T]; tail filled below
        rope[:, n_real:] = text[n_real:]
        out["position_ids"] = torch.cat([text[None], rope])[:, None]  # [4, 1, T]
    else:
        out["position_ids"] = text[None]
    out["seq_start"] = start[None]
    out["segments"] = segments_of([int(lengths[r]) for r in rows] + ([total - n_real] if total > n_real else []))
    if "logprob_mask" in out:
        out["logprob_mask"] = out["logprob_mask"] * (1.0 - out["seq_start"])
    width = batch["input_ids"].shape[1]
    out["pack_index"] = torch.cat([r * width + torch.arange(int(lengths[r])) for r in rows])
    out.update(_images_of(batch, rows, image_counts))
    return _with_positions(out)


def place(dst: torch.Tensor, mb: dict[str, torch.Tensor], rows: list[int], values: torch.Tensor) -> None:
    """Write a micro-batch's per-token ``values`` into ``dst`` [B, L] (on CPU) in place: a packed
    micro-batch's real tokens to their rows and columns (``pack_index``), a padded one's rows."""
    values = values.detach().float().to("cpu")
    if "pack_index" in mb:
        idx = mb["pack_index"]
        dst.view(-1)[idx] = values.reshape(-1)[: idx.numel()]
    else:
        dst[rows, : values.shape[1]] = values


__all__ = ["PAD_TO", "auto_budget", "image_patch_rows", "micro_slices", "packed_micro_batches", "packed_slices", "place",
           "rope_positions", "slots", "split_micro_batches", "token_budget_micro_batches"]
