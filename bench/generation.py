"""The HF backend's decode loops (``actor.hf_decode``) against ``transformers``' ``generate``.

    python bench/generation.py [--config tiny-frozenlake] [--episodes 48] [--concurrency 8] [--threads 1] [--repeats 2]
                               [--decode generate,loop,cached] [--group 1]

``loop`` is ``actor/hf_decode.py``, ``cached`` the same loop with each episode's keys and values kept
between its turns (``actor/hf_episode_kv.py``). All play the same episodes of the preset's env with the preset's shipped warm start (the model
``worldloop up`` trains), its turns, token limit and image side, in one process, one after the
other, ``--repeats`` times each in alternation: as the actors sample (``sampled``: one random stream
per call, temperature and top-p of ``actor.*``) and as the evaluator does (``keyed``: each episode
turn its own stream, temperature ``eval.temperature``). torch gets ``--threads`` threads (one is what
each of ``worldloop up``'s children gets on 2 cores). The table gives episodes/s, generated tokens/s,
the process's CPU seconds, the ratio to ``generate`` measured in the same run (best repeat of each),
and whether both gave the same episodes: the same response tokens and log-probs in every turn.

``--group N`` plays each level N times, as an actor plays a GRPO group (``actor.n_samples_per_seed``):
whole groups ``--concurrency`` episodes at a time, each batch to its end before the next starts, as an
actor whose ``actor.num_envs`` holds whole groups admits them. ``cached-rowwise`` in ``--decode`` is
``cached`` with every row prefilled on its own, as before a group's identical first turns shared one
prefill.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _play(backend, cfg, args, keyed: bool):
    from worldloop.actor.episodes import play_episodes
    from worldloop.actor.rollout import EpisodeSpec, Sampling

    env = cfg.actor.envs[0]
    temperature, top_p = (cfg.eval.temperature, 1.0) if keyed else (cfg.actor.temperature, cfg.actor.top_p)
    specs = [EpisodeSpec(env.id, args.seed_start + i // args.group, dict(env.kwargs), max_turns=cfg.actor.max_turns)
             for i in range(args.episodes)]
    batches = ([specs] if args.group == 1 else
               [specs[i : i + args.concurrency] for i in range(0, len(specs), args.concurrency)])
    cpu0, t0 = time.process_time(), time.perf_counter()
    trajs = [t for batch in batches
             for t in play_episodes(backend, batch, concurrency=args.concurrency,
                                    sampling=Sampling(temperature, top_p, cfg.actor.max_new_tokens),
                                    max_model_len=cfg.model.max_model_len, sample_seed=7, keyed_sampling=keyed)]
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    turns = [(tuple(t.response_ids), tuple(t.logprobs)) for tr in trajs for t in tr.turns]
    return wall, cpu, turns


def _difference(turns, base) -> str:
    """How two runs' turns differ: turns with other tokens, and the largest log-prob gap where the tokens agree."""
    other = sum(a[0] != b[0] for a, b in zip(turns, base)) + abs(len(turns) - len(base))
    gap = max((abs(x - y) for a, b in zip(turns, base) if a[0] == b[0] for x, y in zip(a[1], b[1])), default=0.0)
    return f"tokens: {other} of {len(base)} turns differ; log-probs: max gap {gap:.1e}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny-frozenlake")
    ap.add_argument("--episodes", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed-start", type=int, default=40_000_000)
    ap.add_argument("--decode", default="generate,loop,cached",
                    help="actor.hf_decode values (and cached-rowwise), the first the baseline")
    ap.add_argument("--group", type=int, default=1, help="episodes per level, as actor.n_samples_per_seed")
    args = ap.parse_args()
    if args.group < 1 or (args.group > 1 and (args.concurrency % args.group or args.episodes % args.concurrency)):
        ap.error("--group must divide --concurrency, which must divide --episodes")

    import torch

    from worldloop.actor.hf_backend import HFBackend
    from worldloop.bootstrap.store import SHIPPED_DIR
    from worldloop.common.contracts.config import load_config

    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    model = SHIPPED_DIR / cfg.run.name
    backends = {}
    for name in args.decode.split(","):
        backends[name] = HFBackend(model, max_image_side=cfg.model.max_image_side, decode=name.removesuffix("-rowwise"))
        if name.endswith("-rowwise"):
            backends[name].episode_kv.share_prefill = False
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} thread(s), "
          f"{args.episodes} episodes of {cfg.run.name} ({model}), {args.concurrency} at a time, {args.group} per level, "
          f"{args.repeats} repeats")
    print(f"| sampling | actor.hf_decode | episodes/s | generated tokens/s | CPU s | vs {args.decode.split(',')[0]} | same episodes |")
    print("|---|---|---|---|---|---|---|")
    for keyed in (False, True):
        best: dict[str, tuple] = {}
        for _ in range(args.repeats):
            for name, backend in backends.items():
                wall, cpu, turns = _play(backend, cfg, args, keyed)
                if name not in best or wall < best[name][0]:
                    best[name] = (wall, cpu, turns)
        base = best[args.decode.split(",")[0]]
        for name, (wall, cpu, turns) in best.items():
            tokens = sum(len(ids) for ids, _ in turns)
            same = "yes" if turns == base[2] else _difference(turns, base[2])
            print(f"| {'keyed (evaluator)' if keyed else 'sampled (actors)'} | {name} | {args.episodes / wall:.2f} | "
                  f"{tokens / wall:.0f} | {cpu:.1f} | {base[0] / wall:.2f}x | {same} |")


if __name__ == "__main__":
    main()
