"""``training.png``: what a run learnt, drawn from its ``metrics.jsonl`` (``worldloop up`` draws it
at the end of every run).

Public API::

    plot_metrics(metrics_path, out_png, window=5) -> bool

Left: held-out success over policy versions with 95% intervals (the evaluator's ``eval`` lines:
the in-run points joined by a line, the final evaluation, ``final`` true, a diamond of its own)
beside the training-batch success rate and its moving average over ``window`` steps. Right: the
mean trajectory reward of the training batches by component. Needs matplotlib (the ``plot``
extra); without it nothing is drawn and a warning is logged.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

REWARD_COMPONENTS = ("total", "env", "format", "reasoning")


def read_metrics(metrics_path: Path) -> tuple[list[dict], list[dict]]:
    """The learner's step records and the evaluator's ``eval`` records of metrics.jsonl, in file
    order (unreadable lines skipped; no file: nothing)."""
    rows, evals = [], []
    if metrics_path.exists():
        for line in metrics_path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if "eval" in rec:
                evals.append(rec["eval"])
            elif "step" in rec:
                rows.append(rec)
    return rows, evals


def _series(rows: list[dict], key: str, sub: str) -> list[float]:
    """``rows[i][key][sub]`` (or ``rows[i][key]`` when that is a number), NaN where missing."""
    vals = []
    for r in rows:
        v = r.get(key)
        v = v.get(sub) if isinstance(v, dict) else v
        vals.append(float("nan") if v is None else float(v))
    return vals


def _moving(xs: list[float], window: int) -> list[float]:
    """Mean of the last ``window`` values at each point, NaNs left out."""
    out = []
    for i in range(len(xs)):
        w = [x for x in xs[max(0, i - window + 1) : i + 1] if x == x]
        out.append(sum(w) / len(w) if w else float("nan"))
    return out


def _held_out(ax, evals: list[dict], fmt: str, color: str, label: str) -> None:
    """Held-out success of ``evals`` over policy versions with their 95% intervals."""
    if not evals:
        return
    vs = [e["policy_version"] for e in evals]
    rate = [e["success_rate"].get("all") for e in evals]
    lo = [e["ci95"]["all"][0] for e in evals]
    hi = [e["ci95"]["all"][1] for e in evals]
    n = evals[-1]["episodes"].get("all")
    # max(0, ...): the Wilson bound of 0 or n successes can pass the rate by a rounding error
    ax.errorbar(vs, rate, yerr=[[max(0.0, r - a) for r, a in zip(rate, lo)], [max(0.0, b - r) for r, b in zip(rate, hi)]],
                fmt=fmt, color=color, capsize=3, label=f"{label} ({n} episodes, 95% CI)")


def _success_panel(ax, rows: list[dict], evals: list[dict], window: int) -> None:
    steps = [r["step"] for r in rows]
    train = _series(rows, "success_rate", "all")
    ax.plot(steps, train, ".", color="0.7", label="training batch")
    ax.plot(steps, _moving(train, window), "-", color="0.35", label=f"training batch, moving mean of {window}")
    in_run = [e for e in evals if not e.get("final")]
    final = [e for e in evals if e.get("final")]
    _held_out(ax, in_run, "o-", "C0", "held-out")
    _held_out(ax, final, "D", "C3", "final held-out")
    ax.set_title("success rate")
    ax.set_xlabel("learner step = policy version")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=8, loc="upper left")


def _reward_panel(ax, rows: list[dict]) -> None:
    steps = [r["step"] for r in rows]
    for comp in REWARD_COMPONENTS:
        ax.plot(steps, _series(rows, "reward", comp), marker=".", label=comp)
    ax.set_title("mean trajectory reward by component (training batches)")
    ax.set_xlabel("learner step")
    ax.legend(fontsize=8)


def plot_metrics(metrics_path: Path, out_png: Path, window: int = 5) -> bool:
    """Draw ``training.png`` from metrics.jsonl (see the module docstring). False when there was
    nothing to draw (the picture then says so) or matplotlib is missing."""
    rows, evals = read_metrics(metrics_path)
    try:
        import matplotlib
    except ImportError:
        log.warning("training.png not drawn: matplotlib is not installed (pip install 'worldloop[plot]')")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    _success_panel(axes[0], rows, evals, window)
    _reward_panel(axes[1], rows)
    if not rows and not evals:
        for ax in axes:
            ax.text(0.5, 0.5, "no learner steps recorded", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return bool(rows or evals)
