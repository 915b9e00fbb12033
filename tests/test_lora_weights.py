"""Adapter-only weight versions end to end: a LoRA learner (real DeepSpeed engine on CPU, the tiny
Qwen2.5-VL) trains one update and publishes its adapters over the real ZeroMQ channel (CURVE on);
a real subscriber fetches the version and the HF actor backend, built with the same ``model.lora``,
applies it: its sampled tokens' log-probs equal the learner's policy's on the same sequences."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import zmq.auth

from worldloop.actor.generation import GenRequest, WeightUpdateError
from worldloop.actor.hf_backend import HFBackend
from worldloop.common.contracts.config import LoraConfig
from worldloop.common.contracts.modeling import build_sequence, collate, token_logprobs
from worldloop.common.lora import is_adapter_name, load_adapter_dir
from worldloop.common.transport.weights import WeightPublisher, WeightSubscriber
from worldloop.testing.trajectories import one_turn_trajectory, synthetic_trajectory

LORA = LoraConfig(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def model_dir(shared_tiny_model) -> Path:
    return shared_tiny_model(max_image_side=112)


def _learner(model_dir: Path, tmp: Path):
    from worldloop.learner.engine import build_models, init_distributed
    from worldloop.learner.trainer import PPOTrainer
    from worldloop.testing.learner import tiny_learner_config

    cfg = tiny_learner_config(model_dir, "redis://127.0.0.1:1", tmp / "run", kl_coef=0.01, estimator="bilevel_gae",
                              use_critic=True)
    cfg.model.lora = LORA
    torch.manual_seed(0)
    models = build_models(cfg, init_distributed(cfg))
    trajs = [synthetic_trajectory(models.codec, trajectory_id=f"w{i}", seed=i, turns=1 + i % 2, response_tokens=6 + i,
                                  env_reward=float(i % 3), image_side=28) for i in range(4)]
    PPOTrainer(cfg, models, seed=3).update(trajs, step=1)
    return models


def test_an_adapter_only_version_over_the_channel_gives_the_learners_logprobs(model_dir, tmp_path):
    from worldloop.learner import checkpoint
    from worldloop.learner.engine import gather_policy_weights

    models = _learner(model_dir, tmp_path)
    weights = gather_policy_weights(models)
    assert weights and all(is_adapter_name(k) for k in weights)
    full = sum(p.numel() for p in models.policy_hf.parameters())
    assert sum(t.numel() for t in weights.values()) < full // 4  # the version is the adapters alone

    for name in ("server", "client"):
        zmq.auth.create_certificates(tmp_path, name)
    pub = WeightPublisher("127.0.0.1", announce_interval_s=0.2, curve_secret_key_file=tmp_path / "server.key_secret",
                          curve_authorized_clients=tmp_path / "client.key")
    sub = WeightSubscriber("127.0.0.1", pub.pub_port, pub.fetch_port, fetch_timeout_s=30,
                           curve_server_public_key_file=tmp_path / "server.key",
                           curve_client_key_file=tmp_path / "client.key_secret")
    actor = HFBackend(model_dir, max_image_side=112, lora=LORA)
    try:
        pub.publish(weights, 7, wait=True)
        got = sub.fetch(min_version=0)
        assert got is not None and got[0] == 7
        version, tensors = got
        assert set(tensors) == set(weights)
        assert all(torch.equal(tensors[k], weights[k]) for k in weights)
        actor.update_weights(tensors, version)
        assert actor.version == 7
    finally:
        sub.close()
        pub.close()

    # the actor samples; the learner's policy (eval mode) recomputes the same tokens' log-probs
    codec = actor.codec
    obs = codec.encode_obs("go <image>", [torch.randint(0, 256, (60, 90, 3), dtype=torch.uint8).numpy()],
                           system="Play.", first=True)
    req = GenRequest(obs.ids, obs.images)
    res = actor.generate([req], temperature=1.0, top_p=1.0, max_new_tokens=12, seed=1)[0]
    assert len(res.response_ids) >= 1
    batch = collate([build_sequence(one_turn_trajectory(req.prompt_ids, res.response_ids, req.images))], codec)
    policy = models.policy_hf.eval()
    with torch.no_grad():
        lp, _ = token_logprobs(policy, batch, temperature=1.0, masked_ids=codec.prompt_only_ids)
        with models.lora.disable_adapter():
            base, _ = token_logprobs(policy, batch, temperature=1.0, masked_ids=codec.prompt_only_ids)
    n = len(req.prompt_ids)
    learner_lp = lp[0, n:n + len(res.response_ids)]
    assert torch.allclose(torch.tensor(res.logprobs), learner_lp, atol=1e-4), (res.logprobs, learner_lp)
    # and the adapters matter: the base model gives other log-probs for these tokens
    assert not torch.allclose(base[0, n:n + len(res.response_ids)], learner_lp, atol=1e-4)

    # a full-weight set, or an adapter set with one tensor missing, is refused and changes nothing
    with pytest.raises(WeightUpdateError, match="unknown tensor name"):
        actor.update_weights({"model.language_model.norm.weight": torch.ones(1)}, 8)
    short = dict(weights)
    short.pop(next(iter(short)))
    with pytest.raises(WeightUpdateError, match="missing tensor name"):
        actor.update_weights(short, 8)
    assert actor.version == 7

    # the checkpoint's adapter/ reads back as the same version (the run's evaluator takes the final one from it)
    root = tmp_path / "ckpt"
    checkpoint.start_run(root, "r", fresh=True)
    path = checkpoint.save(models, root, {"run_id": "r", "step": 1, "policy_version": 1}, weights=weights, model_dir=model_dir)
    from_disk = load_adapter_dir(path / "adapter")
    assert set(from_disk) == set(weights) and all(torch.equal(from_disk[k], weights[k]) for k in weights)


@pytest.mark.slow
def test_a_lora_learner_trains_checkpoints_and_resumes_publishing_its_adapters(model_dir, redis_url, tmp_path):
    """The whole learner loop with LoRA (real Redis): two updates, a checkpoint, then a resumed learner
    holds the same adapters and publishes them (adapter names only) as the checkpoint's version."""
    from worldloop.learner.engine import init_distributed
    from worldloop.learner.process import Learner
    from worldloop.testing.learner import tiny_learner_config, train_until_stopped

    def config(resume: bool):
        cfg = tiny_learner_config(model_dir, redis_url, tmp_path / "run", namespace="lora", total_steps=2,
                                  checkpoint_every=2, kl_coef=0.01, resume=resume)
        cfg.model.lora = LORA
        return cfg

    from worldloop.common.contracts.modeling import ChatCodec

    codec = ChatCodec(model_dir, max_image_side=112)
    trajs = [synthetic_trajectory(codec, trajectory_id=f"t{i}", seed=i, turns=1, response_tokens=5, env_reward=float(i % 2),
                                  image_side=28) for i in range(8)]
    first, rc = train_until_stopped(config(False), trajs)
    assert rc == 0 and first.version == 2
    trained = {k: v.clone() for k, v in first.models.policy_hf.named_parameters() if is_adapter_name(k)}
    path = tmp_path / "run" / "checkpoints" / "step_00000002"
    assert (path / "adapter" / "adapter_model.safetensors").is_file() and (path / "hf" / "config.json").is_file()

    cfg = config(True)
    again = Learner(cfg, init_distributed(cfg))
    try:
        assert again.version == 2
        sub = WeightSubscriber("127.0.0.1", again.publisher.pub_port, again.publisher.fetch_port, fetch_timeout_s=30)
        try:
            version, tensors = sub.fetch(min_version=0)
        finally:
            sub.close()
        assert version == 2 and set(tensors) == set(trained)
        assert all(torch.equal(tensors[k], trained[k]) for k in trained)
    finally:
        again.close()
