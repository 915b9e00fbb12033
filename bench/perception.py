"""Where does the tiny model lose the image? Vision-tower probes and an image-swap test of SFT.

    python bench/perception.py [--tint 0] [--probe-boards 1200] [--sft-episodes 512] [--sft-epochs 2]
                               [--sft-lr 5e-3] [--freeze-vision] [--out runs/bench-perception]

FrozenLake 4x4 as in ``configs/tiny-frozenlake.yaml`` (112 px, one 28-px cell per image token),
the embedded tiny model made fresh in ``--out`` (seed 0). Seeds: demonstrations from 5,000,000,
the swap-test probe demonstrations from 6,000,000, the probe boards from 7,000,000 (none are RL or
held-out eval seeds). Three measurements:

1. **relation probe**: a linear classifier (full batch Adam, 500 steps, L2 1e-3) on the initial
   vision tower's 16 image tokens concatenated in grid order, predicting the goal-to-player
   relation word(s) of the first observation; trained on the first 5/6 of the boards, accuracy on
   the rest, with the majority class beside it;
2. **position probe**: the same on the player's own image token alone, predicting the player's
   cell (16 classes);
3. **image-swap test**: SFT as ``worldloop up`` does it (concise answers), then the response loss
   on 64 held-out demonstrations with their true images and with each one's images taken from the
   next demonstration. A model that uses the image loses more with the wrong ones (gap > 0).

``--tint N`` (diagnostic only, no env option) adds N·row/(rows−1) to the red channel and
N·col/(cols−1) to the blue channel of every cell, by wrapping the grid renderer: position put into
the pixels of each cell. ``--freeze-vision`` keeps the vision tower at its initial weights in SFT.
Prints a table; nothing here is a pass/fail check.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import msgspec
import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from worldloop.common.contracts.config import load_config  # noqa: E402
from worldloop.common.contracts.modeling import ChatCodec, load_policy  # noqa: E402

ENV_KW = dict(size=4, is_slippery=False, max_actions_per_step=3, min_actions_to_succeed=3, image_size=112,
              render_mode="vision", prompt_format="grounding_worldmodeling", state_format="natural_language")


def install_tint(strength: float) -> None:
    import worldloop.envs.grid.frozenlake as fl
    import worldloop.envs.grid.render as render

    plain = render.compose

    def compose(codes, tiles, side=None):
        h, w = codes.shape
        cell = tiles.shape[1]
        img = plain(codes, tiles).astype(np.float32)
        img[..., 0] += strength * np.repeat(np.arange(h) / max(h - 1, 1), cell)[:, None]
        img[..., 2] += strength * np.repeat(np.arange(w) / max(w - 1, 1), cell)[None, :]
        return render.pad_square(np.clip(img, 0, 255).astype(np.uint8), side)

    fl.compose = compose


def linear_probe(x: torch.Tensor, labels: list[str]) -> tuple[float, float]:
    """Held-out accuracy of a linear classifier on ``x`` and the majority-class rate."""
    classes = sorted(set(labels))
    y = torch.tensor([classes.index(v) for v in labels])
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    n = len(y) * 5 // 6
    w = torch.zeros(x.shape[1], len(classes), requires_grad=True)
    b = torch.zeros(len(classes), requires_grad=True)
    opt = torch.optim.Adam([w, b], lr=1e-2)
    for _ in range(500):
        loss = torch.nn.functional.cross_entropy(x[:n] @ w + b, y[:n]) + 1e-3 * (w**2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        acc = float(((x[n:] @ w + b).argmax(1) == y[n:]).float().mean())
    return acc, float(np.bincount(y.numpy()).max() / len(y))


def probes(model_dir: Path, boards: int) -> dict[str, tuple[float, float]]:
    import gymnasium

    from worldloop import envs  # noqa: F401  (registers worldloop/* ids)

    codec = ChatCodec(model_dir, max_image_side=112)
    visual = load_policy(model_dir, dtype="float32").eval().model.visual
    env = gymnasium.make("worldloop/FrozenLake-v0", **ENV_KW)
    tokens, relations, cells, player_tokens = [], [], [], []
    for k in range(boards):
        obs, _ = env.reset(seed=7_000_000 + k)
        u = env.unwrapped
        relations.append(u.expert_response().split("<observation>")[1].split(" of the player")[0].split(".")[0])
        r, c = u.player
        cells.append(f"{r},{c}")
        vis = codec.vision_inputs([codec.prepare_image(obs["image"])])
        with torch.no_grad():
            out = visual(vis["pixel_values"], grid_thw=vis["image_grid_thw"])
        feats = out if torch.is_tensor(out) else out.pooler_output
        tokens.append(feats.flatten())
        player_tokens.append(feats[r * u.size + c])
        if (k + 1) % 200 == 0:
            print(f"[perception] probe boards {k + 1}/{boards}", flush=True)
    env.close()
    return {"relation probe (16 tokens, grid order)": linear_probe(torch.stack(tokens), relations),
            "position probe (the player's token)": linear_probe(torch.stack(player_tokens), cells)}


def swap_test(model_dir: Path, episodes: int, epochs: int, lr: float, freeze_vision: bool) -> dict:
    from worldloop.bootstrap import sft

    cfg = load_config(str(ROOT / "configs" / "tiny-frozenlake.yaml"), [])
    codec = ChatCodec(model_dir, max_image_side=112)
    specs = [{"id": "worldloop/FrozenLake-v0", "kwargs": ENV_KW}]
    style = sft.demonstration_style(cfg.sft)
    demos = sft.make_demonstrations(specs, episodes, 5_000_000, codec, cfg.actor.max_turns, **style)
    held = sft.make_demonstrations(specs, 64, 6_000_000, codec, cfg.actor.max_turns, **style)
    if freeze_vision:  # run_sft's AdamW skips parameters without gradients
        plain_load = sft.load_policy

        def load_frozen(*a, **k):
            m = plain_load(*a, **k)
            m.model.visual.requires_grad_(False)
            return m

        sft.load_policy = load_frozen
    report = sft.run_sft(model_dir, demos, epochs, lr, cfg.sft.batch_size, codec=codec,
                         progress=lambda p: p["step"] % 50 == 0 and print(f"[perception] sft {p}", flush=True))
    swapped = []
    for i, d in enumerate(held):
        other = held[(i + 1) % len(held)]
        turns = [msgspec.structs.replace(t, images=other.turns[min(j, len(other.turns) - 1)].images)
                 for j, t in enumerate(d.turns)]
        swapped.append(msgspec.structs.replace(d, turns=turns))
    model = load_policy(model_dir, dtype="float32").eval()
    true_loss, swap_loss = sft.sequence_loss(model, held, codec), sft.sequence_loss(model, swapped, codec)
    return {"steps": report["steps"], "true": true_loss, "swapped": swap_loss}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tint", type=float, default=0.0)
    ap.add_argument("--probe-boards", type=int, default=1200)
    ap.add_argument("--sft-episodes", type=int, default=512)
    ap.add_argument("--sft-epochs", type=int, default=2)
    ap.add_argument("--sft-lr", type=float, default=5e-3)
    ap.add_argument("--freeze-vision", action="store_true")
    ap.add_argument("--out", default="runs/bench-perception")
    args = ap.parse_args()
    from worldloop.bootstrap.tiny_model import make_tiny_model

    if args.tint:
        install_tint(args.tint)
    model_dir = Path(args.out).resolve() / "model"
    shutil.rmtree(model_dir, ignore_errors=True)
    make_tiny_model(model_dir, seed=0, max_image_side=112)
    rows = probes(model_dir, args.probe_boards)
    swap = swap_test(model_dir, args.sft_episodes, args.sft_epochs, args.sft_lr, args.freeze_vision)
    print(f"\nFrozenLake 4x4, tint {args.tint:g}\n\n| probe | held-out accuracy | majority class |\n|---|---|---|")
    for name, (acc, majority) in rows.items():
        print(f"| {name} | {acc:.3f} | {majority:.3f} |")
    print(f"\n| SFT ({args.sft_episodes} demos x {args.sft_epochs} epochs, lr {args.sft_lr:g}, vision "
          f"{'frozen' if args.freeze_vision else 'trained'}; {swap['steps']} steps) | loss, true images | "
          f"loss, swapped images | gap |\n|---|---|---|---|\n| 64 held-out demonstrations | {swap['true']:.4f} | "
          f"{swap['swapped']:.4f} | {swap['swapped'] - swap['true']:+.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
