"""Chunked log-probs and entropies (common/contracts/logprobs.py) equal the full-vocabulary computation,
values and gradients, and hold nothing of the vocabulary's size beyond one chunk."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from worldloop.common.contracts.logprobs import ChunkedLinearLogprob, full_linear_logprobs, linear_logprobs, token_logprobs
from worldloop.common.contracts.modeling import ChatCodec, collate, load_policy, model_inputs
from worldloop.testing.trajectories import synthetic_trajectory

ROOT = Path(__file__).resolve().parent.parent


def _grads(fn, hidden: torch.Tensor, head: torch.nn.Linear, g_lp: torch.Tensor, g_ent: torch.Tensor | None):
    """(logprobs, entropy, d/dhidden, d/dweight, d/dbias) of sum(g_lp * lp) + sum(g_ent * ent)."""
    hidden = hidden.detach().clone().requires_grad_(True)
    head.zero_grad(set_to_none=True)
    lp, ent = fn(hidden)
    loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if g_ent is not None else 0.0)
    loss.backward()
    bias = head.bias.grad.clone() if head.bias is not None else torch.zeros(1)
    return lp.detach(), (ent.detach() if ent is not None else None), hidden.grad.clone(), head.weight.grad.clone(), bias


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_chunked_equals_full_on_random_weights(bias, temperature, chunk):
    torch.manual_seed(chunk)
    n, h, v = 45, 24, 301
    head = torch.nn.Linear(h, v, bias=bias)
    hidden = torch.randn(n, h) * 3.0  # peaked distributions as well as flat ones
    targets = torch.randint(0, v, (n,))
    g_lp, g_ent = torch.randn(n), torch.randn(n)
    full = _grads(lambda x: full_linear_logprobs(x, head, targets, temperature), hidden, head, g_lp, g_ent)
    chunked = _grads(lambda x: linear_logprobs(x, head, targets, temperature, chunk, return_entropy=True),
                     hidden, head, g_lp, g_ent)
    for name, a, b in zip(("logprobs", "entropy", "d hidden", "d weight", "d bias"), chunked, full):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (name, float((a - b).abs().max()))
    assert float(full[3].abs().max()) > 1e-3  # the gradients compared are not all ~0
    # without entropies: the same log-probs and the gradient of the log-probs alone
    full_lp = _grads(lambda x: full_linear_logprobs(x, head, targets, temperature), hidden, head, g_lp, None)
    only_lp = _grads(lambda x: linear_logprobs(x, head, targets, temperature, chunk), hidden, head, g_lp, None)
    assert only_lp[1] is None
    for a, b in zip(only_lp[2:], full_lp[2:]):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def test_entropy_gradient_alone_and_a_hand_computed_case():
    # logits z = [log 1, log 3] (T = 1): p = [1/4, 3/4]; log p(target 1) = log 3/4;
    # H = -(1/4 log 1/4 + 3/4 log 3/4); dH/dz_k = -p_k (log p_k + H)
    head = torch.nn.Linear(1, 2, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[0.0], [float(torch.log(torch.tensor(3.0)))]]))
    hidden = torch.ones(1, 1, requires_grad=True)
    lp, ent = linear_logprobs(hidden, head, torch.tensor([1]), return_entropy=True, chunk_size=1)
    p = torch.tensor([0.25, 0.75])
    h = float(-(p * p.log()).sum())
    assert float(lp.detach()) == pytest.approx(float(torch.log(torch.tensor(0.75))), abs=1e-6)
    assert float(ent.detach()) == pytest.approx(h, abs=1e-6)
    ent.sum().backward()
    dz = -p * (p.log() + h)  # d H / d logits; logits = W h with h = 1, so d H / d W = dz
    assert head.weight.grad[:, 0].tolist() == pytest.approx(dz.tolist(), abs=1e-6)
    assert float(hidden.grad) == pytest.approx(float(dz[1] * head.weight[1, 0]), abs=1e-6)


def test_no_tensor_of_the_vocabulary_size_is_kept_for_the_backward():
    """What autograd keeps between forward and backward: the chunked path the hidden states, the
    head's weight and [N] vectors; the full path N x V tensors (logits, log-softmax, softmax)."""
    n, h, v = 300, 16, 2000
    head = torch.nn.Linear(h, v, bias=False)
    hidden = torch.randn(n, h, requires_grad=True)
    targets = torch.randint(0, v, (n,))

    def saved(fn) -> list[torch.Tensor]:
        kept: list[torch.Tensor] = []

        def pack(t):
            kept.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return kept

    chunked = saved(lambda: linear_logprobs(hidden, head, targets, 0.8, chunk_size=16, return_entropy=True))
    full = saved(lambda: full_linear_logprobs(hidden, head, targets, 0.8))
    weight = v * h
    assert max(t.numel() for t in chunked) == weight  # the weight itself; nothing else is vocabulary-sized
    assert sum(t.numel() for t in chunked) <= weight + n * h + 3 * n
    assert sum(t.numel() for t in full if t.numel() >= n * v) >= 2  # the full path keeps N x V tensors


_MEMORY_PROBE = """
import json, torch
from worldloop.common.contracts.logprobs import full_linear_logprobs, linear_logprobs
torch.manual_seed(0)
n, h, v = 1024, 16, 16384
head = torch.nn.Linear(h, v, bias=False)
hidden = torch.randn(n, h, requires_grad=True)
targets = torch.randint(0, v, (n,))
def rss_mb():  # the peak RSS since the last reset (VmHWM)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
def run(fn):
    hidden.grad = None
    head.zero_grad(set_to_none=True)
    lp, ent = fn()
    (lp.sum() + 0.5 * ent.sum()).backward()
    return lp.detach(), hidden.grad.clone()
run(lambda: linear_logprobs(hidden[:64], head, targets[:64], 0.7, 32, True))  # warm up: weight grads, allocator
open("/proc/self/clear_refs", "w").write("5")  # the peak restarts here (imports may have peaked higher)
base = rss_mb()
a = run(lambda: linear_logprobs(hidden, head, targets, 0.7, 16, True))
chunked = rss_mb() - base  # the peak only grows: the smaller variant goes first
b = run(lambda: full_linear_logprobs(hidden, head, targets, 0.7))
full = rss_mb() - base
diff = max(float((x - y).abs().max()) for x, y in zip(a, b))
print(json.dumps({"chunked_mb": chunked, "full_mb": full, "max_abs_diff": diff}))
"""


def test_peak_memory_of_forward_and_backward_is_bounded_by_the_chunk():
    """Peak RSS growth of one forward + backward in a fresh process: N = 1,024 tokens over a
    16,384-token vocabulary (64 MB per fp32 N x V tensor) against 16-row chunks (1 MB). Measured:
    full +317 MB, chunked +0 MB over a short warm-up of the chunked path."""
    out = subprocess.run([sys.executable, "-c", _MEMORY_PROBE], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    growth = json.loads(out.stdout.strip().splitlines()[-1])
    per_tensor = 1024 * 16384 * 4 / 2**20
    assert growth["full_mb"] > 2 * per_tensor, growth  # the full path holds several N x V tensors
    assert growth["chunked_mb"] < per_tensor / 8, growth  # the chunked path none
    assert growth["max_abs_diff"] < 1e-5, growth


def test_zero_tokens_and_bad_arguments():
    head = torch.nn.Linear(4, 9)
    lp, ent = linear_logprobs(torch.zeros(0, 4), head, torch.zeros(0, dtype=torch.long), return_entropy=True)
    assert lp.shape == ent.shape == (0,)
    with pytest.raises(ValueError, match="temperature"):
        linear_logprobs(torch.zeros(2, 4), head, torch.zeros(2, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        linear_logprobs(torch.zeros(2, 4), head, torch.zeros(2, dtype=torch.long), chunk_size=0)


# --------------------------------------------------------------------------- the tiny model


@pytest.fixture(scope="module")
def tiny(shared_tiny_model):
    path = shared_tiny_model(max_image_side=112)
    codec = ChatCodec(path, max_image_side=112)
    trajs = [synthetic_trajectory(codec, trajectory_id=f"t{i}", seed=i, turns=1 + i, response_tokens=5 + 3 * i,
                                  image_side=56) for i in range(2)]
    from worldloop.common.contracts.modeling import build_sequence

    return path, collate([build_sequence(t) for t in trajs], codec)


def _full_model_logprobs(model, batch, temperature: float):
    """Today's full computation: the model's own logits for every position, log-softmax, entropy."""
    p = next(model.parameters())
    logits = model(**model_inputs(batch, p.device, p.dtype)).logits.float() / temperature
    logp = torch.log_softmax(logits[:, :-1], -1)
    lp = logp.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(lp, (1, 0)), torch.nn.functional.pad(-(logp.exp() * logp).sum(-1), (1, 0))


@pytest.mark.parametrize("masked", [False, True])
def test_tiny_model_chunked_equals_its_full_logits_with_every_gradient(tiny, masked):
    """The tiny Qwen2.5-VL (images, tied head): token_logprobs at the sampling temperature, on every
    position or on the response tokens only, gives the model's full-logit log-probs and entropies
    and the same gradient on every parameter, for a loss that uses both."""
    path, batch = tiny
    mask = batch["response_mask"]
    weights = torch.linspace(-1.0, 1.0, mask.numel()).reshape(mask.shape) * mask
    results = []
    for fn in ("full", "chunked"):
        model = load_policy(path).train()
        if fn == "full":
            lp, ent = _full_model_logprobs(model, batch, 0.7)
        else:
            lp, ent = token_logprobs(model, batch, temperature=0.7, chunk_size=3, return_entropy=True,
                                     only=mask if masked else None)
        ((lp * weights).sum() + 0.1 * (ent * mask).sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((lp.detach() * mask, ent.detach() * mask, grads))
    (lp0, ent0, g0), (lp1, ent1, g1) = results
    assert torch.allclose(lp1, lp0, atol=1e-5) and torch.allclose(ent1, ent0, atol=1e-5)
    assert set(g1) == set(g0) and len(g0) > 10
    for name in g0:
        assert torch.allclose(g1[name], g0[name], atol=1e-5, rtol=1e-4), (name, float((g1[name] - g0[name]).abs().max()))
    assert min(float(g.abs().max()) for name, g in g0.items() if "visual" not in name) > 0  # every text weight learns


def test_chunked_function_under_no_grad_keeps_no_graph():
    head = torch.nn.Linear(8, 50)
    with torch.no_grad():
        lp, ent = ChunkedLinearLogprob.apply(torch.randn(5, 8), head.weight, head.bias, torch.zeros(5, dtype=torch.long),
                                             1.0, 2, True)
    assert not lp.requires_grad and lp.grad_fn is None and bool((ent > 0).all())


def test_the_learners_policy_module_and_critic_on_the_tiny_model(tiny):
    """PolicyModule as the engine calls it (the batch's logprob_mask, the sampling temperature, a
    small chunk) gives the full logits' log-probs on the mask and 0 elsewhere; the critic, which
    never goes through the LM head, reads the value of position i from the hidden state at i - 1."""
    from worldloop.learner.engine import CriticModule, PolicyModule, load_backbone

    path, batch = tiny
    mask = batch["response_mask"]
    hf = load_policy(path)
    with torch.no_grad():
        lp, ent = PolicyModule(hf, chunk_size=5)({**batch, "logprob_mask": mask}, temperature=0.7, return_entropy=True)
        full_lp, full_ent = _full_model_logprobs(hf, batch, 0.7)
    chosen = mask.bool()
    assert torch.allclose(lp[chosen], full_lp[chosen], atol=1e-5) and torch.allclose(ent[chosen], full_ent[chosen], atol=1e-5)
    assert (lp[~chosen] == 0).all()
    critic = CriticModule(load_backbone(path))
    with torch.no_grad():
        torch.nn.init.normal_(critic.value_head.weight)
        values = critic(batch)
        hidden = critic.backbone(**model_inputs(batch, torch.device("cpu"), torch.float32)).last_hidden_state
    expected = (hidden @ critic.value_head.weight[0] + critic.value_head.bias[0])[:, :-1]
    assert (values[:, 0] == 0).all() and torch.allclose(values[:, 1:], expected, atol=1e-5)


class _Partitioned(torch.nn.Linear):
    """A head whose weight carries ``ds_id``, as ZeRO-3 marks a partitioned parameter: the
    checkpointed path that calls the head."""

    def __init__(self, weight: torch.Tensor):
        super().__init__(weight.shape[1], weight.shape[0], bias=False)
        self.weight.data.copy_(weight)
        self.weight.ds_id = 0


def test_masked_ids_give_the_masked_distribution_by_hand():
    # 4 tokens, logits z = (0, 5, 0, ln 2) from hidden h = (1) through a 4 x 1 head; token 1 masked.
    # Left: exp = (1, -, 1, 2), sum 4, so p = (1/4, 0, 1/4, 1/2):
    #   log p(0) = ln(1/4) = -1.3862944, log p(3) = ln(1/2) = -0.6931472
    #   H = -(1/4 ln 1/4 + 1/4 ln 1/4 + 1/2 ln 1/2) = 1/2 ln 4 + 1/2 ln 2 = 3/2 ln 2 = 1.0397208
    #   d log p(0) / dz = onehot(0) - p = (3/4, 0, -1/4, -1/2): z_1 gets no gradient
    # Unmasked, log p(0) = -ln(1 + e^5 + 1 + 2) = -ln(152.413159) = -5.0266
    weight = torch.tensor([[0.0], [5.0], [0.0], [math.log(2.0)]])
    targets = torch.tensor([0, 3])
    want_lp, want_h = torch.tensor([-math.log(4.0), -math.log(2.0)]), torch.tensor([1.5 * math.log(2.0)] * 2)
    plain = torch.nn.Linear(1, 4, bias=False)
    plain.weight.data.copy_(weight)
    for head in (plain, _Partitioned(weight)):
        head.zero_grad()
        hidden = torch.ones(2, 1, requires_grad=True)
        lp, ent = linear_logprobs(hidden, head, targets, chunk_size=1, return_entropy=True, masked_ids=[1])
        assert torch.allclose(lp, want_lp, atol=1e-6) and torch.allclose(ent, want_h, atol=1e-6), (type(head), lp, ent)
        lp[0].backward()  # d log p(0) / dW = (onehot(0) - p) * h
        assert torch.allclose(head.weight.grad[:, 0], torch.tensor([0.75, 0.0, -0.25, -0.5]), atol=1e-6)
    full_lp, full_h = full_linear_logprobs(torch.ones(2, 1), plain, targets, masked_ids=[1])
    assert torch.allclose(full_lp, want_lp, atol=1e-6) and torch.allclose(full_h, want_h, atol=1e-6)
    unmasked, _ = linear_logprobs(torch.ones(2, 1), plain, targets)
    assert float(unmasked[0]) == pytest.approx(-math.log(4 + math.exp(5.0)), abs=1e-5)
    # at temperature 2 the masked logits stay masked: z / 2 = (0, -, 0, ln 2 / 2), exp = (1, 1, sqrt 2),
    # log p(0) = -ln(2 + sqrt 2) = -1.2279471
    lp2, _ = linear_logprobs(torch.ones(1, 1), plain, targets[:1], temperature=2.0, masked_ids=[1])
    assert float(lp2[0]) == pytest.approx(-math.log(2 + math.sqrt(2.0)), abs=1e-6)
