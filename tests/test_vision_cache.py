"""The frozen vision tower's features, computed once per image per update (learner/vision.py).

* with ``model.freeze_vision`` the tower runs once per micro-batch of the proximal pass, on each
  image once, where it ran in every pass of every model before; the update (losses, gradients at
  both optimizer steps, weights) equals the update without the cache, packed and padded;
* a tower that trains (``freeze_vision: false``) is never cached: every pass runs it;
* towers with different weights get their own features: a critic whose tower differs reads its
  own, and its values equal those of the uncached path;
* ZeRO-3 towers are gathered to be compared (once, at the first update) and shared too, on one
  rank and on two under torchrun (the gathers are collectives: a rank that skipped one would hang);
* ``cacheable`` and the grouping on small modules.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from test_microbatch import _recording_engine, _trajectories, assert_same_update  # noqa: E402

from worldloop.learner.vision import TowerGroups, VisionCache, cacheable  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(shared_tiny_model) -> Path:
    return shared_tiny_model(max_image_side=112)


def _towers(models) -> list[torch.nn.Module]:
    """The vision towers of the policy, the critic and the reference (three distinct modules)."""
    mods = [models.policy.module.hf, models.critic.module.backbone, models.reference.hf]
    return [next(m for name, m in mod.named_modules() if name.endswith("visual")) for mod in mods]


def _run(model_dir: Path, *, vision_cache: bool, freeze_vision: bool = True, packing: bool = True,
         perturb_critic_tower: bool = False, precompute_only: bool = False, zero_stage: int = 0,
         trajectories=None, images_seen: dict | None = None):
    """One update (or only its proximal pass) on fresh models: (result, tower calls per model, trainer).
    ``trajectories(codec)`` gives the batch (default: :func:`_trajectories`); ``images_seen`` gets
    the images each model's tower was given, summed over its calls."""
    from worldloop.common.contracts.modeling import ChatCodec, load_policy
    from worldloop.learner.engine import assemble_models, init_distributed, load_backbone
    from worldloop.learner.trainer import PPOTrainer
    from worldloop.testing.learner import tiny_learner_config

    cfg = tiny_learner_config(model_dir, "redis://127.0.0.1:1", model_dir.parent / "run", train_batch_size=8,
                              ppo_mini_batch_size=4, micro_batch_size=2, micro_batch_tokens=0, zero_stage=zero_stage,
                              kl_coef=0.01, estimator="bilevel_gae", packing=packing, vision_cache=vision_cache,
                              freeze_vision=freeze_vision)
    codec = ChatCodec(model_dir, max_image_side=112)
    optimizers: dict = {}
    torch.manual_seed(0)
    backbone = load_backbone(model_dir)
    if perturb_critic_tower:
        with torch.no_grad():
            for name, p in backbone.named_parameters():
                if name.startswith("visual.") and p.dim() == 2:
                    p.add_(0.05 * torch.randn_like(p))
    models = assemble_models(cfg, init_distributed(cfg), codec, load_policy(model_dir), backbone, load_policy(model_dir),
                             engine_fn=_recording_engine(optimizers))
    torch.nn.init.normal_(models.critic.module.value_head.weight, std=0.5)  # values that are not all 0
    calls = {"policy": 0, "critic": 0, "reference": 0}
    seen = images_seen if images_seen is not None else {}
    seen.update({name: 0 for name in calls})

    def count(module, args, kwargs, _out, name):
        calls[name] += 1
        seen[name] += int((kwargs["grid_thw"] if "grid_thw" in kwargs else args[1]).shape[0])

    for name, tower in zip(calls, _towers(models)):
        tower.register_forward_hook(lambda *a, n=name: count(*a, n), with_kwargs=True)
    trainer = PPOTrainer(cfg, models, seed=3)
    trajs = (trajectories or (lambda c: _trajectories(c, 8)))(codec)
    if precompute_only:
        batch, counts, lengths = trainer._collate(trajs)
        trainer._vision = VisionCache(trainer._towers) if trainer._towers is not None else None
        result = trainer._precompute(batch, counts, lengths, {"slots": 0.0, "real": 0.0})
        return result, calls, trainer
    stats = trainer.update(trajs, step=1)
    params = {"policy": [p.detach().clone() for p in models.policy.module.parameters()],
              "critic": [p.detach().clone() for p in models.critic.module.parameters()]}
    return (stats, {k: o.seen for k, o in optimizers.items()}, params), calls, trainer


@pytest.mark.parametrize("packing", [True, False])
def test_a_frozen_tower_runs_once_per_image_and_the_update_is_unchanged(model_dir, packing):
    plain, plain_calls, _ = _run(model_dir, vision_cache=False, packing=packing)
    cached, cached_calls, trainer = _run(model_dir, vision_cache=True, packing=packing)
    n_micro = int(plain[0]["micro_batches"])  # training micro-batches (two mini-batches)
    # without the cache: every proximal, reference and value pass and every training forward runs a
    # tower (8 rows, 2 per micro-batch: 4 proximal micro-batches, then n_micro training ones)
    assert plain_calls == {"policy": 4 + n_micro, "critic": 4 + n_micro, "reference": 4}
    # with it: the policy's tower, once per proximal micro-batch; the critic and reference share its
    # features (equal towers), and the training passes find every image already computed
    assert cached_calls == {"policy": 4, "critic": 0, "reference": 0}
    assert trainer.last_vision_tower_calls == 4
    assert_same_update(plain, cached)


def _levels(codec):
    """8 episodes of two levels, 4 each (seeds 0 and 1), of other lengths: the episodes of a level
    start from the same PNG, as a GRPO group's do."""
    from worldloop.testing.trajectories import synthetic_trajectory

    shapes = [(1, 4), (3, 40), (1, 8), (2, 30), (3, 36), (1, 6), (2, 12), (3, 24)]
    return [synthetic_trajectory(codec, trajectory_id=f"g{i}", seed=i // 4, turns=t, response_tokens=n,
                                 env_reward=float(i % 3), success=i % 2 == 1) for i, (t, n) in enumerate(shapes)]


def test_repeated_images_are_processed_once_and_run_once(model_dir):
    """``collate`` processes each distinct PNG once and keys every image by its first copy: the
    pixels are bit for bit those of processing each row's images alone; with the cache the tower
    sees each distinct PNG once in the whole update, and the update is the uncached one."""
    from worldloop.common.contracts.modeling import ChatCodec, build_sequence, collate

    codec = ChatCodec(model_dir, max_image_side=112)
    layouts = [build_sequence(t) for t in _levels(codec)]
    pngs = [bytes(p) for x in layouts for p in x.images]
    distinct = list(dict.fromkeys(pngs))
    assert 2 <= len(distinct) < len(pngs) - 4  # the premise: the first turns repeat
    batch = collate(layouts, codec)
    assert batch["image_keys"].tolist() == [pngs.index(p) for p in pngs]
    alone = [codec.vision_inputs(x.images) for x in layouts]
    assert torch.equal(batch["pixel_values"], torch.cat([v["pixel_values"] for v in alone]))
    assert torch.equal(batch["image_grid_thw"], torch.cat([v["image_grid_thw"] for v in alone]))

    plain, _, _ = _run(model_dir, vision_cache=False, trajectories=_levels)
    seen: dict = {}
    cached, calls, trainer = _run(model_dir, vision_cache=True, trajectories=_levels, images_seen=seen)
    assert seen == {"policy": len(distinct), "critic": 0, "reference": 0}
    assert calls["policy"] <= 4 and trainer.last_vision_tower_calls == calls["policy"]
    assert_same_update(plain, cached)


def test_zero3_towers_are_gathered_compared_and_shared(model_dir):
    """ZeRO-3 partitions the policy's and the critic's towers: they are gathered (a pair of
    parameters at a time) to be compared with each other and with the plain reference, and shared;
    the update is the uncached one."""
    plain, plain_calls, _ = _run(model_dir, vision_cache=False, zero_stage=3)
    cached, calls, trainer = _run(model_dir, vision_cache=True, zero_stage=3)
    n_micro = int(plain[0]["micro_batches"])
    assert plain_calls == {"policy": 4 + n_micro, "critic": 4 + n_micro, "reference": 4}
    assert calls == {"policy": 4, "critic": 0, "reference": 0}
    assert trainer.last_vision_tower_calls == 4
    assert any(hasattr(p, "ds_id") for p in trainer.models.critic.module.backbone.parameters())  # partitioned
    assert_same_update(plain, cached)


def _worker(model_dir: str, out: str) -> None:
    """Under torchrun (2 ranks, ZeRO-3): the update with and without the cache; rank 0 writes."""
    from procs import rank0_compares

    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".torch_extensions"))
    plain, plain_calls, _ = _run(Path(model_dir), vision_cache=False, zero_stage=3)
    cached, calls, trainer = _run(Path(model_dir), vision_cache=True, zero_stage=3)
    rank0_compares(out, lambda: assert_same_update(plain, cached), plain=plain_calls, cached=calls,
                   tower_calls=trainer.last_vision_tower_calls, micro=plain[0]["micro_batches"])


@pytest.mark.slow
@pytest.mark.timeout(800)  # the two ranks are waited on for up to 600 s
def test_two_zero3_ranks_compare_their_towers_in_step(model_dir, tmp_path):
    from procs import two_ranks

    res = two_ranks(Path(__file__).resolve(), [str(model_dir)], tmp_path / "result.json",
                    "two ZeRO-3 ranks under torch.distributed.run")
    assert res["same"] == "ok", res
    # per rank: 4 of the 8 rows, 2 proximal micro-batches, then 2 training ones (one per mini-batch)
    assert res["micro"] == 2
    assert res["plain"] == {"policy": 4, "critic": 4, "reference": 2}
    assert res["cached"] == {"policy": 2, "critic": 0, "reference": 0} and res["tower_calls"] == 2


def test_a_tower_that_trains_is_never_cached(model_dir):
    _, calls, trainer = _run(model_dir, vision_cache=True, freeze_vision=False, precompute_only=True)
    assert calls == {"policy": 4, "critic": 4, "reference": 4}  # every model ran its own, every pass
    # the frozen reference's tower is cached (its own group: it runs once per image, here one pass),
    # the policy's and the critic's train and never are
    assert trainer._vision.tower_calls == 4
    assert trainer._towers.of(trainer.models.policy.module.hf.model) is None
    assert trainer._towers.of(trainer.models.critic.module.backbone) is None
    assert trainer._towers.of(trainer.models.reference.hf.model) == 0


def test_a_critic_whose_tower_differs_reads_its_own_features(model_dir):
    plain, plain_calls, _ = _run(model_dir, vision_cache=False, perturb_critic_tower=True, precompute_only=True)
    cached, calls, trainer = _run(model_dir, vision_cache=True, perturb_critic_tower=True, precompute_only=True)
    assert calls == {"policy": 4, "critic": 4, "reference": 0}  # the reference shares the policy's
    groups = trainer._towers
    assert groups.of(trainer.models.critic.module.backbone) != groups.of(trainer.models.policy.module.hf.model)
    for key in ("old_logprobs", "ref_logprobs", "old_values"):
        assert float(plain[key].abs().max()) > 0.01, key
        assert torch.allclose(cached[key], plain[key], atol=1e-5, rtol=0), (key, float((cached[key] - plain[key]).abs().max()))
    # (the perturbation reached the values: a shared tower would have given other ones)
    shared, _, _ = _run(model_dir, vision_cache=False, precompute_only=True)
    assert not torch.allclose(shared["old_values"], plain["old_values"], atol=1e-4)


class _Tower(torch.nn.Module):
    def __init__(self, seed: int = 0, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(seed)
        self.visual = torch.nn.Linear(3, 3).to(dtype)
        self.lm = torch.nn.Linear(3, 3)

    def get_image_features(self, pixel_values, image_grid_thw):  # pragma: no cover - never called here
        raise AssertionError

    def forward(self, input_ids=None, mm_encoder_outputs=None):  # pragma: no cover
        raise AssertionError


class _OldForward(_Tower):
    def forward(self, input_ids=None, pixel_values=None):  # pragma: no cover - no mm_encoder_outputs
        raise AssertionError


def test_cacheable_and_the_groups_of_small_modules():
    a, same, other, half = _Tower(0), _Tower(0), _Tower(1), _Tower(0, torch.float64)
    for m in (a, same, other, half):
        m.visual.requires_grad_(False)
    assert cacheable(a) and not cacheable(_OldForward(0).requires_grad_(False))
    trains = _Tower(0)
    assert not cacheable(trains)  # its tower's parameters train
    no_tower = torch.nn.Linear(2, 2).requires_grad_(False)
    assert not cacheable(no_tower)
    groups = TowerGroups()
    assert [groups.of(m) for m in (a, same, other, half, trains, a)] == [0, 0, 1, 2, None, 0]


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--worker":
    _worker(sys.argv[2], sys.argv[3])
