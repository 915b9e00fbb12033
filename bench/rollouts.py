"""Rollouts on a mixed suite of envs: lockstep (one batched call per turn) against the per-episode
loop (``actor.loop: episode``), for the ``hf`` backend and a real ``worldloop serve`` (vLLM, CPU).

    python bench/rollouts.py [--episodes 24] [--concurrency 8] [--max-new-tokens 48] [--no-server]
                             [--updates 3] [--update-tokens 3900] [--model DIR]

The suite mixes FrozenLake (2 turns), Sokoban (4), Navigation (3) and SVG (1 turn, a slow env step:
it renders and scores an SVG), vision mode, with the embedded tiny Qwen2.5-VL model at temperature
0.7 / top-p 0.95 and keyed sampling, so both loops play the same episodes with the same samples
(the table's ``same`` column checks it). ``--model`` plays another model directory instead, for
example the shipped FrozenLake warm start (``worldloop/warmstarts/tiny-frozenlake``), whose
responses end on their own at different lengths, where the random tiny model's all run to
``--max-new-tokens``: the per-episode loop can only gain where responses differ. Each backend runs
lockstep first, then the per-episode loop, one after the other (never two at once); one warm-up
episode per backend is not timed.
Columns: episodes/s, generated tokens/s, the share of the run with no generation request in
flight (``idle``: 1 - busy seconds / wall seconds, from the engine's own accounting), and the
per-episode loop's ratio to lockstep on the same backend in the same run.

The weight-update rows start a server that follows a weight channel of this process, once with
``actor.weight_update: wait`` and once with ``interrupt``, keep ``concurrency`` requests of
exactly ``--update-tokens`` tokens decoding (vLLM's ``ignore_eos``: the tiny models end most
responses early on an EOS, and what ``wait`` pays is the drain of responses that run long), publish
a version half a second into them, and time publish -> the server serving it
(``/worldloop/info``: it resumes with that version, so its next engine step samples with it),
after one untimed round of the same requests (a fresh engine's first steps are start-up), and
prints the server's own fetch and apply lines for each version.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

_spec = importlib.util.spec_from_file_location("bench_actor", Path(__file__).with_name("actor.py"))
bench_actor = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_actor)  # _model, _serve, _stop: the same tiny model and server as bench/actor.py

SUITE = [  # (env id, kwargs, max_turns)
    ("worldloop/FrozenLake-v0", {"size": 4, "is_slippery": False, "render_mode": "vision", "image_size": 112}, 2),
    ("worldloop/Sokoban-v0", {"render_mode": "vision", "image_size": 112}, 4),
    ("worldloop/Navigation-v0", {"render_mode": "vision"}, 3),
    ("worldloop/SVG-v0", {}, 1),
]


def _specs(n: int, seed0: int = 0):
    from worldloop.actor.rollout import EpisodeSpec

    return [EpisodeSpec(SUITE[i % len(SUITE)][0], seed0 + i, dict(SUITE[i % len(SUITE)][1]), max_turns=SUITE[i % len(SUITE)][2])
            for i in range(n)]


def _run(backend, loop: str, specs, args) -> dict:
    """Play ``specs`` keeping ``concurrency`` live; wall seconds, busy seconds, episodes, tokens."""
    from worldloop.actor.episodes import EpisodeEngine
    from worldloop.actor.rollout import RolloutEngine, Sampling

    cls = EpisodeEngine if loop == "episode" else RolloutEngine
    engine = cls(backend, sampling=Sampling(0.7, 0.95, args.max_new_tokens), max_model_len=4096, sample_seed=3,
                 keyed_sampling=True)
    queue, done = list(specs), []
    t0 = time.perf_counter()
    try:
        while queue or engine.live or engine.pending_reports:
            while queue and engine.live < args.concurrency:
                engine.start(queue.pop(0))
            done += engine.step().finished
        wall = time.perf_counter() - t0
        busy = engine.busy_seconds()
    finally:
        engine.close()
    done.sort(key=lambda t: (t.env_id, t.seed))
    return {"wall": wall, "busy": busy, "episodes": len(done), "tokens": sum(len(t.response_ids) for tr in done for t in tr.turns),
            "responses": [[t.response_ids for t in tr.turns] for tr in done]}


def _rows(name: str, backend, args) -> list[tuple]:
    _run(backend, "lockstep", _specs(len(SUITE), 10_000), args)  # warm-up: one episode of each env
    specs = _specs(args.episodes)
    lock = _run(backend, "lockstep", specs, args)
    ep = _run(backend, "episode", specs, args)
    same = lock["responses"] == ep["responses"]
    return [(name, "lockstep", lock, None, same), (name, "episode", ep, ep["episodes"] / ep["wall"] / (lock["episodes"] / lock["wall"]), same)]


def _long_requests(url: str, prompt: list[int], codec, n: int, tokens: int, seed: int):
    """``n`` requests of exactly ``tokens`` tokens each (``ignore_eos``: the tiny models end most
    responses early on an EOS, and a drain needs responses that run long), posted in threads to the
    server's generate path as the actor's client posts them; returns the threads' futures (each: the
    tokens it got, checked to be ``tokens``)."""
    import concurrent.futures
    import json
    import urllib.request

    from worldloop.actor.server.client import GENERATE_PATH
    from worldloop.actor.vllm_backend import sampling_kwargs

    def post(i: int) -> int:
        # no EOS and no stop token ends it: exactly ``tokens`` tokens
        params = dict(sampling_kwargs(1.0, 1.0, tokens, [], seed + i, codec.prompt_only_tokens), ignore_eos=True)
        body = json.dumps({"token_ids": prompt, "sampling_params": params, "return_token_ids": True,
                           "output_mode": "tokens"}).encode()
        req = urllib.request.Request(url + GENERATE_PATH, data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=900) as resp:
            got = len(json.loads(resp.read())["choices"][0]["token_ids"])
        if got != tokens:
            raise RuntimeError(f"a request for {tokens} tokens got {got}")
        return got

    pool = concurrent.futures.ThreadPoolExecutor(n)
    futures = [pool.submit(post, i) for i in range(n)]
    pool.shutdown(wait=False)
    return futures


def _version_latency(model: Path, tmp: Path, mode: str, args) -> list[tuple[float, float]]:
    """Per version: seconds from calling ``publish(v)``, and from its return (v on the channel), to
    the server serving v (its next engine step samples with it), while ``concurrency`` requests of
    ``--update-tokens`` tokens each are decoding."""
    import json
    import urllib.request

    import torch

    from worldloop.common.contracts.modeling import ChatCodec, load_policy
    from worldloop.common.transport.weights import WeightPublisher

    pub = WeightPublisher("127.0.0.1", 0, 0, announce_interval_s=0.05)
    base = {k: v for k, v in load_policy(model, dtype="float32").state_dict().items() if k != "lm_head.weight"}
    codec = ChatCodec(model, max_image_side=112)
    prompt = [int(t) for t in codec.encode_obs("Count to a thousand.", [], system="Talk.", first=True).ids]
    url, proc = bench_actor._serve(model, tmp, f"serve-{mode}", actor={"weight_update": mode},
                                   weights={"host": "127.0.0.1", "pub_port": pub.pub_port, "fetch_port": pub.fetch_port})
    info = lambda: json.loads(urllib.request.urlopen(url + "/worldloop/info", timeout=5).read())  # noqa: E731
    out = []
    try:
        # warm-up: a fresh engine's first steps at this batch shape are slow on the CPU (measured: a
        # utility call waited 1.8 s behind them, in both modes), which is start-up, not the update
        for f in _long_requests(url, prompt, codec, args.concurrency, args.update_tokens, 0):
            f.result(timeout=900)
        for v in range(1, args.updates + 1):
            futures = _long_requests(url, prompt, codec, args.concurrency, args.update_tokens, v * 1000)
            time.sleep(0.5)  # the requests are decoding
            ended = [f for f in futures if f.done()]
            if ended:
                f = ended[0]
                why = f"failed: {f.exception()!r}" if f.exception() else "ended (use more --update-tokens)"
                raise RuntimeError(f"a request of {args.update_tokens} tokens {why} within its first half second")
            gen = torch.Generator().manual_seed(v)
            t0 = time.perf_counter()
            pub.publish({k: t + 1e-3 * torch.randn(t.shape, generator=gen) for k, t in base.items()}, v, wait=True)
            t1 = time.perf_counter()  # the version is on the channel
            while info()["version"] != v:
                time.sleep(0.005)
            out.append((time.perf_counter() - t0, time.perf_counter() - t1))
            for f in futures:
                f.result(timeout=900)
    finally:
        bench_actor._stop(proc)
        pub.close()
        log = Path(tmp) / f"serve-{mode}.log"
        for line in (log.read_text(errors="replace").splitlines() if log.exists() else []):
            for what in ("fetched weights v", "applied weights v"):  # the server's own account of each version
                if what in line:
                    print(f"  {mode}: {line[line.index(what):]}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--no-server", action="store_true", help="only the hf backend")
    ap.add_argument("--updates", type=int, default=3, help="weight versions published per update mode (0: no update rows)")
    ap.add_argument("--update-tokens", type=int, default=3900,
                    help="tokens of each request in flight during an update (its prompt + these <= 4096)")
    ap.add_argument("--model", type=Path, default=None,
                    help="a model directory to play (default: the embedded random tiny model, made on the spot)")
    args = ap.parse_args()
    from worldloop import envs  # noqa: F401
    from worldloop.actor.hf_backend import HFBackend

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model.resolve() if args.model else bench_actor._model(Path(tmp) / "vl")
        hf = HFBackend(model, max_image_side=112)
        rows += _rows("hf", hf, args)
        hf.close()
        if not args.no_server:
            from worldloop.actor.server.client import ServerBackend

            url, proc = bench_actor._serve(model, Path(tmp))
            try:
                sb = ServerBackend([url], model, max_image_side=112, max_model_len=4096)
                try:
                    rows += _rows("server", sb, args)
                finally:
                    sb.close()
            finally:
                bench_actor._stop(proc)
        _print_rows(rows, args)
        if not args.no_server and args.updates:
            latency = {mode: _version_latency(model, Path(tmp), mode, args) for mode in ("wait", "interrupt")}
            _print_latency(latency, args)


def _print_rows(rows: list[tuple], args) -> None:
    print(f"\n{args.episodes} episodes of FrozenLake/Sokoban/Navigation/SVG (2/4/3/1 turns), concurrency "
          f"{args.concurrency}, max_new_tokens {args.max_new_tokens}, keyed sampling")
    lengths = [len(t) for tr in rows[0][2]["responses"] for t in tr]
    if lengths:
        print(f"model {args.model or 'the embedded random tiny model'}: {len(lengths)} responses of {min(lengths)}-"
              f"{max(lengths)} tokens (mean {sum(lengths) / len(lengths):.1f}), "
              f"{sum(n >= args.max_new_tokens for n in lengths) / len(lengths):.0%} at max_new_tokens")
    print(f"{'backend':<8}{'loop':<10}{'seconds':>9}{'episodes/s':>12}{'tokens/s':>10}{'idle':>7}{'ratio':>7}{'same':>6}")
    for name, loop, r, ratio, same in rows:
        idle = max(0.0, 1.0 - r["busy"] / r["wall"])
        print(f"{name:<8}{loop:<10}{r['wall']:>9.2f}{r['episodes'] / r['wall']:>12.3f}{r['tokens'] / r['wall']:>10.1f}"
              f"{idle:>7.1%}{'' if ratio is None else f'{ratio:.2f}':>7}{'yes' if same else 'NO':>6}")


def _print_latency(latency: dict, args) -> None:
    import statistics

    print(f"\nweight update with {args.concurrency} requests of {args.update_tokens} tokens in flight: seconds to the "
          f"server sampling with the version ({args.updates} versions each), from the publish call (the learner's "
          f"hand-over included, the same in both modes) and from the version being on the channel")
    print(f"{'actor.weight_update':<20}{'from call':>10}{'max':>8}{'ratio':>7}{'from channel':>14}{'max':>8}{'ratio':>7}")
    med = {mode: [statistics.median(x[i] for x in latency[mode]) for i in (0, 1)] for mode in latency}
    for mode in ("wait", "interrupt"):
        call, chan = med[mode]
        print(f"{mode:<20}{call:>10.2f}{max(x[0] for x in latency[mode]):>8.2f}{med['wait'][0] / call:>7.2f}"
              f"{chan:>14.2f}{max(x[1] for x in latency[mode]):>8.2f}{med['wait'][1] / chan:>7.2f}")


if __name__ == "__main__":
    main()
