"""Micro-batches by token budget (``trainer.micro_batch_tokens``, learner/microbatch.py), padded rows.

* the planning functions against hand-computed splits;
* with real DeepSpeed engines (CPU, gloo) on the tiny Qwen2.5-VL and trajectories of several-fold
  different lengths, one PPO update with token-budget micro-batches gives the same losses and the
  same gradient at every optimizer step as today's fixed-count micro-batches on the same batch,
  while computing less padding (ZeRO-0 and ZeRO-2, where gradients are reduced on every backward);
* under ``torchrun`` with two ranks whose token-budget plans differ in length, ZeRO-2 does not
  hang (every rank runs the same number of micro-batches) and the gradients still match the
  fixed-count update.
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

from worldloop.learner.microbatch import split_micro_batches, token_budget_micro_batches  # noqa: E402
from procs import two_ranks  # noqa: E402

# --------------------------------------------------------------------------- planning, by hand

LENGTHS = [10, 30, 17, 5, 64, 12]  # padded to 8: 16, 32, 24, 8, 64, 16


def test_budget_fills_longest_first_up_to_rows_times_padded_longest():
    # sorted: 4(64) 1(30->32) 2(17) 5(12) 0(10) 3(5)
    # [4]: 2 x 64 = 128 > 96, closed; [1, 2, 5]: 3 x 32 = 96 fits, a 4th would be 128;
    # [0, 3]: 2 x 16 = 32
    assert token_budget_micro_batches(list(range(6)), LENGTHS, 96) == [[4], [1, 2, 5], [0, 3]]


def test_a_row_longer_than_the_budget_goes_alone_and_ties_keep_their_order():
    # budget 40: [4] (64 alone), [1] (2 x 32 = 64 > 40), [2] (2 x 24 = 48 > 40), [5, 0] (2 x 16),
    # [3] (3 x 16 = 48 > 40)
    assert token_budget_micro_batches(list(range(6)), LENGTHS, 40) == [[4], [1], [2], [5, 0], [3]]
    # equal lengths: the given order (a shuffled mini-batch) is kept; 3 x 8 = 24 > 16
    assert token_budget_micro_batches([3, 1, 2, 0], [8, 8, 8, 8], 16) == [[3, 1], [2, 0]]
    # only the given rows are planned
    assert token_budget_micro_batches([3, 0], LENGTHS, 1000) == [[0, 3]]


def test_split_halves_the_costliest_micro_batch_until_the_count_is_reached():
    plan = [[4], [1, 2, 5], [0, 3]]  # slots 64, 96, 32
    # 96 -> [1, 2] (64) + [5] (16); then [1, 2] (64) beats [0, 3] (32): [1] + [2]
    assert split_micro_batches(plan, LENGTHS, 4) == [[4], [1, 2], [5], [0, 3]]
    assert split_micro_batches(plan, LENGTHS, 5) == [[4], [1], [2], [5], [0, 3]]
    assert split_micro_batches(plan, LENGTHS, 3) == plan
    assert split_micro_batches(plan, LENGTHS, 6) == [[4], [1], [2], [5], [0], [3]]
    with pytest.raises(ValueError, match="7 micro-batches of 6 rows"):
        split_micro_batches(plan, LENGTHS, 7)


# --------------------------------------------------------------------------- real engines

BUDGET = 320  # token slots: a 232-token row goes alone, two of 144 fit


def _trajectories(codec, n: int = 8):
    """The first 8: lengths 53 to 231 tokens (1 to 3 turns, 4 to 40 response tokens); the next 8
    (the second rank's half of 16): all short. The same batch every call."""
    from worldloop.testing.trajectories import synthetic_trajectory

    shapes = [(1, 4), (3, 40), (1, 8), (2, 30), (3, 36), (1, 6), (2, 12), (3, 24),
              (1, 4), (1, 6), (1, 8), (1, 5), (1, 7), (1, 4), (1, 6), (1, 3)]
    return [synthetic_trajectory(codec, trajectory_id=f"m{i}", seed=i, turns=shapes[i][0], response_tokens=shapes[i][1],
                                 env_reward=float(i % 3), success=i % 2 == 1) for i in range(n)]


class _Recording(torch.optim.AdamW):
    """A client AdamW that keeps a copy of the gradients it is asked to apply (one list per step)."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.seen: list[torch.Tensor] = []

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad.detach().flatten().double() for g in self.param_groups for p in g["params"] if p.grad is not None]
        self.seen.append(torch.cat(grads).clone())
        return super().step(closure)


def _recording_engine(optimizers: dict):
    import deepspeed

    def make(module, lr, config):
        params = [p for p in module.parameters() if p.requires_grad]
        opt = _Recording(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=opt, model_parameters=params, config=config)
        optimizers["critic" if hasattr(module, "value_head") else "policy"] = opt
        return engine

    return make


def run_update(model_dir: Path, *, micro_batch_tokens: int | str, zero_stage: int, train_batch_size: int = 8,
               mini: int = 4, micro: int = 2, redis_url: str = "redis://127.0.0.1:1",
               loss_agg_mode: str = "token-mean", packing: bool = False, **trainer) -> tuple[dict, dict, dict]:
    """One PPOTrainer.update on fresh models from ``model_dir``: (stats, {engine: [grads per step]},
    {engine: [final parameters]}). Padded rows unless ``packing`` (this file tests the padded plans;
    tests/test_packing.py the packed layout)."""
    from worldloop.common.contracts.modeling import ChatCodec, load_policy
    from worldloop.learner.engine import assemble_models, init_distributed, load_backbone
    from worldloop.testing.learner import tiny_learner_config
    from worldloop.learner.trainer import PPOTrainer

    cfg = tiny_learner_config(model_dir, redis_url, model_dir.parent / "run", train_batch_size=train_batch_size,
                              ppo_mini_batch_size=mini, micro_batch_size=micro, micro_batch_tokens=micro_batch_tokens,
                              zero_stage=zero_stage, kl_coef=0.01, estimator="bilevel_gae", loss_agg_mode=loss_agg_mode,
                              packing=packing, **trainer)
    dist = init_distributed(cfg)
    codec = ChatCodec(model_dir, max_image_side=112)
    optimizers: dict = {}
    torch.manual_seed(0)
    models = assemble_models(cfg, dist, codec, load_policy(model_dir), load_backbone(model_dir), load_policy(model_dir),
                             engine_fn=_recording_engine(optimizers))
    stats = PPOTrainer(cfg, models, seed=3).update(_trajectories(codec, train_batch_size), step=1)
    params = {"policy": [p.detach().clone() for p in models.policy.module.parameters()],
              "critic": [p.detach().clone() for p in models.critic.module.parameters()]}
    return stats, {k: o.seen for k, o in optimizers.items()}, params


def assert_same_update(a: tuple, b: tuple) -> None:
    (sa, ga, pa), (sb, gb, pb) = a, b
    # (value_explained_variance is a variance ratio per micro-batch, averaged: it depends on the split)
    for key in ("policy_loss", "value_loss", "policy_entropy", "policy_clip_fraction", "policy_iw_mean",
                "value_clip_fraction", "grad_norm_policy", "grad_norm_critic"):
        if "critic" not in ga and (key.endswith("critic") or key.startswith("value_")):
            assert key not in sa and key not in sb, key  # an update without a critic has no value terms
            continue
        assert sb[key] == pytest.approx(sa[key], rel=1e-5, abs=1e-7), key
    assert ga.keys() == gb.keys() and pa.keys() == pb.keys()
    for name in ga:  # the policy, and the critic where the update has one
        assert len(ga[name]) == len(gb[name]) == 2  # one optimizer step per mini-batch
        # (a rank's ZeRO-2 partition of the critic may hold only backbone weights, whose first
        # gradient is 0 behind the zero-initialised value head: one scale per engine)
        scale = max(float(x.abs().max()) for x in ga[name])
        assert scale > 0
        for x, y in zip(ga[name], gb[name]):
            assert torch.allclose(x, y, rtol=1e-4, atol=1e-5 * scale), (name, float((x - y).abs().max()), scale)
        # Adam moves each weight by about lr = 1e-3 whatever the gradient's size, so float noise on a
        # near-zero gradient shows in the weights: compare them to 2% of one step
        for x, y in zip(pa[name], pb[name]):
            assert torch.allclose(x, y, atol=2e-5), name


@pytest.fixture(scope="module")
def model_dir(shared_tiny_model) -> Path:
    return shared_tiny_model(max_image_side=112)


@pytest.mark.parametrize("stage", [0, 2])
def test_token_budget_gives_the_fixed_count_loss_and_gradient(model_dir, stage):
    fixed = run_update(model_dir, micro_batch_tokens=0, zero_stage=stage)
    budget = run_update(model_dir, micro_batch_tokens=BUDGET, zero_stage=stage)
    # the splits differ (else this would compare a thing with itself): not 2 micro-batches per
    # mini-batch, so DeepSpeed's own counter (accumulation 2) would put the boundary elsewhere
    assert fixed[0]["micro_batches"] == 4  # 2 mini-batches x 2 fixed micro-batches
    assert budget[0]["micro_batches"] != 4
    assert budget[0]["padding_fraction"] < fixed[0]["padding_fraction"]
    assert budget[0]["tokens"] == fixed[0]["tokens"]
    assert_same_update(fixed, budget)


@pytest.mark.parametrize("stage,micro_batch_tokens", [(0, 0), (2, BUDGET)])
def test_length_buckets_give_the_same_loss_and_gradient(model_dir, stage, micro_batch_tokens):
    """trainer.pad_to_multiple: micro-batches padded to multiples of 128 tokens (the CUDA default)
    instead of 8 compute more padding and give the same update: every loss term is masked."""
    plain = run_update(model_dir, micro_batch_tokens=micro_batch_tokens, zero_stage=stage, pad_to_multiple=8)
    bucketed = run_update(model_dir, micro_batch_tokens=micro_batch_tokens, zero_stage=stage, pad_to_multiple=128)
    assert bucketed[0]["padding_fraction"] > plain[0]["padding_fraction"] + 0.1  # the buckets were applied
    assert bucketed[0]["micro_batches"] == plain[0]["micro_batches"]
    assert_same_update(plain, bucketed)


def test_auto_budget_on_cpu_is_the_fixed_counts_worst_case(model_dir):
    """micro_batch_tokens: auto on CPU = micro_batch_size rows of the update's longest (padded)
    trajectory: by the token budget, so fewer micro-batches than the fixed count, same update."""
    from worldloop.learner.microbatch import auto_budget

    assert auto_budget([53, 231, 90], 2, 8) == 2 * 232 and auto_budget([53, 231, 90], 3, 128) == 3 * 256
    fixed = run_update(model_dir, micro_batch_tokens=0, zero_stage=0, micro=1)
    auto = run_update(model_dir, micro_batch_tokens="auto", zero_stage=0, micro=1)
    assert auto[0]["micro_batches"] < fixed[0]["micro_batches"] == 8, (auto[0]["micro_batches"], fixed[0]["micro_batches"])
    assert_same_update(fixed, auto)


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_per_trajectory_aggregation_is_exact_whatever_the_split(model_dir, mode):
    """trainer.loss_agg_mode: the per-trajectory modes give one update whatever the micro-batch
    split, and it is not the token mean's (the batch's trajectories differ up to 10x in length)."""
    fixed = run_update(model_dir, micro_batch_tokens=0, zero_stage=0, loss_agg_mode=mode)
    budget = run_update(model_dir, micro_batch_tokens=BUDGET, zero_stage=0, loss_agg_mode=mode)
    assert budget[0]["micro_batches"] != fixed[0]["micro_batches"]
    assert_same_update(fixed, budget)
    token_mean = run_update(model_dir, micro_batch_tokens=0, zero_stage=0)
    g_mode, g_tok = fixed[1]["policy"][0], token_mean[1]["policy"][0]
    cos = float(g_mode @ g_tok / (g_mode.norm() * g_tok.norm()))
    if mode == "seq-mean-token-mean":
        assert cos < 0.999, cos  # long trajectories no longer dominate: another direction
    else:
        # every token weighs 1 as in the token mean, divided by the rows instead of the tokens: the
        # same direction, larger by the mean loss tokens per trajectory (then clipped at
        # trainer.max_grad_norm 1, so only the direction and "larger" are checked)
        assert cos > 0.99999 and g_mode.norm() > 1.2 * g_tok.norm(), (cos, float(g_mode.norm()), float(g_tok.norm()))
    # the critic's loss is the token mean in every mode
    assert torch.allclose(fixed[1]["critic"][0], token_mean[1]["critic"][0], rtol=1e-4, atol=1e-7)


# --------------------------------------------------------------------------- two ranks


def _worker(model_dir: str, out: str) -> None:
    """Run under torchrun: both modes on the same global batch, ZeRO-2; rank 0 writes the result."""
    from procs import rank0_compares

    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".torch_extensions"))
    runs = {}
    # 16 trajectories, 8 per rank, mini-batches of 4 per rank: the shapes (and so the plans) differ by rank
    for tokens in (0, BUDGET):
        runs[tokens] = run_update(Path(model_dir), micro_batch_tokens=tokens, zero_stage=2, train_batch_size=16, mini=8, micro=2)
    s0, s1 = runs[0][0], runs[BUDGET][0]
    rank0_compares(out, lambda: assert_same_update(runs[0], runs[BUDGET]), micro_fixed=s0["micro_batches"],
                   micro_budget=s1["micro_batches"], pad_fixed=s0["padding_fraction"], pad_budget=s1["padding_fraction"])


@pytest.mark.slow
@pytest.mark.timeout(800)  # the two ranks are waited on for up to 600 s
def test_two_ranks_with_different_plans_run_the_same_micro_batch_count(model_dir, tmp_path):
    res = two_ranks(Path(__file__).resolve(), [str(model_dir)], tmp_path / "result.json",
                    "two ranks under torch.distributed.run")
    assert res["same"] == "ok", res
    assert res["micro_fixed"] == 4 and res["micro_budget"] != 4
    assert res["pad_budget"] < res["pad_fixed"]

if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--worker":
    _worker(sys.argv[2], sys.argv[3])
