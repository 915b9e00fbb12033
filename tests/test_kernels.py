"""The learner's GPU fast paths (learner/kernels.py): trainer.liger, trainer.pad_to_multiple and the
attention backend on CPU; Liger Kernel against the plain path on CUDA (marked gpu)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from worldloop.common.contracts.config import ConfigError, config_from_dict
from worldloop.learner.kernels import apply_liger, configure_attention, pad_multiple, use_liger

HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None
CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def _cfg(**trainer):
    return config_from_dict({"trainer": trainer})


def test_liger_resolves_per_device_and_on_without_cuda_names_the_key():
    assert use_liger(_cfg(liger="auto"), CPU) is False
    assert use_liger(_cfg(liger=False), CUDA) is False
    with pytest.raises(ConfigError, match="is on but the learner runs on cpu") as e:
        use_liger(_cfg(liger=True), CPU)
    assert e.value.key == "trainer.liger" and "runs on cpu" in e.value.reason


@pytest.mark.skipif(HAS_LIGER, reason="checks the error without liger_kernel")
def test_liger_on_without_the_package_names_the_key_and_auto_stays_off():
    with pytest.raises(ConfigError, match="liger_kernel does not import") as e:
        use_liger(_cfg(liger=True), CUDA)  # the device object only: no CUDA needed to decide
    assert e.value.key == "trainer.liger" and "worldloop[gpu]" in e.value.reason
    assert use_liger(_cfg(liger="auto"), CUDA) is False


def test_a_learner_with_liger_on_a_cpu_fails_before_loading_models(tmp_path: Path, shared_tiny_model):
    from worldloop.learner.engine import DistInfo, build_models
    from worldloop.testing.learner import tiny_learner_config

    model_dir = shared_tiny_model(arch="qwen2", max_image_side=112)
    cfg = tiny_learner_config(model_dir, "redis://127.0.0.1:1", tmp_path / "run", liger=True)
    with pytest.raises(ConfigError, match="is on but the learner runs on cpu") as e:
        build_models(cfg, DistInfo(0, 1, 0, CPU, "gloo"))
    assert e.value.key == "trainer.liger"


def test_pad_multiple_auto_is_128_on_cuda_and_8_on_cpu():
    assert pad_multiple(_cfg(), CPU) == 8
    assert pad_multiple(_cfg(), CUDA) == 128
    assert pad_multiple(_cfg(pad_to_multiple=64), CPU) == 64


def test_other_architectures_keep_their_modules_and_cpu_attention_is_untouched():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=32, n_positions=16))
    assert apply_liger(model) is False  # no Liger patch for gpt2 (and no import of liger for it)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    configure_attention(CPU)
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


# --------------------------------------------------------------------------- on a GPU

NEEDS_GPU_AND_LIGER = pytest.mark.skipif(not torch.cuda.is_available() or not HAS_LIGER,
                                         reason="needs CUDA and liger-kernel (the gpu extra)")


@pytest.fixture
def transformers_restored():
    """Liger patches functions and classes of transformers' modules (and adds names to them): put
    every module global back as it was after the test."""
    from transformers.models.qwen2 import modeling_qwen2
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl

    mods = (modeling_qwen2, modeling_qwen2_5_vl)
    before = [(m, dict(vars(m))) for m in mods]
    forwards = [(c, c.forward) for m in mods for c in vars(m).values() if isinstance(c, type) and hasattr(c, "forward")]
    yield
    for m, names in before:
        for k in set(vars(m)) - set(names):
            delattr(m, k)
        for k, v in names.items():
            if vars(m).get(k) is not v:
                setattr(m, k, v)
    for c, f in forwards:
        c.forward = f


def _run(model, batch, mask, entropy: bool, fused: bool):
    from worldloop.common.contracts.logprobs import token_logprobs

    model.zero_grad(set_to_none=True)
    lp, ent = token_logprobs(model, batch, temperature=0.7, chunk_size=16, return_entropy=entropy, only=mask, fused=fused)
    loss = (lp * mask.cuda() * torch.linspace(-1, 1, mask.numel(), device="cuda").reshape(mask.shape)).sum()
    if entropy:
        loss = loss + 0.1 * (ent * mask.cuda()).sum()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach(), (ent.detach() if entropy else None), grads


@pytest.mark.gpu
@NEEDS_GPU_AND_LIGER
@pytest.mark.parametrize("arch", ["qwen2", "qwen2_5_vl"])
@pytest.mark.parametrize("entropy", [False, True])
def test_liger_gives_the_plain_path_log_probs_entropies_and_gradients(transformers_restored, arch, entropy, shared_tiny_model):
    """The tiny model (fp32 on CUDA) with Liger's RMSNorm, RoPE and SwiGLU, and its fused linear
    log-prob where no entropy is asked for, against the plain modules and the chunked head."""
    from worldloop.common.contracts.modeling import ChatCodec, build_sequence, collate, load_policy
    from worldloop.testing.trajectories import synthetic_trajectory

    model_dir = shared_tiny_model(arch=arch, max_image_side=112)
    codec = ChatCodec(model_dir, max_image_side=112)
    trajs = [synthetic_trajectory(codec, trajectory_id=f"g{i}", seed=i, turns=2, response_tokens=9 + 5 * i) for i in range(2)]
    batch = collate([build_sequence(t) for t in trajs], codec)
    mask = batch["response_mask"]
    plain = _run(load_policy(model_dir, dtype="float32", device="cuda").train(), batch, mask, entropy, fused=False)
    patched_model = load_policy(model_dir, dtype="float32", device="cuda").train()
    assert apply_liger(patched_model)
    patched = _run(patched_model, batch, mask, entropy, fused=True)
    assert torch.allclose(patched[0], plain[0], atol=1e-4), float((patched[0] - plain[0]).abs().max())
    if entropy:
        assert torch.allclose(patched[1], plain[1], atol=1e-4)
    assert set(patched[2]) == set(plain[2])
    for name, g in plain[2].items():
        assert torch.allclose(patched[2][name], g, atol=1e-4, rtol=1e-3), (name, float((patched[2][name] - g).abs().max()))


@pytest.mark.gpu
@NEEDS_GPU_AND_LIGER
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_linear_log_probs_match_the_chunked_function(dtype):
    """Liger's fused linear cross entropy (reduction none) against ChunkedLinearLogprob: values and
    the gradients of a per-token weighted loss (wrong for grad_weight before liger-kernel 0.8.2)."""
    from worldloop.common.contracts.logprobs import linear_logprobs

    torch.manual_seed(0)
    n, h, v = 300, 64, 5000
    head = torch.nn.Linear(h, v, bias=False, device="cuda", dtype=dtype)
    hidden = torch.randn(n, h, device="cuda", dtype=dtype)
    targets = torch.randint(0, v, (n,), device="cuda")
    weights = torch.randn(n, device="cuda")
    out = []
    for fused in (False, True):
        head.zero_grad(set_to_none=True)
        x = hidden.clone().requires_grad_(True)
        lp, _ = linear_logprobs(x, head, targets, temperature=0.7, chunk_size=64, fused=fused)
        (lp * weights).sum().backward()
        out.append((lp.detach().float(), x.grad.float(), head.weight.grad.float()))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for a, b in zip(*out):
        assert torch.allclose(a, b, atol=tol, rtol=tol), float((a - b).abs().max())


def test_the_start_up_line_says_why_liger_is_off_and_which_checkpointing():
    from worldloop.learner.kernels import kernel_report

    cfg = config_from_dict({"trainer": {"liger": "auto", "activation_checkpointing": "selective", "packing": True}})
    line = kernel_report(cfg, torch.device("cpu"), False)
    assert "Liger off: the learner runs on cpu" in line and "activation checkpointing selective" in line
    assert "packed rows" in line
    off = kernel_report(config_from_dict({"trainer": {"liger": False, "gradient_checkpointing": True, "packing": False}}),
                        torch.device("cuda"), False)
    assert "trainer.liger is false" in off and "activation checkpointing full" in off and "padded rows" in off


def test_selective_checkpointing_recomputes_attention_with_the_same_gradients(tmp_path):
    """Each text layer's self-attention under torch.utils.checkpoint: 2 blocks on the tiny model
    (not the vision tower's), the same loss and gradients as no checkpointing."""
    from worldloop.bootstrap.tiny_model import make_tiny_model
    from worldloop.common.contracts.modeling import load_policy
    from worldloop.learner.kernels import apply_checkpointing

    path = make_tiny_model(tmp_path / "tiny", arch="qwen2_5_vl", max_image_side=56)
    ids = torch.randint(10, 200, (2, 24))
    grads = []
    for mode in ("none", "selective"):
        model = load_policy(path).train()
        calls = []
        n = apply_checkpointing(model, mode)
        if mode == "selective":
            assert n == 2
            orig = torch.utils.checkpoint.checkpoint
            torch.utils.checkpoint.checkpoint = lambda *a, **k: (calls.append(1), orig(*a, **k))[1]
        try:
            model(input_ids=ids, labels=ids).loss.backward()
        finally:
            if mode == "selective":
                torch.utils.checkpoint.checkpoint = orig
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        if mode == "selective":
            assert len(calls) == 2
    assert torch.allclose(grads[0], grads[1], atol=1e-6)
    with pytest.raises(ValueError, match="full, selective or none"):
        apply_checkpointing(load_policy(path), "some")
