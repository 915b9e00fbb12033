"""The learner's memory model (learner/memory.py) against its formulas by hand, and
``trainer.micro_batch_tokens: auto`` on CUDA (marked gpu)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from worldloop.learner.memory import (ModelShape, activation_bytes_per_token, estimate, logits_bytes, pending_state_bytes,
                                      shape_of, state_bytes, token_budget)

SHAPE = ModelShape(params=1000, trainable=800, hidden=4, layers=2, heads=2, kv_heads=1, intermediate=8, vocab=50)


def test_state_bytes_per_engine_by_hand():
    z = {"grad_fp32": 0.0, "host": 0.0}
    assert state_bytes(SHAPE, "torch", bf16=True) == {"params": 2000, "grads": 1600, "optimizer": 3200, **z}
    assert state_bytes(SHAPE, "torch", bf16=False) == {"params": 4000, "grads": 3200, "optimizer": 6400, **z}
    # bf16 ZeRO-0: bf16 grads + fp32 accumulators; fp32 master + two fp32 moments
    assert state_bytes(SHAPE, "zero0", bf16=True) == {"params": 2000, "grads": 1600, "grad_fp32": 3200,
                                                      "optimizer": 6400 + 3200, "host": 0.0}
    assert state_bytes(SHAPE, "zero0", bf16=False) == {"params": 4000, "grads": 3200, "optimizer": 6400, **z}
    # ZeRO-1/2/3: DeepSpeed's fp32 copy of the gradient partition at the step (4 x 800 / 2 ranks)
    assert state_bytes(SHAPE, "zero1", bf16=True, world_size=2) == {"params": 2000, "grads": 1600, "grad_fp32": 1600,
                                                                    "optimizer": 4800, "host": 0.0}
    assert state_bytes(SHAPE, "zero2", bf16=True, world_size=2) == {"params": 2000, "grads": 800, "grad_fp32": 1600,
                                                                    "optimizer": 4800, "host": 0.0}
    assert state_bytes(SHAPE, "zero3", bf16=True, world_size=2) == {"params": 1000, "grads": 800, "grad_fp32": 1600,
                                                                    "optimizer": 4800, "host": 0.0}
    # offload_optimizer cpu: the fp32 copy (3200), master and moments (9600) on the host
    assert state_bytes(SHAPE, "zero2", bf16=True, offload=True) == {"params": 2000, "grads": 1600, "grad_fp32": 0.0,
                                                                    "optimizer": 0.0, "host": 12800}
    with pytest.raises(ValueError, match="engine"):
        state_bytes(SHAPE, "zero4", bf16=True)


def test_activations_and_logits_by_hand():
    # bf16, plain modules: norm 8h + 2h = 40, attention 6*2*h = 48, MLP 2h + 4*2*I = 72 -> layer 200
    assert activation_bytes_per_token(SHAPE, bf16=True, checkpointing=False) == pytest.approx(1.1 * (2 * 200 + 2 * 4))
    # checkpointing: every layer's input (2 bytes x h) + one recomputed layer
    assert activation_bytes_per_token(SHAPE, bf16=True, checkpointing=True) == pytest.approx(1.1 * (2 * 2 * 4 + 200))
    # Liger: norm 2h = 8, MLP 2h + 3*2*I = 56 -> layer 16 + 48 + 56 = 120
    assert activation_bytes_per_token(SHAPE, bf16=True, checkpointing=False, liger=True) == pytest.approx(1.1 * (240 + 8))
    # fp32: norm 8h = 32, attention 6*4*h = 96, MLP 4h + 16 I = 144 -> 304
    assert activation_bytes_per_token(SHAPE, bf16=False, checkpointing=False) == pytest.approx(1.1 * (608 + 16))
    assert logits_bytes(100, 50, bf16=False) == 20 * 100 * 50 and logits_bytes(100, 50, bf16=True) == 18 * 100 * 50
    assert logits_bytes(100, 50, bf16=True, chunk=16) == 10 * 16 * 50
    assert logits_bytes(10, 50, bf16=True, chunk=16) == 10 * 10 * 50


def test_estimate_adds_the_parts_and_the_reference():
    e = estimate(SHAPE, "torch", bf16=True, tokens=10, loss_tokens=4, checkpointing=False, chunk=2, reference=SHAPE)
    act = activation_bytes_per_token(SHAPE, bf16=True, checkpointing=False) * 10
    assert (e.params, e.grads, e.optimizer, e.logits, e.others) == (2000, 1600, 3200, 10 * 2 * 50, 2000)
    assert e.activations == pytest.approx(act) and e.total == pytest.approx(2000 + 1600 + 3200 + act + 1000 + 2000)
    assert e.rows()["total"] == pytest.approx(e.total / 2**30)  # GiB


def test_issue_30s_zero2_out_of_memory_is_what_the_model_says():
    """Qwen2.5-VL-3B (3.75 B parameters, vision included), bf16, one GPU: ZeRO-2's state alone is
    20 bytes per parameter, 75.1 GB, and its fp32 gradient partition the 14 GiB allocation that failed."""
    p = 3_754_622_976
    shape = ModelShape(params=p, trainable=p, hidden=2048, layers=36, heads=16, kv_heads=2, intermediate=11008,
                       vocab=151936)
    s = state_bytes(shape, "zero2", bf16=True)
    assert sum(s.values()) == 20 * p
    assert 4 * p / 2**30 == pytest.approx(13.99, abs=0.01)
    e = estimate(shape, "zero2", bf16=True, tokens=2048, loss_tokens=512, checkpointing=True, chunk=512, reference=shape)
    assert e.total > 80e9 > estimate(shape, "torch", bf16=True, tokens=2048, loss_tokens=512, checkpointing=True,
                                     chunk=512, reference=shape).total
    assert e.grad_fp32 == 4 * p and e.rows()["grad_fp32"] == pytest.approx(13.99, abs=0.01)


def test_zero2_fits_3b_with_the_vision_tower_trained_by_offloading_the_optimizer():
    """freeze_vision false: 3.75 B trainable parameters. ZeRO-2 as is needs 20 x 3.75 B = 69.9 GiB
    of state + the bf16 reference (7.0 GiB) + activations: more than 90 % of 80 GB (67.1 GiB);
    with offload_optimizer cpu the device keeps the bf16 parameters and gradients (4 bytes per
    parameter, 14.0 GiB) + the reference: about 21 GiB + activations, which fits."""
    from worldloop.learner.memory import zero_settings_that_fit

    p = 3_754_622_976
    shape = ModelShape(params=p, trainable=p, hidden=2048, layers=36, heads=16, kv_heads=2, intermediate=11008,
                       vocab=151936)
    settings, e = zero_settings_that_fit(shape, 80e9, bf16=True, tokens=8192, loss_tokens=2048, checkpointing="full",
                                         chunk=512, reference=shape)
    assert settings == {"zero_stage": 2, "offload_optimizer": "cpu", "fits": True}
    assert e.params + e.grads == 4 * p and e.optimizer == e.grad_fp32 == 0 and e.host == 16 * p
    assert e.total < 0.9 * 80e9


def test_selective_checkpointing_keeps_less_than_none_and_more_than_full():
    # SHAPE: h 4, I 8, bf16 (d 2), 2 layers: layer = 2 x (8 x 4 + 2 x 4) + 6 x 2 x 4 + (2 x 4 + 4 x 2 x 8) = 200
    # selective: each layer keeps 200 - 5 x 2 x 4 = 160, plus one attention block alive (6 x 2 x 4) and
    # its input (2 x 4): 2 x 160 + 56 = 376
    assert activation_bytes_per_token(SHAPE, bf16=True, checkpointing="selective") == pytest.approx(1.1 * 376)
    none = activation_bytes_per_token(SHAPE, bf16=True, checkpointing="none")
    full = activation_bytes_per_token(SHAPE, bf16=True, checkpointing="full")
    assert full < 1.1 * 376 < none
    with pytest.raises(ValueError, match="checkpointing must be one of"):
        activation_bytes_per_token(SHAPE, bf16=True, checkpointing="some")


def test_token_budget_by_hand():
    assert token_budget(1000, 10, 150, headroom=0.8) == 64  # (800 - 150) / 10 = 65 -> a multiple of 8
    assert token_budget(1000, 10, 150, headroom=0.8, multiple=128) == 128  # at least one multiple
    assert token_budget(100, 10, 500) == 8


def test_pending_state_is_the_gradients_and_moments_not_yet_allocated():
    model = torch.nn.Linear(4, 3)  # 15 fp32 parameters = 60 bytes
    opt = torch.optim.AdamW(model.parameters())
    engine = SimpleNamespace(module=model, optimizer=opt)
    assert pending_state_bytes(engine) == 60 + 2 * 60
    model(torch.ones(2, 4)).sum().backward()
    assert pending_state_bytes(engine) == 2 * 60
    opt.step()
    assert pending_state_bytes(engine) == 0
    wrapped = SimpleNamespace(module=model, optimizer=SimpleNamespace(optimizer=opt))  # DeepSpeed's ZeRO wrapper
    assert pending_state_bytes(wrapped) == 0


def test_shape_of_counts_tied_weights_once_and_frozen_ones_as_untrainable(tmp_path, shared_tiny_model):
    from worldloop.common.contracts.modeling import freeze_vision_tower, load_policy

    model = load_policy(shared_tiny_model(max_image_side=112))
    shape = shape_of(model)
    text = model.config.get_text_config()
    assert shape.params == sum(p.numel() for p in model.parameters()) == shape.trainable
    assert (shape.hidden, shape.layers, shape.vocab) == (text.hidden_size, text.num_hidden_layers, text.vocab_size)
    frozen = sum(p.numel() for n, p in model.named_parameters() if ".visual." in f".{n}")
    freeze_vision_tower(model)
    assert shape_of(model).trainable == shape.params - frozen > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_micro_batch_tokens_on_cuda_fills_the_free_memory(tmp_path, shared_tiny_model):
    """trainer.micro_batch_tokens auto on a GPU: the budget is what the memory model fits into the
    free memory (a multiple of 128), the update runs with it and stays within the device."""
    from worldloop.common.contracts.modeling import ChatCodec, load_policy
    from worldloop.learner.engine import assemble_models, init_distributed, load_backbone
    from worldloop.learner.memory import activation_bytes_per_token
    from worldloop.testing.trajectories import synthetic_trajectory
    from worldloop.testing.learner import tiny_learner_config
    from worldloop.learner.trainer import PPOTrainer

    model_dir = shared_tiny_model(max_image_side=112)
    cfg = tiny_learner_config(model_dir, "redis://127.0.0.1:1", tmp_path / "run", device="cuda", micro_batch_tokens="auto",
                              train_batch_size=8, ppo_mini_batch_size=4, micro_batch_size=1, liger=False)
    dist = init_distributed(cfg)
    codec = ChatCodec(model_dir, max_image_side=112)
    models = assemble_models(cfg, dist, codec, load_policy(model_dir), load_backbone(model_dir), load_policy(model_dir))
    free, total = torch.cuda.mem_get_info()
    trainer = PPOTrainer(cfg, models, seed=0)
    trajs = [synthetic_trajectory(codec, trajectory_id=f"a{i}", seed=i, turns=1 + i % 3) for i in range(8)]
    stats = trainer.update(trajs, step=0)
    budget = trainer._cuda_budget
    per_token = activation_bytes_per_token(shape_of(models.policy.module), bf16=models.bf16, checkpointing=False)
    assert budget % 128 == 0 and budget * per_token <= 0.85 * (free + torch.cuda.memory_reserved()) + per_token * 128
    assert budget > 8 * 512  # a tiny model on a GPU: every mini-batch fits in one micro-batch
    assert stats["micro_batches"] == 2  # 8 trajectories / 4 per mini-batch, one micro-batch each
    assert torch.cuda.max_memory_allocated() < total
