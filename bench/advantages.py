"""Advantage estimators at the real size (B=128 trajectories, L=8192 tokens) against a dense baseline.

    python bench/advantages.py [--rows 128] [--length 8192] [--repeat 3] [--device cpu|cuda]

Ours (``worldloop.learner.advantages``) packs the generated tokens of each row to the left and scans only
those (a Python loop over the packed length, one fused op per step, vectorised over the batch).
The baseline, measured in the same run on the same batch, is the usual verl-style dense scan:
a reverse loop over all L positions with masked carries (values and advantages carried over the
observation tokens), vectorised over the batch too. Both results are checked equal before timing.
Layout: per row, turns of (observation 200-600 tokens, response 50-300 tokens) until L is full,
then right padding. Prints median milliseconds and the ratio baseline/ours per estimator
(estimators without a dense counterpart print only their own time).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from worldloop.common.contracts.algorithms import ESTIMATORS  # noqa: E402
from worldloop.learner.advantages import compute_advantages  # noqa: E402

KW = dict(gamma=1.0, lam=0.95, gamma_turn=0.95, lam_turn=1.0, gamma_token=1.0, lam_token=0.95)


def make_batch(rows: int, length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    resp = torch.zeros(rows, length, dtype=torch.bool)
    end = torch.zeros(rows, length, dtype=torch.bool)
    attention = torch.zeros(rows, length, dtype=torch.long)
    for b in range(rows):
        pos = 0
        while True:
            n_obs = int(torch.randint(200, 600, (1,), generator=gen))
            n_resp = int(torch.randint(50, 300, (1,), generator=gen))
            if pos + n_obs + n_resp > length - int(torch.randint(0, 2000, (1,), generator=gen)):
                break
            pos += n_obs
            resp[b, pos : pos + n_resp] = True
            end[b, pos + n_resp - 1] = True
            pos += n_resp
        attention[b, :pos] = 1
    return dict(
        values=torch.randn(rows, length, generator=gen),
        response_mask=resp.float(),
        turn_end_mask=end.float(),
        turn_rewards=torch.where(end, torch.randn(rows, length, generator=gen), 0.0),
        token_rewards=-0.001 * torch.rand(rows, length, generator=gen),
        attention_mask=attention,
    )


def dense_scan(mask, values, rewards, gamma, lam, stop=None):
    """verl-style reverse loop over all L positions, carrying V and A across unmasked positions.

    At a masked position a = r + gamma*V_next - V + gamma*lam*A_next; at a ``stop`` position
    a = r (a bilevel turn end, whose r already holds k + A_turn).
    """
    rows, length = mask.shape
    adv = torch.zeros_like(values)
    next_v = torch.zeros(rows, device=values.device)
    carry = torch.zeros(rows, device=values.device)
    for t in range(length - 1, -1, -1):
        mt = mask[:, t]
        a = rewards[:, t] + gamma * next_v - values[:, t] + gamma * lam * carry
        if stop is not None:
            a = torch.where(stop[:, t], rewards[:, t], a)
        next_v = torch.where(mt, values[:, t], next_v)
        carry = torch.where(mt, a, carry)
        adv[:, t] = torch.where(mt, a, 0.0)
    return adv


def dense_masked_gae(values, response_mask, turn_end_mask, turn_rewards, token_rewards, gamma, lam, **_):
    m, end = response_mask > 0, turn_end_mask > 0
    last = (m.shape[1] - 1) - m.flip(1).to(torch.uint8).argmax(1)
    r = torch.where(m, token_rewards, 0.0)
    r = r.scatter_add(1, last[:, None], torch.where(end, turn_rewards, 0.0).sum(1, keepdim=True))
    adv = dense_scan(m, values, r, gamma, lam)
    return adv, torch.where(m, adv + values, 0.0)


def dense_bilevel_gae(values, response_mask, turn_end_mask, turn_rewards, token_rewards, gamma_turn, lam_turn, gamma_token, lam_token, **_):
    m, end = response_mask > 0, turn_end_mask > 0
    turn_adv = dense_scan(end, values, torch.where(end, turn_rewards, 0.0), gamma_turn, lam_turn)
    r = torch.where(m, token_rewards, 0.0) + turn_adv
    adv = dense_scan(m, values, r, gamma_token, lam_token, stop=end)
    return adv, torch.where(m, adv + values, 0.0)


def timed(fn, repeat: int, device: str) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    batch = {k: v.to(args.device) for k, v in make_batch(args.rows, args.length).items()}
    share = float((batch["response_mask"] > 0).float().mean())
    print(f"B={args.rows} L={args.length} device={args.device} generated-token share={share:.2f} torch={torch.__version__}")
    print(f"{'estimator':<12} {'ours ms':>9} {'dense baseline ms':>18} {'baseline/ours':>14}")
    no_attention = {k: v for k, v in batch.items() if k != "attention_mask"}
    groups = [b // 8 for b in range(args.rows)]
    baselines = {"masked_gae": dense_masked_gae, "bilevel_gae": dense_bilevel_gae}
    for name in (n for n, spec in ESTIMATORS.items() if not spec.step_groups):  # step groups need anchors
        ours_ms, ours = timed(lambda: compute_advantages(name, **batch, **KW, group_ids=groups), args.repeat, args.device)
        if name in baselines:
            base_ms, base = timed(lambda: baselines[name](**no_attention, **KW), args.repeat, args.device)
            for x, y in zip(ours, base):
                torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
            print(f"{name:<12} {ours_ms:>9.1f} {base_ms:>18.1f} {base_ms / ours_ms:>13.1f}x")
        else:
            print(f"{name:<12} {ours_ms:>9.1f} {'-':>18} {'-':>14}")


if __name__ == "__main__":
    main()
