"""Rollouts on a mixed suite of envs: lockstep (one batched call per turn) against the per-episode
loop (``actor.loop: episode``), for the ``hf`` backend and a real ``worldloop serve`` (vLLM, CPU).

    python bench/rollouts.py [--episodes 24] [--concurrency 8] [--max-new-tokens 48] [--no-server]
                             [--updates 3] [--update-tokens 512] [--model DIR]

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
``--update-tokens`` tokens decoding, publish a version, and time publish -> the server serving it
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


def _version_latency(model: Path, tmp: Path, mode: str, args) -> list[float]:
    """Seconds from ``publish(v)`` to the server serving v (its next engine step samples with it),
    while ``concurrency`` long requests (``--update-tokens`` each) are in flight; one per version."""
    import json
    import urllib.request

    import torch

    from worldloop.actor.generation import GenRequest
    from worldloop.actor.server.client import ServerBackend
    from worldloop.common.contracts.modeling import load_policy
    from worldloop.common.transport.weights import WeightPublisher

    pub = WeightPublisher("127.0.0.1", 0, 0, announce_interval_s=0.05)
    base = {k: v for k, v in load_policy(model, dtype="float32").state_dict().items() if k != "lm_head.weight"}
    url, proc = bench_actor._serve(model, tmp, f"serve-{mode}", actor={"weight_update": mode},
                                   weights={"host": "127.0.0.1", "pub_port": pub.pub_port, "fetch_port": pub.fetch_port})
    info = lambda: json.loads(urllib.request.urlopen(url + "/worldloop/info", timeout=5).read())
    out = []
    try:
        sb = ServerBackend([url], model, max_image_side=112, max_model_len=4096, mixed_versions=mode == "interrupt")
        try:
            prompt = sb.codec.encode_obs("Count to a thousand.", [], system="Talk.", first=True).ids
            # warm-up: a fresh engine's first steps at this batch shape are slow on the CPU (measured: a
            # utility call waited 1.8 s behind them, in both modes), which is start-up, not the update
            for f in [sb.submit(GenRequest(prompt, session=f"warm-{i}"), temperature=1.0, top_p=1.0,
                                max_new_tokens=args.update_tokens, seed=i) for i in range(args.concurrency)]:
                f.result(timeout=900)
            for v in range(1, args.updates + 1):
                for attempt in range(20):  # a random model ends some responses early on an EOS
                    futures = [sb.submit(GenRequest(prompt, session=f"u{v}-{attempt}-{i}"), temperature=1.0, top_p=1.0,
                                         max_new_tokens=args.update_tokens, seed=v * 1000 + attempt * 100 + i)
                               for i in range(args.concurrency)]
                    time.sleep(0.5)  # the requests are decoding
                    if sum(not f.done() for f in futures) >= args.concurrency // 2:
                        break
                    for f in futures:
                        f.result(timeout=900)
                else:
                    raise RuntimeError("no requests stayed in flight long enough to publish during them")
                gen = torch.Generator().manual_seed(v)
                t0 = time.perf_counter()
                pub.publish({k: t + 1e-3 * torch.randn(t.shape, generator=gen) for k, t in base.items()}, v, wait=True)
                while info()["version"] != v:
                    time.sleep(0.005)
                out.append(time.perf_counter() - t0)
                for f in futures:
                    f.result(timeout=900)
        finally:
            sb.close()
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
    ap.add_argument("--update-tokens", type=int, default=512, help="tokens of each request in flight during an update")
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

    print(f"\nweight update with {args.concurrency} requests of {args.update_tokens} tokens in flight: seconds from "
          f"publish to the server sampling with the version ({args.updates} versions each)")
    print(f"{'actor.weight_update':<20}{'median':>8}{'max':>8}{'ratio':>7}")
    wait = statistics.median(latency["wait"])
    for mode in ("wait", "interrupt"):
        med = statistics.median(latency[mode])
        print(f"{mode:<20}{med:>8.2f}{max(latency[mode]):>8.2f}{wait / med:>7.2f}")


if __name__ == "__main__":
    main()
