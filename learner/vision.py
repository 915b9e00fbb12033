"""The frozen vision tower's image features, computed once per update and reused by every pass.

    groups = TowerGroups(); groups.prepare(owners)   # once per trainer, on every rank in one order
    cache = VisionCache(groups)                  # one per update (PPOTrainer.update)
    mb["vision_cache"], mb["image_ids"]          # set by the trainer on each micro-batch
    model_inputs(mb, device, dtype, owner=m)     # common/contracts/logprobs.py asks the cache

Why: an update runs the same images through the vision tower up to five times per micro-batch:
the proximal, reference and value passes, then the policy's and the critic's training forwards.
With the tower frozen (``model.freeze_vision``, the tiny presets' default) every one of those runs
gives the same features: nothing trains the tower, and it has no dropout. On the tiny model the
tower was 29 % of an update (docs/benchmarks.md, "Packed vs padded micro-batches").

How:
* **Lazily, per image.** The first pass that meets an image computes the features of the
  micro-batch's images it has not seen, in one call of the tower (the call the model would have
  made), under ``torch.no_grad``; every later pass, whatever its micro-batch plan, takes them from
  here and hands them to the model as ``mm_encoder_outputs`` instead of ``pixel_values``.
* **Shared between models whose towers are the same.** The policy, reference and critic each own
  a tower. Towers that hold equal weights in the same dtype and device share one set of features:
  on the tiny presets the tower runs once per image per update. The trainer has them compared once,
  at its first update, on every rank in the same order (:meth:`TowerGroups.prepare`): a tower
  partitioned by ZeRO-3 is gathered for it one parameter pair at a time, a collective every rank
  makes. A tower with any parameter that trains (``freeze_vision: false``, LoRA on the tower) is
  never cached.
* **Once per distinct image.** Images with the same PNG bytes share a key (``image_keys``,
  common/contracts/modeling.py ``collate``): a GRPO group's episodes start from one image, so
  the tower runs on each distinct image once, however many rows repeat it (not for a ZeRO-3
  tower: its calls gather parameters, so each rank keeps one call per micro-batch with images).
* **Kept for one update.** Features live on the device until the update ends: images x merged
  tokens per image x hidden size in the model's dtype (3B, 256 tokens an image: 1 MiB an image).

``trainer.vision_cache: false`` turns it off (every pass runs the tower, as before).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

_VISION = "visual"  # Qwen2-VL / Qwen2.5-VL: the tower (and its merger) is the submodule ``visual``


def _tower_params(owner: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in owner.named_parameters() if f".{_VISION}." in f".{n}"]


def cacheable(owner: torch.nn.Module) -> bool:
    """Whether ``owner`` (a model whose forward takes ``pixel_values``) has a vision tower whose
    features may be reused: a frozen tower, ``get_image_features``, and a forward that accepts
    ``mm_encoder_outputs`` (transformers 5)."""
    params = _tower_params(owner)
    if not params or any(p.requires_grad for _, p in params):
        return False
    if not callable(getattr(owner, "get_image_features", None)):
        return False
    try:
        return "mm_encoder_outputs" in inspect.signature(owner.forward).parameters
    except (TypeError, ValueError):
        return False


def _partitioned(owner: torch.nn.Module) -> bool:
    return any(hasattr(p, "ds_id") for _, p in _tower_params(owner))  # ZeRO-3: local tensors are placeholders


def _whole(params: list[torch.nn.Parameter]):
    """A context in which ZeRO-3 partitioned ``params`` hold their whole tensors (a collective: every
    rank must enter it with the same parameters); nothing for plain ones."""
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    return contextlib.nullcontext()


def _same_tower(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Equal tower weights in the same dtype and on the same device (ZeRO-3 partitions gathered a
    pair at a time: every rank holds the same whole tensors, so every rank stops at the same pair)."""
    pa, pb = _tower_params(a), _tower_params(b)
    if len(pa) != len(pb) or any(na.split(f"{_VISION}.", 1)[-1] != nb.split(f"{_VISION}.", 1)[-1]
                                 for (na, _), (nb, _) in zip(pa, pb)):
        return False
    for (_, x), (_, y) in zip(pa, pb):
        with _whole([x, y]):
            if x.shape != y.shape or x.dtype != y.dtype or x.device != y.device or not torch.equal(x, y):
                return False
    return True


class TowerGroups:
    """Which models share a vision tower's features: a group per set of identical frozen towers,
    decided once per model (by identity) and kept for the trainer's life."""

    def __init__(self) -> None:
        self._group: dict[int, int | None] = {}
        self._reps: list[torch.nn.Module] = []
        self._sharded: list[bool] = []  # per group: its towers are partitioned by ZeRO-3
        self._owners: list[torch.nn.Module] = []  # kept alive, so their ids are never reused

    def prepare(self, owners: list[torch.nn.Module]) -> None:
        """Decide the groups of ``owners``, in this order; the trainer calls it on every rank before
        its first forward, so that the gathers of ZeRO-3 towers are the same collectives everywhere."""
        for owner in owners:
            self.of(owner, compare_partitioned=True)

    def of(self, owner: torch.nn.Module, compare_partitioned: bool = False) -> int | None:
        """``owner``'s group (None: not cached). Met for the first time outside :meth:`prepare`, a
        partitioned tower gets a group of its own: a gather there might not happen on every rank."""
        key = id(owner)
        if key not in self._group:
            self._owners.append(owner)
            group = None
            if cacheable(owner):
                def may_compare(rep: torch.nn.Module) -> bool:
                    return compare_partitioned or not (_partitioned(owner) or _partitioned(rep))

                group = next((i for i, rep in enumerate(self._reps)
                              if rep is owner or (may_compare(rep) and _same_tower(rep, owner))), None)
                if group is None:
                    self._reps.append(owner)
                    self._sharded.append(_partitioned(owner))
                    group = len(self._reps) - 1
            self._group[key] = group
            log.info("vision features of %s: %s", type(owner).__name__,
                     "not cached (the tower trains, or the model cannot take them)" if group is None
                     else f"cached once per update (tower group {group})")
        return self._group[key]

    def partitioned(self, group: int) -> bool:
        """Whether ``group``'s towers are partitioned by ZeRO-3: their forward gathers parameters, a
        collective, so every rank must call them as often (once per micro-batch with images), and
        images repeated in the batch are not run once only."""
        return self._sharded[group]


class VisionCache:
    """One update's image features, per tower group and image key of the collated batch (the index
    of the batch's first image with the same PNG bytes: learner/microbatch.py ``_images_of``; for a
    ZeRO-3 tower, the image's own index)."""

    def __init__(self, groups: TowerGroups) -> None:
        self.groups = groups
        self._features: dict[tuple[int, int], torch.Tensor] = {}
        self.tower_calls = 0  # calls of a tower made here (one per micro-batch with unseen images)

    def features(self, owner: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, ...] | None:
        """The per-image features of ``batch``'s images (``image_ids``, in order) for ``owner``, on
        ``owner``'s device; None when ``owner``'s tower is not cached (the model runs it itself)."""
        ids = batch.get("image_ids")
        if ids is None or "pixel_values" not in batch:
            return None
        group = self.groups.of(owner)
        if group is None:
            return None
        if "image_keys" in batch and not self.groups.partitioned(group):
            ids = batch["image_keys"]  # by content; a ZeRO-3 tower keeps one call per micro-batch on every rank
        missing, asked = [], set()
        for i, image in enumerate(ids):  # an image repeated in the batch (the same PNG) runs once
            if (group, image) not in self._features and image not in asked:
                missing.append(i)
                asked.add(image)
        if missing:
            self._compute(owner, group, batch, ids, missing)
        return tuple(self._features[(group, image)] for image in ids)

    @torch.no_grad()
    def _compute(self, owner: torch.nn.Module, group: int, batch: dict[str, Any], ids, missing: list[int]) -> None:
        grid = batch["image_grid_thw"]
        patches = grid.prod(-1).tolist()
        starts = [0]
        for n in patches:
            starts.append(starts[-1] + int(n))
        p = next(owner.parameters())
        pix = torch.cat([batch["pixel_values"][starts[i]: starts[i + 1]] for i in missing])
        out = owner.get_image_features(pix.to(p.device, p.dtype), grid[missing].to(p.device))
        pooled = out.pooler_output if hasattr(out, "pooler_output") else out
        if len(pooled) != len(missing):
            raise RuntimeError(f"the vision tower gave {len(pooled)} feature sets for {len(missing)} images")
        for i, feats in zip(missing, pooled):
            self._features[(group, ids[i])] = feats.detach()
        self.tower_calls += 1


__all__ = ["TowerGroups", "VisionCache", "cacheable"]
