"""``trainer.proximal_from_first_pass``: the first PPO mini-batch's proximal log-probs come from its
first training forward, made with the same weights on the same inputs (learner/trainer.py).

* the update (losses, importance weights, the gradient at both optimizer steps, the weights after
  them, the behaviour/proximal mismatch statistics) equals the one with the whole no-grad proximal
  pass, with a critic (bilevel_gae) and without (grpo, two groups of 4), packed and padded, ZeRO-0 and ZeRO-2;
* the no-grad proximal pass runs on the other mini-batch's rows only (the tokens the policy's
  no-grad forwards saw, counted);
* it stays off where something reads the proximal log-probs before training: a reference model
  (``kl_coef`` > 0: the KL reward) and an ``off_policy`` mode other than ``cap`` (weights over
  the whole batch).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from test_microbatch import _recording_engine, _trajectories, assert_same_update  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(shared_tiny_model) -> Path:
    return shared_tiny_model(max_image_side=112)


def _update(model_dir: Path, *, first_pass: bool, estimator: str = "bilevel_gae", kl_coef: float = 0.0,
            packing: bool = True, zero_stage: int = 0, off_policy: str = "cap"):
    """One update of 8 trajectories (2 mini-batches of 4) on fresh models: (stats, {engine: [grads per
    step]}, {engine: [final parameters]}, tokens seen by the policy's no-grad forwards, trainer)."""
    from worldloop.common.contracts.modeling import ChatCodec, load_policy
    from worldloop.learner.engine import assemble_models, init_distributed, load_backbone
    from worldloop.learner.trainer import PPOTrainer
    from worldloop.testing.learner import tiny_learner_config

    critic = estimator == "bilevel_gae"
    cfg = tiny_learner_config(model_dir, "redis://127.0.0.1:1", model_dir.parent / "run", train_batch_size=8,
                              ppo_mini_batch_size=4, micro_batch_size=2, micro_batch_tokens=0, zero_stage=zero_stage,
                              kl_coef=kl_coef, estimator=estimator, use_critic=critic, packing=packing,
                              off_policy=off_policy, proximal_from_first_pass=first_pass)
    codec = ChatCodec(model_dir, max_image_side=112)
    optimizers: dict = {}
    torch.manual_seed(0)
    models = assemble_models(cfg, init_distributed(cfg), codec, load_policy(model_dir),
                             load_backbone(model_dir) if critic else None,
                             load_policy(model_dir) if kl_coef > 0 else None, engine_fn=_recording_engine(optimizers))
    if critic:
        torch.nn.init.normal_(models.critic.module.value_head.weight, std=0.5)  # values that are not all 0
    no_grad_tokens = []
    models.policy.module.register_forward_pre_hook(
        lambda _m, args: None if torch.is_grad_enabled() else no_grad_tokens.append(int(args[0]["attention_mask"].sum())))
    trainer = PPOTrainer(cfg, models, seed=3)
    trajs = _trajectories(codec, 8)
    for i, t in enumerate(trajs):
        t.group_id = f"level-{i // 4}"  # (their env rewards differ within each group)
    stats = trainer.update(trajs, step=1)
    params = {name: [p.detach().clone() for p in getattr(models, name).module.parameters()]
              for name in ("policy", "critic") if getattr(models, name) is not None}
    return stats, {k: o.seen for k, o in optimizers.items()}, params, sum(no_grad_tokens), trainer


def _assert_same(a, b) -> None:
    """The update (test_microbatch's comparison) and its mismatch statistics."""
    assert_same_update(a[:3], b[:3])
    for key, value in a[0]["mismatch"].items():
        if isinstance(value, float):
            assert b[0]["mismatch"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("estimator,packing,zero_stage", [("bilevel_gae", True, 0), ("grpo", True, 2),
                                                           ("grpo", False, 0)])
def test_the_first_mini_batch_takes_its_proximal_from_its_forward(model_dir, estimator, packing, zero_stage):
    whole = _update(model_dir, first_pass=False, estimator=estimator, packing=packing, zero_stage=zero_stage)
    first = _update(model_dir, first_pass=True, estimator=estimator, packing=packing, zero_stage=zero_stage)
    trainer = first[4]
    assert trainer._proximal_in_training() and not whole[4]._proximal_in_training()
    # the no-grad proximal pass saw every row's tokens, then only the second mini-batch's rows
    rows = trainer._chunks(trainer._orders(8, 1)[0], 4)
    batch_lengths = trainer._collate(_trajectories(trainer.models.codec, 8))[2]
    assert whole[3] == sum(batch_lengths)
    assert first[3] == sum(batch_lengths[r] for r in rows[1]) < whole[3]
    # the policy's importance weights were not all 1 (the behaviour log-probs are not the policy's)
    assert abs(whole[0]["policy_iw_mean"] - 1.0) > 0.01
    _assert_same(whole, first)


@pytest.mark.parametrize("kl_coef,off_policy", [(0.01, "cap"), (0.0, "tis")])
def test_it_stays_off_where_the_proximal_is_read_before_training(model_dir, kl_coef, off_policy):
    on = _update(model_dir, first_pass=True, estimator="grpo", kl_coef=kl_coef, off_policy=off_policy)
    assert not on[4]._proximal_in_training()
    batch_lengths = on[4]._collate(_trajectories(on[4].models.codec, 8))[2]
    assert on[3] == sum(batch_lengths)  # the whole no-grad pass ran
