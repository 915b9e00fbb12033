"""Two models on the same held-out seeds: the paired comparison of two ``worldloop eval`` outputs.

Public API::

    outcomes(path) -> {(env name, seed): success}     # an episodes.jsonl (or its folder); errors left out
    paired(base, new) -> Paired                        # on the (env, seed) pairs both played
    Paired.n, .base_solved, .new_solved, .wins, .losses, .p, .rate(which), .interval(which), .row(label)
    python -m worldloop.eval.compare BASE NEW [--label L]

``wins`` are the seeds only the new model solved, ``losses`` the seeds only the base solved; seeds
both or neither solved say nothing about which is better. The test is the two-sided exact sign test
on the discordant seeds (:func:`worldloop.eval.stats.sign_test_p`), the rates come with Wilson 95 %
intervals. With keyed sampling (``eval.sampling: keyed``, the default) the two evaluations share
their noise seed by seed, which leaves fewer discordant seeds at the same difference and so a
smaller p for a real one; the test stays valid, since a seed's win and loss probabilities differ
exactly by the two models' success probabilities on it however the noise is shared.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from worldloop.eval.stats import sign_test_p, wilson_interval


def outcomes(path: str | Path) -> dict[tuple[str, int], bool]:
    """``(env name, seed) -> success`` of every episode recorded without an error (the newer line wins)."""
    path = Path(path)
    if path.is_dir():
        path = path / "episodes.jsonl"
    out: dict[tuple[str, int], bool] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            key = (str(rec["env"]), int(rec["seed"]))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{n}: not an episode record ({e})") from None
        if rec.get("error"):
            out.pop(key, None)
        else:
            out[key] = bool(rec.get("success"))
    return out


@dataclass(frozen=True)
class Paired:
    n: int  # seeds both evaluations played without an error
    base_solved: int
    new_solved: int
    wins: int  # only the new model solved
    losses: int  # only the base solved

    @property
    def p(self) -> float:
        return sign_test_p(self.wins, self.losses)

    def rate(self, which: str) -> float:
        return (self.base_solved if which == "base" else self.new_solved) / max(self.n, 1)

    def interval(self, which: str) -> tuple[float, float]:
        return wilson_interval(self.base_solved if which == "base" else self.new_solved, self.n)

    def row(self, label: str = "") -> str:
        """One markdown row: label | n | base (CI) | new (CI) | difference | wins / losses | p."""
        (bl, bh), (nl, nh) = self.interval("base"), self.interval("new")
        p = f"{self.p:.3f}" if self.p >= 0.001 else f"{self.p:.0e}"
        return (f"| {label} | {self.n} | {self.rate('base'):.3f} [{bl:.3f}, {bh:.3f}] | {self.rate('new'):.3f} "
                f"[{nl:.3f}, {nh:.3f}] | {self.rate('new') - self.rate('base'):+.3f} | {self.wins} / {self.losses} | {p} |")


HEADER = ("| comparison | seeds | base (95% CI) | new (95% CI) | difference | only new / only base solved | sign test p |\n"
          "|---|---|---|---|---|---|---|")


def paired(base: dict[tuple[str, int], bool], new: dict[tuple[str, int], bool]) -> Paired:
    shared = sorted(set(base) & set(new))
    return Paired(n=len(shared), base_solved=sum(base[k] for k in shared), new_solved=sum(new[k] for k in shared),
                  wins=sum(new[k] and not base[k] for k in shared), losses=sum(base[k] and not new[k] for k in shared))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m worldloop.eval.compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("base", help="the base model's eval output folder or episodes.jsonl")
    ap.add_argument("new", help="the new model's eval output folder or episodes.jsonl")
    ap.add_argument("--label", default="", help="the row's label")
    args = ap.parse_args(argv)
    try:
        result = paired(outcomes(args.base), outcomes(args.new))
    except (OSError, ValueError) as e:
        print(f"compare: {e}", file=sys.stderr)
        return 2
    if result.n == 0:
        print("compare: the two evaluations share no (env, seed) played without an error", file=sys.stderr)
        return 2
    print(HEADER)
    print(result.row(args.label))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
