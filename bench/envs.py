"""Env throughput: reset+step per second of every registered ``worldloop/*`` env, vision and text.

    python bench/envs.py [--seconds 1.0] [--ids worldloop/Sokoban-v0 ...]

For each env id and render mode: ``gymnasium.make(id, render_mode=mode)`` with its default knobs,
one ``expert_response()`` taken from the first episode as the fixed response text, then as many
iterations of ``reset(seed=i)`` + ``step(response)`` as fit in ``--seconds`` (rendering, prompt
building, parsing and the state dict included; the expert's planning is not). Baseline measured
in the same run: gymnasium's own ``FrozenLake-v1`` reset+step(0) (no rendering, no parsing, no
prompts) -- the raw cost of a toy-text step. The ratio column is baseline rate / env rate (how
many times slower than the raw toy env). An env that cannot be built here prints ``n/a`` and why.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import gymnasium  # noqa: E402

from worldloop import envs  # noqa: E402,F401  (registers the worldloop ids)


def _rate(fn, seconds: float) -> tuple[float, int]:
    """(iterations per second, iterations) of ``fn(i)`` run for about ``seconds``."""
    n, start = 0, time.perf_counter()
    deadline = start + seconds
    while True:
        fn(n)
        n += 1
        now = time.perf_counter()
        if now >= deadline and n >= 3:
            return n / (now - start), n


def baseline(seconds: float) -> float:
    env = gymnasium.make("FrozenLake-v1", is_slippery=False)

    def once(i: int) -> None:
        env.reset(seed=i)
        env.step(0)

    rate, _ = _rate(once, seconds)
    env.close()
    return rate


def measure(env_id: str, mode: str, seconds: float) -> tuple[float, int, str]:
    env = gymnasium.make(env_id, render_mode=mode)
    try:
        env.reset(seed=0)
        response = str(env.unwrapped.expert_response())

        def once(i: int) -> None:
            env.reset(seed=i)
            env.step(response)

        env.reset(seed=0)  # warm caches (sprites, solver tables) outside the timed loop
        env.step(response)
        rate, n = _rate(once, seconds)
        return rate, n, ""
    finally:
        env.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=1.0, help="time per (env, mode) cell")
    ap.add_argument("--ids", nargs="*", default=None, help="env ids (default: every registered worldloop/* id)")
    args = ap.parse_args(argv)
    ids = args.ids or sorted(k for k in gymnasium.registry if k.startswith("worldloop/"))
    base = baseline(args.seconds)
    print(f"machine: {os.cpu_count()} CPUs; {args.seconds:.1f} s per cell; others may share the CPU")
    print(f"baseline gymnasium FrozenLake-v1 reset+step: {base:,.0f}/s")
    header = f"{'env':30} {'mode':6} {'reset+step/s':>12} {'ms/iter':>8} {'iters':>6} {'baseline/env':>12}"
    print(header)
    print("-" * len(header))
    for env_id in ids:
        for mode in ("vision", "text"):
            try:
                rate, n, _ = measure(env_id, mode, args.seconds)
            except Exception as e:  # an env whose module or simulator is missing here
                reason = f"{type(e).__name__}: {e}".splitlines()[0][:90]
                print(f"{env_id:30} {mode:6} {'n/a':>12}  {reason}")
                continue
            print(f"{env_id:30} {mode:6} {rate:12,.0f} {1000 / rate:8.2f} {n:6d} {base / rate:12.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
