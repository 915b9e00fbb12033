"""``worldloop serve`` with LoRA (``model.lora.rank`` > 0) against one real server (vLLM, CPU) for the module.

The server follows a real ZeroMQ weight channel; the tests publish adapter-only versions into it
and check that each is served as the server's LoRA adapter: responses labelled with the version,
log-probs equal to the HF policy with the same adapters (peft), plainly away from the base model's,
a version landing while requests run going into them at once (``interrupt``, per-token versions);
an adapter whose shapes do not fit is refused (logged, naming the tensor) and the previous
version keeps serving. Without a server: a vision LoRA config is refused at start-up.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml

from procs import wait_for
from test_hf_backend import _recomputed, _requests
from test_server_backend import MAX_LEN, _assert_logprobs, start_server, stop_group, waves_around_a_load
from test_vllm_backend import SIDE, _require_vllm, make_vllm_tiny_model
from worldloop.actor.hf_backend import HFBackend
from worldloop.common.contracts.config import ConfigError, LoraConfig, config_from_dict
from worldloop.common.contracts.modeling import load_policy
from worldloop.common.lora import adapter_tensors

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.in_order]  # v1, v2, v3 in flight, the refused v4

LORA = {"rank": 4, "alpha": 8.0}


@dataclasses.dataclass
class Lora:
    served: object
    hf: HFBackend  # the HF policy with the same adapters: the reference
    client: object


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    _require_vllm()
    from worldloop.actor.server.client import ServerBackend
    from worldloop.common.transport.weights import WeightPublisher

    root = tmp_path_factory.mktemp("served-lora")
    model = make_vllm_tiny_model(root / "vl")
    pub = WeightPublisher("127.0.0.1", 0, 0, announce_interval_s=0.2)
    cfg_path = root / "serve.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "model": {"path": str(model), "dtype": "float32", "max_model_len": MAX_LEN, "max_image_side": SIDE, "lora": LORA},
        "actor": {"backend": "server"},
        "weights": {"host": "127.0.0.1", "pub_port": pub.pub_port, "fetch_port": pub.fetch_port},
    }))
    srv = client = None
    try:
        srv = start_server(["--config", str(cfg_path)], root, model, pub)
        client = ServerBackend([srv.url], model, max_image_side=SIDE, max_model_len=MAX_LEN, max_lag=2)
        yield Lora(srv, HFBackend(model, max_image_side=SIDE, dtype="float32", lora=LoraConfig(**LORA)), client)
    finally:
        if client is not None:
            client.close()
        if srv is not None:
            stop_group(srv.child)
        pub.close()


def _version(hf: HFBackend, seed: int) -> dict[str, torch.Tensor]:
    """Adapters far from 0 (B drawn too), so that the adapted policy is plainly another one."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * 0.3 for k, v in adapter_tensors(hf.model).items()}


def _sample(client, reqs) -> list:
    return client.generate(reqs, temperature=0.7, top_p=0.9, max_new_tokens=12, seed=3)


def test_adapter_versions_are_served_as_the_servers_lora_adapter(lora) -> None:
    served, client = lora.served, lora.client
    codec = client.codec
    reqs = _requests(codec)  # images of several sizes, a text-only prompt
    base = load_policy(served.model, dtype="float32")
    # v0: the zero adapter, exactly the base model (the learner's policy while B = 0)
    v0 = _sample(client, reqs)
    assert [r.version for r in v0] == [0, 0, 0]
    _assert_logprobs(base, codec, reqs, v0, 0.7)
    greedy0 = client.generate(reqs, temperature=0.0, top_p=1.0, max_new_tokens=8)
    for version, seed in ((1, 11), (2, 12)):
        tensors = _version(lora.hf, seed)
        served.publisher.publish(tensors, version, wait=True)
        served.wait_version(version)
        lora.hf.update_weights(tensors, version)
        results = _sample(client, reqs)
        assert [r.version for r in results] == [version] * 3
        _assert_logprobs(lora.hf.model, codec, reqs, results, 0.7)  # the adapter of this version, the vision prompts too
        away = _recomputed(base, codec, reqs[1], results[1].response_ids, 0.7)
        assert not torch.allclose(torch.tensor(results[1].logprobs), away, atol=1e-2)  # the adapter is in use
        greedy = client.generate(reqs, temperature=0.0, top_p=1.0, max_new_tokens=8)
        assert [g.response_ids for g in greedy] != [g.response_ids for g in greedy0]
    log = served.child.output(None)
    assert "applied weights v1 " in log and "applied weights v2 " in log, log[-3000:]
    assert "every request runs with the adapter 'worldloop-policy'" in log, log[-3000:]
    assert "worldloop_server_weights_version 2.0" in served.metrics()


def test_an_adapter_landing_while_requests_run_goes_into_them_at_once(lora) -> None:
    """actor.weight_update=interrupt (the default) with LoRA: the in-flight requests hold the
    server's one adapter id, whose weights the load replaces, so a response spanning the load has
    v2's adapter log-probs before it and v3's after it (the KV recomputed)."""
    served, codec = lora.served, lora.client.codec
    adapters = {2: _version(lora.hf, 12), 3: _version(lora.hf, 14)}
    reqs, results = waves_around_a_load(served, codec, adapters[3], 3, max_new_tokens=600, n_waves=3)
    served.wait_version(3)
    spanning = [(req, res) for req, res in zip(reqs, results) if res.token_versions is not None]
    assert spanning, [(r.version, len(r.response_ids)) for r in results]  # the load did not wait for them
    vision = {codec.image_token_id, codec.vision_start_id, codec.vision_end_id}
    refs: dict = {}
    for version in (2, 3):
        lora.hf.update_weights(adapters[version], version)
        for j, (req, res) in enumerate(spanning):
            n = next((i for i, t in enumerate(res.response_ids) if t in vision), len(res.response_ids))
            refs[version, j] = _recomputed(lora.hf.model, codec, req, res.response_ids[:n], 1.0)
    far: dict[int, list] = {2: [], 3: []}  # |log-prob - the other adapter's| of every segment's tokens
    for j, (req, res) in enumerate(spanning):
        versions = res.token_versions
        assert res.version == versions[0] == 2 and versions[-1] == 3
        k = versions.index(3)
        assert versions == [2] * k + [3] * (len(versions) - k)
        n = len(refs[2, j])
        for version, lo, hi in ((2, 0, min(k, n)), (3, k, n)):
            if hi > lo:
                got = torch.tensor(res.logprobs[lo:hi])
                assert torch.allclose(got, refs[version, j][lo:hi], atol=2e-4), (version, lo, hi)
                far[version].append((got - refs[5 - version, j][lo:hi]).abs())
    # and away from the other adapter's: 100x the match tolerance on average over all the segments' tokens
    for version, parts in far.items():
        if parts:
            assert torch.cat(parts).mean() > 0.02, (version, torch.cat(parts))


def test_an_adapter_that_does_not_fit_is_refused_and_the_previous_version_serves(lora) -> None:
    served, client = lora.served, lora.client
    reqs = _requests(client.codec)
    before = client.generate(reqs, temperature=0.0, top_p=1.0, max_new_tokens=8)
    assert [r.version for r in before] == [3, 3, 3]
    bad = _version(lora.hf, 13)
    key = next(k for k in bad if k.endswith("layers.0.self_attn.q_proj.lora_A.default.weight"))
    bad[key] = torch.zeros(5, bad[key].shape[1])  # rank 5, not the config's 4
    served.publisher.publish(bad, 4, wait=True)
    wait_for(lambda: 'worldloop_server_weight_update_failures_total{reason="rejected"} 1.0' in served.metrics(),
             "the server to refuse v4", 120, [served.child])
    assert served.info()["version"] == 3
    log = served.child.output(None)
    assert "weights v4 not loaded" in log and key in log and "does not match" in log, log[-3000:]
    after = client.generate(reqs, temperature=0.0, top_p=1.0, max_new_tokens=8)
    assert [(r.response_ids, r.logprobs, r.version) for r in after] == [(r.response_ids, r.logprobs, r.version) for r in before]
    _assert_logprobs(lora.hf.model, client.codec, reqs, after, 1.0)  # still v3's adapter (hf holds v3)


def test_a_vision_lora_is_refused_at_start_up(tmp_path) -> None:
    """The config refuses it with the server backend; ``worldloop serve`` refuses it before it starts
    vLLM whatever ``actor.backend`` says, naming the key."""
    from worldloop.serve import run

    with pytest.raises(ConfigError, match=r"'model.lora.vision'.*language model only"):
        config_from_dict({"model": {"lora": {"rank": 4, "vision": True}}, "actor": {"backend": "server"}})
    (tmp_path / "config.json").write_text("{}")
    cfg = config_from_dict({"model": {"path": str(tmp_path), "lora": {"rank": 4, "vision": True}}, "actor": {"backend": "hf"}})
    with pytest.raises(ConfigError, match=r"'model.lora.vision'.*worldloop serve.*language model only"):
        run(cfg)
