"""One PPO update on a real run's trajectories, replayed: the learner's CPU per update, with and
without its image and proximal shortcuts.

    python bench/learner_replay.py RUN_DIR                    # a finished `worldloop up` run directory
        [--updates 6] [--rounds 2] [--variants whole+own,first+own,whole+keys,first+keys]

RUN_DIR is the run directory of a `worldloop up` with its own Redis (``redis.url: null``, so the
run's ``redis/`` append-only file holds its streams); the bench copies that folder, starts a
redis-server on the copy (a free port) and reads the newest ``train_batch_size`` trajectories of
the ``scored`` stream (what the run had judged but not yet trained when it stopped). Each variant
then runs ``PPOTrainer.update`` on that same batch ``--updates`` times, in its own subprocess
(plain DeepSpeed engines built from the run's config and its model, one torch thread), and the
variants take turns for ``--rounds`` rounds, so a machine that slows down slows them all.

Variants, ``PROXIMAL+IMAGES``:
* ``whole``: the no-grad proximal pass over every row (``trainer.proximal_from_first_pass: false``);
  ``first``: the first mini-batch's proximal log-probs from its own training forward;
* ``own``: every image its own entry in the vision-feature cache (the batch's ``image_keys`` removed:
  the tower runs on each image of each row); ``keys``: images with the same PNG bytes share one
  entry (``collate``'s ``image_keys``: the tower runs once per distinct PNG). ``collate`` processes
  each distinct PNG once in both.

Columns: CPU seconds per update (the median over every update of every round, the first update of
each subprocess left out as a warm-up), the learner's own forward and backward seconds, the
vision tower's calls per update, and the ratio of the first variant's CPU to each.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _batch(url: str, namespace: str, n: int) -> list:
    import redis

    from worldloop.common.contracts.keys import Keys
    from worldloop.common.contracts.schemas import decode_trajectory

    r = redis.Redis.from_url(url)
    entries = r.xrevrange(Keys(namespace).scored, count=n)
    if len(entries) < n:
        raise SystemExit(f"the run's scored stream holds {len(entries)} trajectories, the update takes {n}")
    return [decode_trajectory(fields[b"data"]) for _, fields in reversed(entries)]


def run_variant(run_dir: Path, url: str, variant: str, updates: int) -> list[dict]:
    """``updates`` + 1 updates of one variant in this process; their measurements (the first dropped)."""
    import torch
    import yaml

    from worldloop.common.contracts.config import config_from_dict
    from worldloop.common.contracts.modeling import ChatCodec, load_policy
    from worldloop.learner.engine import assemble_models, init_distributed
    from worldloop.learner.trainer import PPOTrainer

    proximal, images = variant.split("+")
    raw = yaml.safe_load((run_dir / "config.yaml").read_text())
    raw["trainer"].update(proximal_from_first_pass=proximal == "first", time_limit_s=None)
    raw["redis"]["url"] = url
    cfg = config_from_dict(raw)
    trajs = _batch(url, cfg.redis.namespace, cfg.trainer.train_batch_size)
    torch.set_num_threads(1)
    codec = ChatCodec(cfg.model.path, max_image_side=cfg.model.max_image_side)
    torch.manual_seed(0)
    models = assemble_models(cfg, init_distributed(cfg), codec, load_policy(cfg.model.path), None, None)
    trainer = PPOTrainer(cfg, models, seed=0)
    if images == "own":
        collate = trainer._collate

        def without_keys(local):
            batch, counts, lengths = collate(local)
            batch.pop("image_keys", None)
            return batch, counts, lengths

        trainer._collate = without_keys
    out = []
    for step in range(updates + 1):
        c0 = time.process_time()
        stats = trainer.update(trajs, step=step + 1)
        out.append({"cpu_s": time.process_time() - c0, "forward_s": stats["forward_seconds"],
                    "backward_s": stats["backward_seconds"], "tower_calls": trainer.last_vision_tower_calls,
                    "tokens": stats["tokens"], "policy_loss": stats["policy_loss"]})
    return out[1:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--updates", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default="whole+own,first+own,whole+keys,first+keys")
    ap.add_argument("--one", nargs=3, metavar=("URL", "VARIANT", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        Path(args.one[2]).write_text(json.dumps(run_variant(args.run_dir, args.one[0], args.one[1], args.updates)))
        return 0
    from worldloop.common.transport.redis_local import LocalRedis

    variants = args.variants.split(",")
    results: dict[str, list[dict]] = {v: [] for v in variants}
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".torch_extensions"))
    with tempfile.TemporaryDirectory(prefix="learner-replay-") as d:
        shutil.copytree(args.run_dir / "redis", Path(d) / "redis")
        server = LocalRedis(data_dir=str(Path(d) / "redis"), persist=True).start()
        try:
            for r in range(args.rounds):
                for v in variants:
                    out = Path(d) / f"{v}-{r}.json"
                    t0 = time.monotonic()
                    subprocess.run([sys.executable, __file__, str(args.run_dir), "--updates", str(args.updates),
                                    "--one", server.url, v, str(out)], env=env, cwd=ROOT, check=True)
                    rows = json.loads(out.read_text())
                    results[v] += rows
                    print(f"  round {r + 1}, {v}: {[round(x['cpu_s'], 2) for x in rows]} cpu s "
                          f"({time.monotonic() - t0:.0f} s)", flush=True)
        finally:
            server.close()
    base = statistics.median(x["cpu_s"] for x in results[variants[0]])
    tokens = int(results[variants[0]][0]["tokens"])
    print(f"\n{args.run_dir}: {tokens:,} tokens an update, {args.rounds} rounds x {args.updates} updates a variant")
    print("| variant | cpu s/update | forward s | backward s | tower calls | policy loss (first timed update) | "
          f"vs {variants[0]} |")
    print("|---|---|---|---|---|---|---|")
    for v in variants:
        rows = results[v]
        cpu = statistics.median(x["cpu_s"] for x in rows)
        print(f"| {v} | {cpu:.2f} | {statistics.median(x['forward_s'] for x in rows):.2f} | "
              f"{statistics.median(x['backward_s'] for x in rows):.2f} | {rows[0]['tower_calls']} | "
              f"{rows[0]['policy_loss']:.6f} | {base / cpu:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
