"""LoRA (``model.lora``): the config's bounds, the learner's adapters on real DeepSpeed engines (CPU,
the tiny Qwen2.5-VL), the reference as the policy with its adapters disabled, checkpoints that restore
adapters and optimizer state exactly, and the merged export.

What a LoRA layer computes, by peft's formula: ``y = W x + (alpha / r) * B (A x)`` with ``B`` zero at
the start, so the adapted policy equals the base model until the first optimizer step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from worldloop.common.contracts.config import ConfigError, LoraConfig, config_from_dict
from worldloop.common.lora import is_adapter_name

LORA = {"rank": 4, "alpha": 8.0}


@pytest.fixture(scope="module")
def model_dir(shared_tiny_model) -> Path:
    return shared_tiny_model(max_image_side=112)


@pytest.mark.parametrize("lora, extra, key, why", [
    ({"rank": -1}, {}, "model.lora.rank", r"must be in \[0, 1024\]"),
    ({"alpha": 0}, {}, "model.lora.alpha", "must be > 0"),
    ({"dropout": 1.0}, {}, "model.lora.dropout", r"must be in \[0, 1\)"),
    ({"target_modules": []}, {}, "model.lora.target_modules", "at least one"),
    ({"target_modules": ["q_proj", "q_proj"]}, {}, "model.lora.target_modules", "distinct"),
    ({"rank": 8}, {"trainer": {"zero_stage": 3}}, "trainer.zero_stage", "ZeRO stage 0-2"),
    ({"rank": 8, "vision": True}, {"actor": {"backend": "vllm"}}, "model.lora.vision", "language model only"),
    ({"rank": 8, "vision": True}, {"actor": {"backend": "server"}}, "model.lora.vision", "language model only"),
])
def test_bad_lora_values_fail_naming_the_key(lora, extra, key, why):
    with pytest.raises(ConfigError, match=rf"'{key}'.*{why}"):
        config_from_dict({"model": {"lora": lora}, **extra})


def test_lora_runs_on_every_actor_backend():
    for backend in ("hf", "vllm", "server"):
        assert config_from_dict({"model": {"lora": {"rank": 8}}, "actor": {"backend": backend}}).model.lora.rank == 8
    # vision adapters: the hf backend only
    assert config_from_dict({"model": {"lora": {"rank": 8, "vision": True}}, "actor": {"backend": "hf"}}).model.lora.vision


def test_lora_is_off_by_default_with_the_qwen2_targets():
    lora = config_from_dict({}).model.lora
    assert lora.rank == 0 and lora.vision is False
    assert lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _config(model_dir: Path, tmp: Path, stage: int = 0, **lora):
    from worldloop.testing.learner import tiny_learner_config

    cfg = tiny_learner_config(model_dir, "redis://127.0.0.1:1", tmp / "run", zero_stage=stage, kl_coef=0.01,
                              estimator="bilevel_gae", use_critic=True)
    cfg.model.lora = LoraConfig(**{**LORA, **lora})
    return cfg


def _trajectories(codec, n: int = 4, first: int = 0):
    from worldloop.testing.trajectories import synthetic_trajectory

    return [synthetic_trajectory(codec, trajectory_id=f"l{first + i}", seed=first + i, turns=1 + i % 2,
                                 response_tokens=6 + i, env_reward=float(i % 3), image_side=28) for i in range(n)]


def _text_batch(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(10, vocab - 10, (2, 24), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _torch_models(cfg, model_dir: Path):
    """The models on bench/learner.py's plain-torch engine (its baseline: no DeepSpeed)."""
    import importlib.util

    from worldloop.common.contracts.modeling import ChatCodec, load_policy
    from worldloop.learner.engine import DistInfo, assemble_models, load_backbone

    spec = importlib.util.spec_from_file_location("bench_learner", Path(__file__).parent.parent / "bench" / "learner.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cpu = torch.device("cpu")
    make = lambda module, lr, conf: bench.TorchEngine(module, lr, conf, cpu, torch.float32)  # noqa: E731
    return assemble_models(cfg, DistInfo(0, 1, 0, cpu, "none"), ChatCodec(model_dir, max_image_side=112),
                           load_policy(model_dir), load_backbone(model_dir), None, engine_fn=make)


@pytest.mark.parametrize("stage", ["torch", 0, 2, "2+checkpointing"])
def test_an_update_trains_the_adapters_only_and_the_reference_is_the_base(model_dir, tmp_path, stage):
    from worldloop.common.contracts.modeling import load_policy
    from worldloop.learner.engine import PolicyModule, build_models, gather_policy_weights, init_distributed
    from worldloop.learner.lora import AdapterOffReference
    from worldloop.learner.trainer import PPOTrainer

    cfg = _config(model_dir, tmp_path, {"torch": 0, "2+checkpointing": 2}.get(stage, stage))
    if stage == "2+checkpointing":  # recomputed decoder layers: gradients still reach the adapters
        cfg.trainer.activation_checkpointing = "full"
    torch.manual_seed(0)
    models = _torch_models(cfg, model_dir) if stage == "torch" else build_models(cfg, init_distributed(cfg))
    assert isinstance(models.reference, AdapterOffReference)  # no second copy of the weights
    trainable = {n for n, p in models.policy.module.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter_name(n) for n in trainable)
    # vision frozen by default: no adapter inside the vision tower
    assert not any(".visual." in n for n in trainable)
    assert any(".language_model." in n and ".q_proj.lora_A." in n for n in trainable)
    critic_trainable = {n for n, p in models.critic.module.named_parameters() if p.requires_grad}
    assert critic_trainable == {n for n in critic_trainable if is_adapter_name(n)} | {"value_head.weight", "value_head.bias"}
    assert {f"hf.{n}" for n in gather_policy_weights(models)} == trainable  # the version: the adapters alone

    before, critic_before = _state(models.policy.module), _state(models.critic.module)
    PPOTrainer(cfg, models, seed=3).update(_trajectories(models.codec), step=1)
    after, critic_after = _state(models.policy.module), _state(models.critic.module)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(is_adapter_name(k) for k in changed)
    # B starts at 0, so the first step's gradient into A is 0 (dL/dA = (alpha/r) B^T ...): B moves first,
    # and every B of the policy moved (Adam moves each weight by about lr whatever the gradient's size)
    assert {k for k in trainable if ".lora_B." in k} <= changed
    critic_changed = {k for k in critic_before if not torch.equal(critic_before[k], critic_after[k])}
    assert "value_head.weight" in critic_changed
    assert all(is_adapter_name(k) or k.startswith("value_head.") for k in critic_changed)

    # the reference = the base model of model.path, to the last bit; the adapted policy differs now
    batch = _text_batch(models.vocab_size)
    base = PolicyModule(load_policy(model_dir), masked_ids=models.codec.prompt_only_ids).eval()
    with torch.no_grad():
        want, _ = base(batch)
        got, _ = models.reference(batch)
        adapted, _ = models.policy.module(batch)
    assert torch.equal(got, want)
    assert not torch.allclose(adapted, want)
    assert models.policy.module.training  # the reference pass left the policy in training mode


def test_vision_true_adapts_the_vision_tower(model_dir, tmp_path):
    from worldloop.common.contracts.modeling import load_policy
    from worldloop.common.lora import attach

    pm = attach(load_policy(model_dir), LoraConfig(**LORA, vision=True))
    names = [n for n, p in pm.get_base_model().named_parameters() if p.requires_grad]
    assert any(".visual." in n and ".mlp.gate_proj.lora_A." in n for n in names)


def _same(a, b, path: str = "") -> None:
    """Two (nested) optimizer / module states hold equal tensors and values, to the last bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            _same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    elif hasattr(a, "__dict__"):  # e.g. DeepSpeed's loss scaler: compared field by field
        assert type(a) is type(b), path
        _same(vars(a), vars(b), path)
    else:
        assert a == b, path


@pytest.mark.parametrize("stage", [0, 2])
def test_a_checkpoint_restores_adapters_and_optimizer_exactly_and_exports_merged(model_dir, tmp_path, stage):
    from worldloop.cli import main
    from worldloop.common.contracts.modeling import load_policy
    from worldloop.learner import checkpoint
    from worldloop.learner.engine import PolicyModule, build_models, gather_policy_weights, init_distributed
    from worldloop.learner.trainer import PPOTrainer

    cfg = _config(model_dir, tmp_path, stage)
    torch.manual_seed(0)
    models = build_models(cfg, init_distributed(cfg))
    PPOTrainer(cfg, models, seed=3).update(_trajectories(models.codec), step=1)
    root = tmp_path / "run" / "checkpoints"
    checkpoint.start_run(root, "r1", fresh=True)
    path = checkpoint.save(models, root, {"run_id": "r1", "step": 1, "policy_version": 1}, weights=gather_policy_weights(models),
                           model_dir=model_dir)
    # the DeepSpeed state holds no frozen base weight: far smaller than the model's 434k fp32 parameters
    policy_files = sum(f.stat().st_size for f in (path / "policy").rglob("*model_states.pt"))
    assert policy_files < 434_000 * 4 // 2
    assert (path / "adapter" / "adapter_config.json").is_file()

    torch.manual_seed(1)  # other random A matrices: the resume must replace them
    resumed = build_models(cfg, init_distributed(cfg))
    assert not all(torch.equal(x, y) for x, y in zip(models.policy.module.state_dict().values(),
                                                      resumed.policy.module.state_dict().values()))
    checkpoint.load(resumed, path)
    for a, b in ((models.policy, resumed.policy), (models.critic, resumed.critic)):
        _same(a.module.state_dict(), b.module.state_dict(), "module")
        _same(a.optimizer.state_dict(), b.optimizer.state_dict(), "optimizer")
    # and the next update is the same on both, bit for bit
    nxt = _trajectories(models.codec, first=10)
    PPOTrainer(cfg, models, seed=4).update(nxt, step=2)
    PPOTrainer(cfg, resumed, seed=4).update(nxt, step=2)
    _same(models.policy.module.state_dict(), resumed.policy.module.state_dict(), "after")

    # a rank-8 run cannot resume a rank-4 checkpoint
    other = _config(model_dir, tmp_path, stage, rank=8)
    with pytest.raises(ConfigError, match=r"'model.lora.rank'.*rank 4, this run uses 8"):
        checkpoint.load(build_models(other, init_distributed(other)), path)

    # the merged export (`worldloop model export RUN --merged`) and the checkpoint's hf/ load with plain
    # transformers and give the adapted policy's log-probs (of the checkpoint: `resumed` is still there)
    (tmp_path / "run" / "config.yaml").write_text(f"model:\n  path: {model_dir}\n")
    out = tmp_path / "merged"
    assert main(["model", "export", str(tmp_path / "run"), "--merged", "--out", str(out)]) == 0
    batch = _text_batch(models.vocab_size)
    with torch.no_grad():
        want, _ = _at_checkpoint(cfg, path)(batch)
        for d in (out, path / "hf"):
            got, _ = PolicyModule(load_policy(d), masked_ids=models.codec.prompt_only_ids).eval()(batch)
            assert torch.allclose(got, want, atol=1e-5, rtol=0), (d, float((got - want).abs().max()))
        base, _ = PolicyModule(load_policy(model_dir), masked_ids=models.codec.prompt_only_ids).eval()(batch)
    assert not torch.allclose(base, want, atol=1e-5, rtol=0)  # the adapters did change the policy


def _at_checkpoint(cfg, path):
    """The adapted policy as the checkpoint holds it (fresh engines, the checkpoint loaded), in eval mode."""
    from worldloop.learner import checkpoint
    from worldloop.learner.engine import build_models, init_distributed

    models = build_models(cfg, init_distributed(cfg))
    checkpoint.load(models, path)
    return models.policy.module.eval()


def test_export_of_a_full_weight_checkpoint_copies_its_hf_export(model_dir, tmp_path, capsys):
    import json
    import shutil

    from worldloop.cli import main

    ckpt = tmp_path / "step_00000001"
    ckpt.mkdir()
    (ckpt / "state.json").write_text(json.dumps({"step": 1, "policy_version": 1, "complete": True}))
    assert main(["model", "export", str(ckpt), "--merged", "--out", str(tmp_path / "a")]) == 2
    assert "has neither adapter/ nor hf/" in capsys.readouterr().err
    shutil.copytree(model_dir, ckpt / "hf")
    assert main(["model", "export", str(ckpt), "--merged", "--out", str(tmp_path / "b")]) == 0
    assert (tmp_path / "b" / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()
    assert main(["model", "export", str(tmp_path / "nothing"), "--merged"]) == 2
    assert "neither a learner checkpoint" in capsys.readouterr().err
    assert main(["model", "export", str(ckpt)]) == 2
    assert "give --merged" in capsys.readouterr().err
