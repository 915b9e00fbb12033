"""training.png (worldloop/plot.py) from a metrics.jsonl with in-run and final evaluations."""

from __future__ import annotations

import json
from pathlib import Path

from worldloop.eval.stats import wilson_interval
from worldloop.plot import plot_metrics, read_metrics


def _eval(version: int, k: int, n: int, final: bool, ci: tuple[float, float] | None = None) -> dict:
    return {"eval": {"policy_version": version, "final": final, "episodes": {"all": n}, "successes": {"all": k},
                     "success_rate": {"all": k / n}, "ci95": {"all": list(ci or wilson_interval(k, n))}}}


def test_no_success_and_a_final_evaluation_are_drawn(tmp_path: Path) -> None:
    # 0 of 3 as records written before wilson_interval kept the rate inside: a lower bound of 5.6e-17
    lines = [{"step": 1, "success_rate": {"all": 0.0}, "reward": {"total": 0.1}}, _eval(0, 0, 3, False, (5.6e-17, 0.56)),
             {"step": 2, "success_rate": {"all": 0.5}, "reward": {"total": 0.2}}, _eval(2, 3, 3, True)]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(x) + "\n" for x in lines))
    rows, evals = read_metrics(metrics)
    assert [r["step"] for r in rows] == [1, 2] and [e["final"] for e in evals] == [False, True]
    assert plot_metrics(metrics, tmp_path / "training.png")
    assert (tmp_path / "training.png").stat().st_size > 1000
