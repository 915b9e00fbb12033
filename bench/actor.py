"""Rollout throughput of the actor's backends: HF transformers (baseline) vs the in-process vLLM engine.

    python bench/actor.py [--episodes 16] [--concurrency 8] [--max-turns 3] [--max-new-tokens 64]

Both play the same FrozenLake episodes (vision mode, one image per turn) through
``worldloop.actor.rollout.play_episodes`` with the embedded tiny Qwen2.5-VL model, seeded sampling at temperature 0.7 / top-p 0.95. The table
gives episodes/s, generated tokens/s and the ratio to the HF baseline measured in the same run.
vLLM is skipped (one row) when it is not installed. One warm-up episode per backend is excluded.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _model(path: Path) -> Path:
    import worldloop.bootstrap.tiny_model as tiny

    return tiny.make_tiny_model(path, seed=0, max_image_side=112)


def _play(backend, args) -> tuple[float, int, int]:
    from worldloop.actor.rollout import EpisodeSpec, Sampling, play_episodes

    kw = {"size": 4, "is_slippery": False, "render_mode": "vision", "image_size": 112}
    sampling = Sampling(0.7, 0.95, args.max_new_tokens)
    play_episodes(backend, [EpisodeSpec("worldloop/FrozenLake-v0", 10_000, kw, max_turns=1)], sampling=sampling,
                  max_model_len=4096, sample_seed=1)  # warm-up
    specs = [EpisodeSpec("worldloop/FrozenLake-v0", s, kw, max_turns=args.max_turns) for s in range(args.episodes)]
    t0 = time.perf_counter()
    trajs = play_episodes(backend, specs, concurrency=args.concurrency, sampling=sampling, max_model_len=4096, sample_seed=0)
    seconds = time.perf_counter() - t0
    tokens = sum(len(t.response_ids) for tr in trajs for t in tr.turns)
    return seconds, len(trajs), tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-turns", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    from worldloop import envs  # noqa: F401
    from worldloop.actor.hf_backend import HFBackend

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = _model(Path(tmp) / "vl")
        hf = HFBackend(model, max_image_side=112)
        rows.append(("hf (baseline)", *_play(hf, args)))
        hf.close()
        try:
            from worldloop.actor.vllm_backend import VLLMBackend
        except ImportError as e:
            print(f"vllm not installed ({e}); only the baseline")
        else:
            vb = VLLMBackend(model, max_model_len=4096, max_image_side=112, dtype="float32")
            try:
                rows.append(("vllm", *_play(vb, args)))
            finally:
                vb.close()
    base = rows[0][3] / rows[0][1]
    print(f"\n{args.episodes} episodes x {args.max_turns} turns, concurrency {args.concurrency}, "
          f"max_new_tokens {args.max_new_tokens}")
    print(f"{'backend':<15}{'seconds':>9}{'episodes/s':>12}{'tokens':>8}{'tokens/s':>10}{'ratio':>7}")
    for name, seconds, n, tokens in rows:
        print(f"{name:<15}{seconds:>9.2f}{n / seconds:>12.2f}{tokens:>8d}{tokens / seconds:>10.1f}{tokens / seconds / base:>7.2f}")


if __name__ == "__main__":
    main()
