"""The HF backend's decode loop (``actor/hf_decode.py``) against ``transformers``' ``generate``: the
same tokens and the same log-probs, compared with ``==`` (bit for bit), in every sampling mode.

The requests are real: the shipped FrozenLake warm start plays real episodes of its env (multi-turn
prompts of up to ~1,200 tokens, a 7x7-cell image a turn, left padding between rows of different
lengths, responses that end at EOS), and the untrained tiny model gets a text-only row beside rows
with two images (it rarely samples EOS, so rows run to ``max_new_tokens``)."""

from __future__ import annotations

import dataclasses
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from worldloop.actor import hf_decode
from worldloop.actor.episodes import play_episodes
from worldloop.actor.generation import GenRequest
from worldloop.actor.hf_backend import HFBackend
from worldloop.actor.rollout import EpisodeSpec, Sampling
from worldloop.bootstrap.store import SHIPPED_DIR
from worldloop.common.contracts.config import LoraConfig, load_config
from worldloop.common.lora import is_adapter_name

MODES = {  # name -> (temperature, top_p, keyed)
    "keyed": (0.7, 1.0, True),
    "keyed-top-p": (0.7, 0.9, True),
    "sampled": (0.7, 1.0, False),
    "sampled-top-p": (1.0, 0.9, False),
    "greedy": (0.0, 1.0, False),
}


def _same(a: HFBackend, b: HFBackend, requests: list[GenRequest], mode: str, max_new_tokens: int, seed: int = 5) -> None:
    temperature, top_p, keyed = MODES[mode]
    reqs = [r if keyed else dataclasses.replace(r, sample_key=None) for r in requests]
    kw = dict(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed)
    got, want = a.generate(reqs, **kw), b.generate(reqs, **kw)
    assert [(r.response_ids, r.truncated) for r in got] == [(r.response_ids, r.truncated) for r in want], mode
    assert [r.logprobs for r in got] == [r.logprobs for r in want], mode  # exact floats, not allclose
    assert [r.text for r in got] == [r.text for r in want]


@pytest.fixture(scope="module")
def warm() -> tuple[HFBackend, HFBackend, list[list[GenRequest]]]:
    """The shipped FrozenLake warm start as both backends, and the batched requests of 6 real
    episodes played to their end (3 turns at most), 6 at a time."""
    cfg = load_config("tiny-frozenlake")
    path, side = SHIPPED_DIR / "tiny-frozenlake", cfg.model.max_image_side
    loop, ref = HFBackend(path, max_image_side=side), HFBackend(path, max_image_side=side, decode="generate")
    assert (loop.decode_mode, ref.decode_mode) == ("loop", "generate")
    calls: list[list[GenRequest]] = []

    class Recording:
        version = 0

        def generate(self, requests, **kw):
            calls.append(list(requests))
            return ref.generate(requests, **kw)

        def update_weights(self, tensors, version):  # pragma: no cover - not called
            raise AssertionError

        def close(self):
            pass

    env = cfg.actor.envs[0]
    specs = [EpisodeSpec(env.id, 20_000_000 + i, dict(env.kwargs), max_turns=3) for i in range(6)]
    trajs = play_episodes(Recording(), specs, concurrency=6, sampling=Sampling(0.7, 1.0, cfg.actor.max_new_tokens),
                          max_model_len=cfg.model.max_model_len, sample_seed=11, codec=ref.codec, keyed_sampling=True)
    assert all(t.turns for t in trajs)
    assert len(calls) >= 2 and max(len({len(r.prompt_ids) for r in c}) for c in calls) > 1  # padded batches
    assert max(len(r.images) for c in calls for r in c) >= 2  # later turns carry every earlier image
    return loop, ref, calls


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_loop_gives_generates_tokens_and_logprobs_on_real_episodes(warm, mode: str) -> None:
    loop, ref, calls = warm
    for requests in calls:
        _same(loop, ref, requests, mode, max_new_tokens=112)


def test_a_call_that_ends_at_eos_ends_there_and_pads_the_rows_that_ended(warm) -> None:
    loop, ref, calls = warm
    temperature, top_p, _ = MODES["keyed"]
    results = loop.generate(calls[0], temperature=temperature, top_p=top_p, max_new_tokens=112)
    assert any(not r.truncated for r in results)  # the warm start ends its answers with EOS
    for r in results:
        eos = [i for i, t in enumerate(r.response_ids) if t in loop.codec.eos_token_ids]
        assert eos == ([] if r.truncated else [len(r.response_ids) - 1])


@pytest.fixture(scope="module")
def untrained(shared_tiny_model) -> tuple[HFBackend, HFBackend, list[GenRequest]]:
    path = shared_tiny_model(seed=0, max_image_side=112)
    loop, ref = HFBackend(path, max_image_side=112), HFBackend(path, max_image_side=112, decode="generate")
    codec = loop.codec
    img = lambda h, w, s: np.random.RandomState(s).randint(0, 256, (h, w, 3), dtype=np.uint8)
    obs = [codec.encode_obs("[Initial Observation]:\n<image>\nDecide.", [img(90, 60, 0)], system="Play.", first=True),
           codec.encode_obs("text only, a longer prompt than the others " * 3, [], system=None, first=True),
           codec.encode_obs("two <image> and <image>", [img(112, 112, 1), img(30, 80, 2)], system=None, first=True)]
    return loop, ref, [GenRequest(o.ids, o.images, sample_key=100 + i) for i, o in enumerate(obs)]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.integers(0, 2), min_size=1, max_size=4), max_new_tokens=st.integers(1, 20),
       mode=st.sampled_from(sorted(MODES)), seed=st.integers(0, 2**31 - 1))
def test_any_batch_of_mixed_rows_matches_generate(untrained, rows, max_new_tokens, mode, seed) -> None:
    """Rows drawn with repeats (a batch of one, all rows alike: no padding), any length limit."""
    loop, ref, requests = untrained
    _same(loop, ref, [requests[i] for i in rows], mode, max_new_tokens, seed=seed)


def test_lora_adapters_take_part_in_every_step(shared_tiny_model) -> None:
    path = shared_tiny_model(seed=0, max_image_side=112)
    lora = LoraConfig(rank=4, alpha=8.0)
    loop, ref = HFBackend(path, max_image_side=112, lora=lora), HFBackend(path, max_image_side=112, lora=lora, decode="generate")
    assert loop.decode_mode == "loop"
    gen = torch.Generator().manual_seed(0)
    adapters = {k: torch.randn(v.shape, generator=gen) * 0.5 for k, v in loop.model.state_dict().items() if is_adapter_name(k)}
    req = [GenRequest(loop.codec.encode_obs("go", [], system="Play.", first=True).ids, sample_key=3)]
    before = loop.generate(req, temperature=0.0, top_p=1.0, max_new_tokens=16)[0]
    for backend in (loop, ref):
        backend.update_weights(adapters, 1)
    after = loop.generate(req, temperature=0.0, top_p=1.0, max_new_tokens=16)[0]
    assert after.logprobs != before.logprobs  # the adapters changed what the loop computes ...
    for mode in ("greedy", "keyed", "sampled"):
        _same(loop, ref, req, mode, max_new_tokens=16)  # ... exactly as they change generate


def test_a_model_the_loop_does_not_know_keeps_generate(shared_tiny_model) -> None:
    path = shared_tiny_model(seed=0, max_image_side=112)
    backend = HFBackend(path, max_image_side=112)
    assert hf_decode.supports(backend.model)
    backend.model.generation_config.repetition_penalty = 1.05  # as released Qwen2.5-VL checkpoints have it
    assert not hf_decode.supports(backend.model)
    backend.model.generation_config.repetition_penalty = 1.0
    assert hf_decode.supports(backend.model)
    backend.model.config.get_text_config()._attn_implementation = "eager"
    assert not hf_decode.supports(backend.model)
    assert HFBackend(path, max_image_side=112, decode="cached").decode_mode == "cached"
    with pytest.raises(ValueError, match="decode must be loop, cached or generate"):
        HFBackend(path, max_image_side=112, decode="fast")
    assert not hf_decode.supports(torch.nn.Linear(2, 2))



def test_actor_hf_decode_picks_the_path_and_a_bad_value_names_the_key(shared_tiny_model) -> None:
    from worldloop.actor.backends import make_backend
    from worldloop.common.contracts.config import ConfigError

    path = shared_tiny_model(seed=0, max_image_side=112)
    for value in ("loop", "cached", "generate"):
        cfg = load_config("tiny-frozenlake", [f"actor.hf_decode={value}", "model.max_image_side=112"])
        assert make_backend(cfg, str(path)).decode_mode == value
    with pytest.raises(ConfigError, match="actor.hf_decode"):
        load_config("tiny-frozenlake", ["actor.hf_decode=fast"])
