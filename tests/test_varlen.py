"""Varlen attention of packed rows (learner/varlen.py, issue 40 item 1).

* the attention of each trajectory of a packed row equals the attention formula computed by hand,
  token by token, with grouped KV heads (two query heads per KV head);
* over generated segment lengths (hypothesis), outputs and gradients equal SDPA over the whole row
  with an explicit block-diagonal causal mask, the layout transformers' SDPA would build;
* a module that is not causal (the vision tower's attention) and a call without segments get
  plain SDPA; segments that do not cover the row, and a padding mask beside them, are refused;
* ``segments_of``: bounds, longest segment and the int32 tensor of generated lengths; bad lengths
  are refused;
* the mask function builds no mask without a padding mask, and SDPA's with one;
* ``assemble_models`` with ``trainer.packing`` puts every model on it; without, on SDPA;
* a failing varlen kernel (the CUDA branch, made to apply and fail on the CPU) is tried once,
  logged once, and the per-trajectory path answers; out of memory is raised, not absorbed.
The packed-equals-padded checks of whole models are in tests/test_packing.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worldloop.common.contracts.logprobs import segments_of
from worldloop.learner import varlen


class _Module(torch.nn.Module):
    def __init__(self, causal: bool = True, groups: int = 2):
        super().__init__()
        self.is_causal = causal
        self.num_key_value_groups = groups


def _qkv(t: int, hq: int = 4, hk: int = 2, d: int = 8, seed: int = 0, grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, h, t, d, generator=g, dtype=torch.float64).requires_grad_(grad) for h in (hq, hk, hk)]


def _by_hand(q, k, v, lengths, scale):
    """out[t, h] = sum_j softmax_j(q[h, t] . k[h // g, j] * scale) v[h // g, j], j from the start of
    t's trajectory to t: plain loops over the formula."""
    hq, hk = q.shape[1], k.shape[1]
    out = torch.zeros(q.shape[2], hq, q.shape[3], dtype=q.dtype)
    start = 0
    for n in lengths:
        for t in range(start, start + n):
            for h in range(hq):
                kv = h // (hq // hk)
                scores = [float(q[0, h, t] @ k[0, kv, j]) * scale for j in range(start, t + 1)]
                top = max(scores)
                w = [math.exp(s - top) for s in scores]
                total = sum(w)
                for j, wj in zip(range(start, t + 1), w):
                    out[t, h] += (wj / total) * v[0, kv, j]
        start += n
    return out


def _block_reference(q, k, v, lengths, scale):
    """SDPA over the whole row with an explicit block-diagonal causal mask, [1, T, H, D]."""
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    t = ids.numel()
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    mask = causal & (ids[:, None] == ids[None, :])
    groups = q.shape[1] // k.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=mask[None, None], scale=scale)
    return out.transpose(1, 2)


def test_each_trajectory_attends_to_itself_by_the_formula():
    lengths = [5, 3, 4]
    q, k, v = _qkv(sum(lengths))
    out, weights = varlen.varlen_attention(_Module(), q, k, v, None, scaling=0.3,
                                           worldloop_segments=segments_of(lengths))
    assert weights is None and out.shape == (1, 12, 4, 8)
    expected = _by_hand(q, k, v, lengths, 0.3)
    assert torch.allclose(out[0], expected, atol=1e-12, rtol=0), float((out[0] - expected).abs().max())
    # the first token of the second trajectory sees only itself: its output is its own value
    assert torch.allclose(out[0, 5, 0], v[0, 0, 5]) and torch.allclose(out[0, 5, 3], v[0, 1, 5])
    # and the whole row attended as one sequence differs there (the boundary is what changed)
    whole, _ = varlen.varlen_attention(_Module(), q, k, v, None, scaling=0.3, worldloop_segments=segments_of([12]))
    assert not torch.allclose(whole[0, 5], out[0, 5])


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=5), st.integers(0, 1000))
def test_outputs_and_gradients_equal_the_block_diagonal_mask(lengths, seed):
    q, k, v = _qkv(sum(lengths), seed=seed, grad=True)
    out, _ = varlen.varlen_attention(_Module(), q, k, v, None, scaling=0.25, worldloop_segments=segments_of(lengths))
    ref = _block_reference(q, k, v, lengths, 0.25)
    assert torch.allclose(out, ref, atol=1e-12, rtol=0)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b, atol=1e-10, rtol=0)


def test_non_causal_modules_and_calls_without_segments_get_plain_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v = _qkv(10)
    seg = segments_of([4, 6])
    # the vision tower's attention (not causal) ignores the text's segments
    vision, _ = varlen.varlen_attention(_Module(causal=False), q, k, v, None, scaling=0.5, is_causal=False,
                                        worldloop_segments=seg)
    plain, _ = sdpa_attention_forward(_Module(causal=False), q, k, v, None, scaling=0.5, is_causal=False)
    assert torch.equal(vision, plain)
    causal, _ = varlen.varlen_attention(_Module(), q, k, v, None, scaling=0.5)
    assert torch.allclose(causal, _block_reference(q, k, v, [10], 0.5), atol=1e-12)


def test_segments_that_do_not_fit_the_row_are_refused():
    q, k, v = _qkv(10)
    with pytest.raises(ValueError, match="segments cover 9 tokens, the row has 10"):
        varlen.varlen_attention(_Module(), q, k, v, None, worldloop_segments=segments_of([4, 5]))
    with pytest.raises(ValueError, match="one packed row and no attention mask"):
        varlen.varlen_attention(_Module(), q, k, v, torch.ones(1, 1, 10, 10, dtype=torch.bool),
                                worldloop_segments=segments_of([10]))


@given(st.lists(st.integers(1, 5000), min_size=1, max_size=40))
def test_segments_of_lengths(lengths):
    seg = segments_of(lengths)
    assert seg.bounds[0] == 0 and len(seg.bounds) == len(lengths) + 1
    assert [b - a for a, b in zip(seg.bounds, seg.bounds[1:])] == lengths
    assert seg.max_len == max(lengths)
    assert seg.cu.dtype == torch.int32 and seg.cu.tolist() == list(seg.bounds)
    assert seg.on(torch.device("cpu")) is seg


@pytest.mark.parametrize("lengths", [[], [3, 0, 2], [-1]])
def test_segments_of_refuses_empty_segments(lengths):
    with pytest.raises(ValueError, match="at least one token"):
        segments_of(lengths)


def test_the_mask_function_builds_a_mask_only_for_padding():
    from transformers.masking_utils import causal_mask_function

    args = dict(batch_size=1, q_length=4, kv_length=4, mask_function=causal_mask_function, allow_is_causal_skip=False)
    assert varlen._mask(**args, attention_mask=None) is None
    mask = varlen._mask(**args, attention_mask=torch.tensor([[1, 1, 1, 0]], dtype=torch.bool))
    assert mask.shape == (1, 1, 4, 4)
    assert mask[0, 0].tolist() == [[True, False, False, False], [True, True, False, False],
                                   [True, True, True, False], [True, True, True, False]]


@pytest.mark.parametrize("packing", [True, False])
def test_assembled_models_run_varlen_only_when_packing(tmp_path, packing):
    from worldloop.bootstrap.tiny_model import make_tiny_model
    from worldloop.common.contracts.modeling import ChatCodec, load_policy
    from worldloop.learner.engine import assemble_models, init_distributed, load_backbone
    from worldloop.testing.learner import tiny_learner_config

    model_dir = make_tiny_model(tmp_path / "vl", max_image_side=112)
    cfg = tiny_learner_config(model_dir, "redis://127.0.0.1:1", tmp_path / "run", packing=packing, kl_coef=0.01)
    models = assemble_models(cfg, init_distributed(cfg), ChatCodec(model_dir, max_image_side=112),
                             load_policy(model_dir), load_backbone(model_dir), load_policy(model_dir))
    want = varlen.ATTENTION if packing else "sdpa"
    for m in (models.policy_hf, models.critic.module.backbone, models.reference.hf):
        assert m.config._attn_implementation == want
        assert m.config.get_text_config()._attn_implementation == want


def test_a_failing_flash_kernel_falls_back_once_and_out_of_memory_is_raised(monkeypatch, caplog):
    """The CUDA branch's error handling, on the CPU: the kernel is made to apply and to fail."""
    q, k, v = _qkv(9)
    seg = segments_of([4, 5])
    expected, _ = varlen.varlen_attention(_Module(), q, k, v, None, scaling=0.3, worldloop_segments=seg)
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("no varlen kernel for this device")

    monkeypatch.setattr(varlen, "_flash_ok", lambda query: True)
    monkeypatch.setattr(varlen, "_flash_varlen", broken)
    monkeypatch.setattr(varlen, "_FLASH_FAILED", [])
    with caplog.at_level("WARNING", logger="worldloop.learner.varlen"):
        for _ in range(3):
            out, _ = varlen.varlen_attention(_Module(), q, k, v, None, scaling=0.3, worldloop_segments=seg)
            assert torch.equal(out, expected)
    assert len(calls) == 1 and "no varlen kernel" in varlen._FLASH_FAILED[0]  # tried once, then never again
    assert sum("varlen_attn failed" in r.getMessage() for r in caplog.records) == 1

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(varlen, "_FLASH_FAILED", [])
    monkeypatch.setattr(varlen, "_flash_varlen", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError, match="out of memory"):
        varlen.varlen_attention(_Module(), q, k, v, None, scaling=0.3, worldloop_segments=seg)
    assert varlen._FLASH_FAILED == []
