"""Padding-free packing of micro-batches (``trainer.packing``, learner/microbatch.py).

* the first-fit-decreasing plan and the packed layout against hand-computed values;
* on the tiny Qwen2.5-VL with images in every turn (fp32, CPU): the proximal and reference
  log-probs, the entropies and the critic's values of packed micro-batches equal the padded
  path's within 1e-5, token by token; the M-RoPE ids of a packed row are each trajectory's own;
  a packed row isolates its trajectories (changing one trajectory's tokens changes no other's
  log-probs);
* one whole PPO update (ZeRO-0 and ZeRO-2, entropy bonus on) gives the padded update's losses,
  gradients and weights, with less than 2 % of its token slots padding.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from worldloop.learner.microbatch import (packed_micro_batches, packed_slices, place, slots,  # noqa: E402
                                          split_micro_batches)
from test_microbatch import _trajectories, assert_same_update, run_update  # noqa: E402

# --------------------------------------------------------------------------- plans and layout, by hand

LENGTHS = [10, 30, 17, 5, 64, 12]


def test_first_fit_decreasing_fills_each_micro_batch_up_to_the_budget():
    # longest first: 64 | 30: 64+30 -> 96 > 72, a new one | 17: 64+17 -> 88 no, 30+17 -> 48 | 12:
    # 59 -> 64 | 10: 74 -> 80 no, 69 -> 72 | 5: 64+5 -> 72 fits the first
    assert packed_micro_batches(list(range(6)), LENGTHS, 72) == [[4, 3], [1, 2, 5, 0]]
    # budget 40: 64 alone (longer than the budget) | 30 | 17: 47 -> 48 no, a third | 12: 30+12 ->
    # 48 no, 17+12 -> 32 | 10: 30+10 = 40 | 5: 45 -> 48 no, 29+5 -> 40
    assert packed_micro_batches(list(range(6)), LENGTHS, 40) == [[4], [1, 0], [2, 5, 3]]
    # slots: packed = sum rounded up to 8; padded = rows x padded longest
    assert slots([1, 2, 5, 0], LENGTHS, 8, packed=True) == 72 and slots([1, 2, 5, 0], LENGTHS, 8) == 4 * 32
    # splitting halves the packed micro-batch with the most slots: both have 72, the first wins the tie
    assert split_micro_batches([[4, 3], [1, 2, 5, 0]], LENGTHS, 3, packed=True) == [[4], [3], [1, 2, 5, 0]]


def test_packed_layout_restarts_positions_and_clears_the_first_token():
    batch = {"input_ids": torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]]),
             "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]),
             "logprob_mask": torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]]),
             "rope_positions": torch.tensor([[[0, 0, 0], [1, 1, 1], [2, 3, 4], [0, 0, 0]],
                                             [[0, 0, 0], [1, 1, 1], [0, 0, 0], [0, 0, 0]]])}
    mb = packed_slices(batch, [1, 0], [0, 0], [3, 2], pad_to=8)
    assert mb["input_ids"].tolist() == [[8, 9, 5, 6, 7, 0, 0, 0]]
    assert mb["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0, 0]]
    assert mb["seq_start"].tolist() == [[1, 0, 1, 0, 0, 0, 0, 0]]
    # row 1's position 0 was wanted (1.0) but is a trajectory start in the pack: cleared
    assert mb["logprob_mask"].tolist() == [[0, 1, 0, 1, 1, 0, 0, 0]]
    pos = mb["position_ids"]
    assert pos.shape == (4, 1, 8)
    assert pos[0, 0].tolist() == [0, 1, 0, 1, 2, 0, 1, 2]  # text: restarts per trajectory, then the tail
    assert pos[1:, 0, :5].T.tolist() == [[0, 0, 0], [1, 1, 1], [0, 0, 0], [1, 1, 1], [2, 3, 4]]
    assert mb["pack_index"].tolist() == [4, 5, 0, 1, 2]  # row * 4 + column
    dst = torch.zeros(2, 4)
    place(dst, mb, [1, 0], torch.arange(8.0)[None])
    assert dst.tolist() == [[2, 3, 4, 0], [0, 1, 0, 0]]


# --------------------------------------------------------------------------- the tiny model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from worldloop.bootstrap.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "vl", max_image_side=112)


def _trainer(model_dir: Path, packing: bool, micro_batch_tokens=0):
    from worldloop.common.contracts.modeling import ChatCodec, load_policy
    from worldloop.learner.engine import assemble_models, init_distributed, load_backbone
    from worldloop.testing.learner import tiny_learner_config
    from worldloop.learner.trainer import PPOTrainer

    cfg = tiny_learner_config(model_dir, "redis://127.0.0.1:1", model_dir.parent / "run", train_batch_size=8,
                              ppo_mini_batch_size=4, micro_batch_size=4, micro_batch_tokens=micro_batch_tokens,
                              zero_stage=0, kl_coef=0.01, estimator="bilevel_gae", packing=packing)
    codec = ChatCodec(model_dir, max_image_side=112)
    torch.manual_seed(0)
    models = assemble_models(cfg, init_distributed(cfg), codec, load_policy(model_dir), load_backbone(model_dir),
                             load_policy(model_dir))
    torch.nn.init.normal_(models.critic.module.value_head.weight, std=0.5)  # zero-initialised: make values nonzero
    return PPOTrainer(cfg, models, seed=3), codec


def _entropies(trainer, batch, counts, lengths, plan) -> torch.Tensor:
    out = torch.zeros(batch["input_ids"].shape)
    with torch.no_grad():
        for rows in plan:
            mb = trainer._slices(batch, rows, counts, lengths)
            _, ent = trainer.models.policy.module(mb, return_entropy=True)
            place(out, mb, rows, ent)
    return out


@pytest.mark.parametrize("micro_batch_tokens", [0, 600])
def test_packed_forward_equals_the_padded_forward(model_dir, micro_batch_tokens):
    padded, codec = _trainer(model_dir, packing=False, micro_batch_tokens=micro_batch_tokens)
    packed, _ = _trainer(model_dir, packing=True, micro_batch_tokens=micro_batch_tokens)
    trajs = _trajectories(codec, 8)
    assert sum(len(t.images) for x in trajs for t in x.turns) >= 8  # images in the sequences
    results = []
    for trainer in (padded, packed):
        batch, counts, lengths = trainer._collate(trajs)
        timing: dict = {"slots": 0.0, "real": 0.0}
        pre = trainer._precompute(batch, counts, lengths, timing)
        plan = trainer._plan([list(range(len(lengths)))], lengths)[0]
        results.append((batch, pre, _entropies(trainer, batch, counts, lengths, plan), timing, plan))
    (b0, p0, e0, t0, plan0), (b1, p1, e1, t1, plan1) = results
    assert "rope_positions" in b1 and "rope_positions" not in b0
    if micro_batch_tokens:
        assert len(plan1) < len(plan0)  # packing fills the budget with more rows
    mask = b0["logprob_mask"] > 0
    assert int(mask.sum()) > 100
    real = b0["attention_mask"] > 0  # (the padded path's values on its padding are meaningless)
    for key in ("old_logprobs", "ref_logprobs", "old_values"):
        a, b = p0[key][real], p1[key][real]
        assert float(a.abs().max()) > 0.01, key  # not all zeros
        assert torch.allclose(b, a, atol=1e-5, rtol=0), (key, float((b - a).abs().max()))
    assert float(e0[mask].min()) > 0.1
    assert torch.allclose(e1, e0, atol=1e-5, rtol=0), float((e1 - e0).abs().max())
    assert 1 - t1["real"] / t1["slots"] < 0.02 < 1 - t0["real"] / t0["slots"]


def test_mrope_ids_are_each_trajectorys_own(model_dir):
    """A trajectory's M-RoPE ids in a pack equal those the model computes for it alone (its images'
    height/width ids start where its own text left off, not where the pack's did)."""
    from worldloop.learner.microbatch import rope_positions

    trainer, codec = _trainer(model_dir, packing=True)
    trajs = _trajectories(codec, 4)
    batch, counts, lengths = trainer._collate(trajs)
    mb = packed_slices(batch, [2, 0, 1], counts, lengths, pad_to=8)
    start = lengths[2]
    alone, _, _ = trainer._collate([trajs[0]])
    own = rope_positions(trainer.models.policy_hf, alone)[0, : lengths[0]]  # [n, 3]
    got = mb["position_ids"][1:, 0, start : start + lengths[0]].T
    assert torch.equal(got, own)
    assert int(own.max()) < lengths[0]  # vision ids compress positions: not a plain arange
    assert not torch.equal(own[:, 1], torch.arange(lengths[0]))


def test_text_only_rows_of_an_mrope_model_still_get_four_position_rows(model_dir):
    """Without image tokens (no mm_token_type_ids) Qwen2.5-VL would expand 2-D position ids to its
    3 M-RoPE rows and drop the text row that carries the restarts: the pack must stay [4, 1, T]."""
    from worldloop.learner.microbatch import rope_positions

    trainer, _ = _trainer(model_dir, packing=True)
    batch = {"input_ids": torch.tensor([[5, 6, 7], [8, 9, 0]]), "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]])}
    rope = rope_positions(trainer.models.policy_hf, batch)
    assert rope.shape == (2, 3, 3) and rope[1, :, 2].tolist() == [0, 1, 2]
    batch["rope_positions"] = rope
    mb = packed_slices(batch, [0, 1], [0, 0], [3, 2], pad_to=8)
    assert mb["position_ids"].shape == (4, 1, 8)
    assert mb["position_ids"][:, 0, :5].tolist() == [[0, 1, 2, 0, 1]] * 4


def test_a_packed_row_isolates_its_trajectories(model_dir):
    """Changing the response tokens of the first trajectory of a pack leaves the log-probs of the
    trajectories after it unchanged (no attention across the boundary)."""
    trainer, codec = _trainer(model_dir, packing=True)
    trajs = _trajectories(codec, 3)
    batch, counts, lengths = trainer._collate(trajs)
    policy = trainer.models.policy.module
    with torch.no_grad():
        mb = packed_slices(batch, [0, 1, 2], counts, lengths)
        a, _ = policy(mb)
        changed = dict(mb)
        ids = mb["input_ids"].clone()
        resp = mb["response_mask"][0, : lengths[0]] > 0
        ids[0, : lengths[0]][resp] = (ids[0, : lengths[0]][resp] + 7) % 60 + 20
        changed["input_ids"] = ids
        b, _ = policy(changed)
    assert not torch.allclose(a[0, : lengths[0]], b[0, : lengths[0]])  # the change reached trajectory 0
    assert torch.equal(a[0, lengths[0] :], b[0, lengths[0] :])


@pytest.mark.parametrize("stage", [0, 2])
def test_packed_update_equals_the_padded_update(model_dir, stage):
    """Losses (entropy bonus and KL in the loss), gradients at both optimizer steps, final weights."""
    padded = run_update(model_dir, micro_batch_tokens=400, zero_stage=stage, packing=False, entropy_coef=0.01)
    packed = run_update(model_dir, micro_batch_tokens=400, zero_stage=stage, packing=True, entropy_coef=0.01)
    assert packed[0]["padding_fraction"] < 0.02 < padded[0]["padding_fraction"]
    assert packed[0]["tokens"] == padded[0]["tokens"]
    assert_same_update(padded, packed)
