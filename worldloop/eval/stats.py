"""Statistics and the results table of ``worldloop eval`` (layout of VAGEN Table 2).

Public API::

    Z95 = 1.959963984540054
    wilson_interval(successes, n, z=Z95) -> (low, high)        # score interval for a proportion
    t_quantile_975(df) -> float                                 # two-sided 95% Student t critical value
    mean_interval(values) -> (mean, low, high)                  # mean +- t * s / sqrt(n)
    sign_test_p(wins, losses) -> float                          # two-sided exact sign test
    sign_test_power(n, p_win, p_loss, alpha=0.01) -> float      # its power on n paired seeds
    build_table(records, order=None) -> Table                   # from episode records (episodes.jsonl)
    Table.cells, .errors, .render_text(title), .render_markdown(title), .render_csv()

Layout (VAGEN Table 2): one column group per task (env family: FrozenLake, Sokoban, Navigation,
PrimitiveSkill, SVG, then any other, e.g. Maze, Taxi), one column per sub-task (``info["task"]``) when
a task has several, plus their ``Average``; an ``Overall`` column, the mean of the task values (a
task's value is its Average when it has sub-tasks). Success-rate tasks show the fraction of episodes
with ``success``. Similarity tasks (SVG) show the mean over episodes of each similarity metric the
env reports at the end of the episode, under the metric's own name (``dino``, ``dreamsim`` or
``pixel_similarity``, which is a pixel-level score and not DreamSim/DINO), and their Average. Which
tasks are similarity tasks, and their metrics, is their env family's knowledge
(``EnvFamily.similarity_metrics``, :func:`similarity_metrics`).

Intervals (95%): Wilson score interval for a success rate; mean +- t(0.975, n-1) * s / sqrt(n) for a
similarity (n >= 2). Averages and Overall combine their parts as independent estimates with a normal
approximation: se_part = (half width of the part's interval) / (its critical value), and
mean +- 1.96 * sqrt(sum se_part^2) / k. A part without episodes makes its averages undefined ("-").

Episodes recorded with an ``error`` (the endpoint kept failing, the env raised) are not counted in
any cell: each cell reports its number of episodes ``n``, and the table's footnote lists the errors.
"""

from __future__ import annotations

import csv
import io
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable

from worldloop.envs.family import families

Z95 = 1.959963984540054

# two-sided 95% critical values of Student's t, df = 1..30 (beyond: Cornish-Fisher expansion)
_T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
         2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
         2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423)

# Table 2's column order; families not listed follow in the order first seen
FAMILY_ORDER = ("FrozenLake", "Sokoban", "Navigation", "PrimitiveSkill", "SVG")
SUBTASK_ORDER = {"Navigation": ("base", "common_sense"), "PrimitiveSkill": ("place", "stack", "drawer", "align")}
SIMILARITY_FALLBACK = "similarity"


def similarity_metrics(task: str) -> tuple[str, ...] | None:
    """The metric names a task scored by similarity instead of success shows (its env family's
    ``similarity_metrics``: SVG's dino, dreamsim, pixel_similarity), None for a success-rate task."""
    return next((f.similarity_metrics[task] for f in families() if task in f.similarity_metrics), None)


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of ``successes`` out of ``n`` (``(0, 1)`` when n is 0)."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    z2 = z * z
    denom = 1.0 + z2 / n
    center = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denom
    # the interval holds p; min/max keep a rounding error (0 of 3: 5.6e-17) from putting p outside it
    return max(0.0, min(p, center - half)), min(1.0, max(p, center + half))


def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = Z95  # Abramowitz & Stegun 26.7.5; error < 1e-4 from df = 30 on
    g1 = (z ** 3 + z) / 4
    g2 = (5 * z ** 5 + 16 * z ** 3 + 3 * z) / 96
    g3 = (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / 384
    return z + g1 / df + g2 / df ** 2 + g3 / df ** 3


def mean_interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the t interval of the mean; a single value gets a zero-width interval."""
    n = len(values)
    if n == 0:
        raise ValueError("no values")
    mean = sum(values) / n
    if n == 1:
        return mean, mean, mean
    s = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile_975(n - 1) * s / math.sqrt(n)
    return mean, mean - half, mean + half


def _log_binom_pmf(k: int, n: int, p: float) -> float:
    if p <= 0.0:
        return 0.0 if k == 0 else -math.inf
    if p >= 1.0:
        return 0.0 if k == n else -math.inf
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
            + k * math.log(p) + (n - k) * math.log1p(-p))


def sign_test_p(wins: int, losses: int) -> float:
    """Two-sided exact sign test on the discordant pairs of a paired comparison.

    ``wins``: seeds only the new model solved, ``losses``: seeds only the old one solved; seeds both
    or neither solved carry no information about which is better and are left out.
    p = min(1, 2 * P(X <= min(wins, losses))), X ~ Binomial(wins + losses, 1/2).
    """
    if wins < 0 or losses < 0:
        raise ValueError(f"counts must be >= 0, got {wins}, {losses}")
    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)


def _sign_test_critical(d: int, alpha: float) -> int:
    """The largest k with sign_test_p(k, d - k) < alpha (-1 when no split of d pairs reaches alpha)."""
    k, tail = -1, 0.0
    while k + 1 <= d // 2:
        tail_next = tail + math.exp(_log_binom_pmf(k + 1, d, 0.5))
        if min(1.0, 2 * tail_next) >= alpha:
            break
        k, tail = k + 1, tail_next
    return k


def sign_test_power(n: int, p_win: float, p_loss: float, alpha: float = 0.01) -> float:
    """Probability that :func:`sign_test_p` < ``alpha`` on ``n`` paired seeds.

    Each seed is, independently, a win (only the new model solves it) with probability ``p_win``, a
    loss with ``p_loss``, and a tie otherwise: the number of discordant seeds D ~ Binomial(n, p_win +
    p_loss), and given D = d the wins W ~ Binomial(d, p_win / (p_win + p_loss)). The test rejects when
    min(W, d - W) <= k*(d), its critical value, so
    power = sum_d P(D = d) * (P(W <= k*(d)) + P(W >= d - k*(d))). Used to size an evaluation from
    rates measured on tuning seeds before the report seeds are played.
    """
    if n < 0 or not (0.0 <= p_win and 0.0 <= p_loss and p_win + p_loss <= 1.0):
        raise ValueError(f"need n >= 0 and probabilities p_win, p_loss >= 0 summing to <= 1, got {n}, {p_win}, {p_loss}")
    pd = p_win + p_loss
    if pd == 0.0:
        return 0.0
    q = p_win / pd
    power = 0.0
    for d in range(n + 1):
        w_d = math.exp(_log_binom_pmf(d, n, pd))
        if w_d < 1e-15:
            continue
        k = _sign_test_critical(d, alpha)
        if k < 0:
            continue
        low = sum(math.exp(_log_binom_pmf(w, d, q)) for w in range(k + 1))
        high = sum(math.exp(_log_binom_pmf(w, d, q)) for w in range(d - k, d + 1))
        power += w_d * (low + high)
    return min(1.0, power)


@dataclass
class Cell:
    family: str  # "Sokoban"
    column: str  # sub-task label, metric name, "Average", or "" when the family has one column
    kind: str  # "success" | "similarity" | "average" | "overall"
    value: float | None
    low: float | None
    high: float | None
    n: int  # episodes behind the value (sum of the parts for averages)
    se: float | None = None  # standard error used when this cell is part of an average
    interval: str = ""  # wilson | t | normal

    @property
    def label(self) -> str:
        return f"{self.family}: {self.column}" if self.column else self.family


@dataclass
class Table:
    cells: list[Cell]
    errors: dict[str, int] = field(default_factory=dict)  # env name -> episodes recorded with an error
    error_reasons: dict[str, int] = field(default_factory=dict)

    # ------------------------------------------------------------------ rendering

    def _columns(self) -> list[tuple[str, str, list[str]]]:
        """(family header, sub-header, [value, ci, n]) per cell, in table order."""
        out = []
        for c in self.cells:
            if c.value is None:
                val, ci = "-", "-"
            else:
                val, ci = f"{c.value:.2f}", f"[{c.low:.2f}, {c.high:.2f}]"
            out.append((c.family, c.column, [val, ci, str(c.n)]))
        return out

    def footnotes(self) -> list[str]:
        notes = ["95% CI: Wilson for success rates, t interval for similarities, normal approximation "
                 "for Average/Overall (parts treated as independent); n = episodes per cell."]
        if any(c.kind == "similarity" and c.column == "pixel_similarity" for c in self.cells):
            notes.append("pixel_similarity is a pixel-level image similarity (envs/svg/metrics.py), "
                         "not DreamSim or DINO.")
        if self.errors:
            total = sum(self.errors.values())
            per_env = ", ".join(f"{k} {v}" for k, v in sorted(self.errors.items()))
            why = ", ".join(f"{k} x{v}" for k, v in sorted(self.error_reasons.items()))
            notes.append(f"{total} episode(s) failed and are not counted ({per_env}); reasons: {why}.")
        return notes

    def render_text(self, title: str = "") -> str:
        cols = self._columns()
        heads = [("", ""), *[(f, s) for f, s, _ in cols]]
        rows = [["score", *[v[0] for _, _, v in cols]], ["95% CI", *[v[1] for _, _, v in cols]],
                ["n", *[v[2] for _, _, v in cols]]]
        widths = [max(len(heads[i][0]), len(heads[i][1]), *(len(r[i]) for r in rows)) for i in range(len(heads))]
        # print a family name once over its first column (Table 2 style)
        fam_line, prev = [], None
        for i, (f, _) in enumerate(heads):
            fam_line.append(f if f != prev else "")
            prev = f
        lines = [title] if title else []
        lines.append("  ".join(fam_line[i].ljust(widths[i]) for i in range(len(heads))).rstrip())
        if any(h[1] for h in heads):
            lines.append("  ".join(heads[i][1].ljust(widths[i]) for i in range(len(heads))).rstrip())
        lines.append("  ".join("-" * w for w in widths))
        for r in rows:
            lines.append("  ".join(r[i].ljust(widths[i]) for i in range(len(heads))).rstrip())
        lines += [f"* {n}" for n in self.footnotes()]
        return "\n".join(lines) + "\n"

    def render_markdown(self, title: str = "", model: str = "") -> str:
        cols = self._columns()
        head = ["Model", *[f"{f}<br>{s}" if s else f for f, s, _ in cols]]
        out = [f"## {title}", ""] if title else []
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "|".join(["---"] + [":---:"] * len(cols)) + "|")
        out.append("| " + " | ".join([model or "score", *[v[0] for _, _, v in cols]]) + " |")
        out.append("| " + " | ".join(["95% CI", *[v[1] for _, _, v in cols]]) + " |")
        out.append("| " + " | ".join(["n", *[v[2] for _, _, v in cols]]) + " |")
        out.append("")
        out += [f"- {n}" for n in self.footnotes()]
        return "\n".join(out) + "\n"

    def render_csv(self, model: str = "") -> str:
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["model", "task", "subtask", "kind", "value", "ci_low", "ci_high", "n", "interval"])
        for c in self.cells:
            fmt = (lambda x: "" if x is None else f"{x:.6f}")
            w.writerow([model, c.family, c.column, c.kind, fmt(c.value), fmt(c.low), fmt(c.high), c.n, c.interval])
        return buf.getvalue()


# --------------------------------------------------------------------------- building


def _success_cell(family: str, column: str, outcomes: list[bool]) -> Cell:
    n = len(outcomes)
    if n == 0:
        return Cell(family, column, "success", None, None, None, 0)
    k = sum(bool(x) for x in outcomes)
    low, high = wilson_interval(k, n)
    return Cell(family, column, "success", k / n, low, high, n, se=(high - low) / (2 * Z95), interval="wilson")


def _similarity_cell(family: str, column: str, values: list[float]) -> Cell:
    n = len(values)
    if n == 0:
        return Cell(family, column, "similarity", None, None, None, 0)
    mean, low, high = mean_interval(values)
    crit = t_quantile_975(n - 1) if n > 1 else 1.0
    return Cell(family, column, "similarity", mean, low, high, n, se=(high - low) / 2 / crit, interval="t")


def _average_cell(family: str, column: str, kind: str, parts: list[Cell], clip: bool) -> Cell:
    n = sum(p.n for p in parts)
    if not parts or any(p.value is None for p in parts):
        return Cell(family, column, kind, None, None, None, n, interval="normal")
    k = len(parts)
    mean = sum(p.value for p in parts) / k  # type: ignore[misc]
    se = math.sqrt(sum((p.se or 0.0) ** 2 for p in parts)) / k
    low, high = mean - Z95 * se, mean + Z95 * se
    if clip:
        low, high = max(0.0, low), min(1.0, high)
    return Cell(family, column, kind, mean, low, high, n, se=se, interval="normal")


def family_of(env_id: str) -> str:
    """worldloop/PrimitiveSkill-v0 -> PrimitiveSkill."""
    return env_id.split("/")[-1].split("-v")[0]


def _ordered(keys: Iterable[str], preferred: tuple[str, ...]) -> list[str]:
    keys = list(dict.fromkeys(keys))
    return [k for k in preferred if k in keys] + [k for k in keys if k not in preferred]


def build_table(records: list[dict]) -> Table:
    """The Table-2 layout of finished episode records (the lines of ``episodes.jsonl``).

    A record needs ``env`` (the name given on --envs), ``env_id``, ``task``, ``success``, ``metrics``
    and ``error`` (None when the episode ran to its end). Records are taken in the order given.
    """
    errors: dict[str, int] = defaultdict(int)
    reasons: dict[str, int] = defaultdict(int)
    fams: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        fam = family_of(r["env_id"])
        fams.setdefault(fam, [])
        if r.get("error"):
            errors[r["env"]] += 1
            reasons[str(r["error"]).split(":")[0]] += 1
            continue
        fams[fam].append(r)
    cells: list[Cell] = []
    family_values: list[Cell] = []
    for fam in _ordered(fams, FAMILY_ORDER):
        recs = fams[fam]
        metrics = similarity_metrics(fam)
        parts = _similarity_parts(fam, metrics, recs) if metrics else _success_parts(fam, recs)
        if not parts:  # every episode of this family failed
            parts = [Cell(fam, "", "similarity" if metrics else "success", None, None, None, 0)]
        cells += parts
        if len(parts) > 1:
            avg = _average_cell(fam, "Average", "average", parts, clip=True)
            cells.append(avg)
            family_values.append(avg)
        else:
            family_values.append(parts[0])
    if family_values:
        cells.append(_average_cell("Overall", "", "overall", family_values, clip=True))
    return Table(cells, dict(errors), dict(reasons))


def _success_parts(fam: str, recs: list[dict]) -> list[Cell]:
    by_task: dict[str, list[bool]] = defaultdict(list)
    # the same task label from two differently configured envs (e.g. two presets) stays apart
    envs_of_task: dict[str, set[str]] = defaultdict(set)
    for r in recs:
        envs_of_task[str(r.get("task") or "")].add(r["env"])
    for r in recs:
        task = str(r.get("task") or "")
        label = task if len(envs_of_task[task]) == 1 else f"{r['env']}:{task}"
        by_task[label].append(bool(r["success"]))
    labels = _ordered(by_task, SUBTASK_ORDER.get(fam, ()))
    if len(labels) == 1:
        return [_success_cell(fam, "", by_task[labels[0]])]
    return [_success_cell(fam, t, by_task[t]) for t in labels]


def _similarity_parts(fam: str, metrics: tuple[str, ...], recs: list[dict]) -> list[Cell]:
    reported: list[str] = []
    for r in recs:
        reported += list((r.get("metrics") or {}).keys())
    names = [m for m in metrics if m in reported]
    if not names and SIMILARITY_FALLBACK in reported:
        names = [SIMILARITY_FALLBACK]
    return [_similarity_cell(fam, m, [float(r["metrics"][m]) for r in recs if m in (r.get("metrics") or {})])
            for m in names]
