"""The statistics and the Table-2 layout of ``worldloop eval`` against values computed by hand."""

from __future__ import annotations

import csv
import io
import math

import pytest

from worldloop.eval.stats import (Z95, build_table, mean_interval, sign_test_p, sign_test_power, t_quantile_975,
                                  wilson_interval)


def test_wilson_interval_by_hand() -> None:
    # 7 of 10, z = 1.96: z^2 = 3.8416, denom = 1 + 3.8416/10 = 1.38416
    # center = (0.7 + 3.8416/20) / 1.38416 = 0.89208 / 1.38416 = 0.644491
    # half = 1.96 * sqrt(0.7*0.3/10 + 3.8416/400) / 1.38416 = 1.96 * sqrt(0.030604) / 1.38416 = 0.247719
    low, high = wilson_interval(7, 10, z=1.96)
    assert low == pytest.approx(0.644491 - 0.247719, abs=1e-5)  # 0.396772
    assert high == pytest.approx(0.644491 + 0.247719, abs=1e-5)  # 0.892210
    # 0 of 8: center = (3.8416/16) / (1 + 3.8416/8) = 0.2401 / 1.4802 = 0.162208, half the same
    low, high = wilson_interval(0, 8, z=1.96)
    assert low == 0.0 and high == pytest.approx(2 * 0.2401 / 1.4802, abs=1e-5)  # 0.324416
    # 8 of 8 mirrors 0 of 8
    low, high = wilson_interval(8, 8, z=1.96)
    assert high == 1.0 and low == pytest.approx(1 - 2 * 0.2401 / 1.4802, abs=1e-5)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    # the interval always holds the rate, rounding errors included (0 of 3 gave a bound of 5.6e-17)
    assert wilson_interval(0, 3)[0] == 0.0
    assert all(lo <= k / n <= hi for n in range(1, 80) for k in range(n + 1) for lo, hi in [wilson_interval(k, n)])


def test_sign_test_by_hand() -> None:
    # 9 wins, 1 loss: 2 * (C(10,0) + C(10,1)) / 2^10 = 22 / 1024
    assert sign_test_p(9, 1) == pytest.approx(22 / 1024)
    assert sign_test_p(1, 9) == sign_test_p(9, 1)
    # 3 / 3: 2 * (1 + 6 + 15 + 20) / 64 = 84 / 64, capped at 1
    assert sign_test_p(3, 3) == 1.0
    assert sign_test_p(0, 0) == 1.0
    # 8 / 0: 2 / 256
    assert sign_test_p(8, 0) == pytest.approx(2 / 256)
    with pytest.raises(ValueError, match="counts must be >= 0, got -1, 2"):
        sign_test_p(-1, 2)


def test_sign_test_power_by_hand() -> None:
    # 10 seeds, every one discordant, a win with probability 0.9; at alpha 0.05 the test rejects
    # for 9 or 10 wins (p = 22/1024 and 2/1024) or as many losses, not for 8 (2 * 56 / 1024 = 0.109):
    # power = P(W >= 9) + P(W <= 1), W ~ Binomial(10, 0.9)
    by_hand = 0.9 ** 10 + 10 * 0.9 ** 9 * 0.1 + 10 * 0.9 * 0.1 ** 9 + 0.1 ** 10
    assert sign_test_power(10, 0.9, 0.1, alpha=0.05) == pytest.approx(by_hand, rel=1e-9)
    # ties: 8 seeds, half of them won by the new model and none by the old one; at alpha 0.01 only 8
    # wins out of 8 discordant seeds reject (2 / 256 < 0.01; 7 of 7 gives 2 / 128), i.e. every seed won
    assert sign_test_power(8, 0.5, 0.0, alpha=0.01) == pytest.approx(0.5 ** 8, rel=1e-9)
    # no discordant seeds ever, or too few seeds to reach alpha at all
    assert sign_test_power(100, 0.0, 0.0) == 0.0
    assert sign_test_power(7, 1.0, 0.0, alpha=0.01) == 0.0  # 7 of 7: p = 2/128 > 0.01
    # more seeds, more power; no effect: power near alpha at most (the exact test is conservative)
    assert sign_test_power(512, 0.13, 0.085) < sign_test_power(2048, 0.13, 0.085)
    assert sign_test_power(2048, 0.1, 0.1, alpha=0.01) <= 0.01
    with pytest.raises(ValueError, match="summing to <= 1, got 10, 0.7, 0.5"):
        sign_test_power(10, 0.7, 0.5)


def test_t_quantiles_and_mean_interval_by_hand() -> None:
    assert t_quantile_975(1) == pytest.approx(12.7062, abs=1e-4)
    assert t_quantile_975(4) == pytest.approx(2.7764, abs=1e-4)
    # beyond the table: Cornish-Fisher; t(0.975, 60) = 2.0003, t(0.975, 120) = 1.9799
    assert t_quantile_975(60) == pytest.approx(2.0003, abs=2e-4)
    assert t_quantile_975(120) == pytest.approx(1.9799, abs=2e-4)
    with pytest.raises(ValueError, match="degrees of freedom must be >= 1, got 0"):
        t_quantile_975(0)
    # values 0.2, 0.4, 0.6, 0.8, 1.0: mean 0.6, s^2 = (0.16+0.04+0+0.04+0.16)/4 = 0.1, s = 0.316228
    # half = 2.7764 * 0.316228 / sqrt(5) = 2.7764 * 0.141421 = 0.392642
    mean, low, high = mean_interval([0.2, 0.4, 0.6, 0.8, 1.0])
    assert mean == pytest.approx(0.6)
    assert (low, high) == (pytest.approx(0.6 - 0.392642, abs=1e-5), pytest.approx(0.6 + 0.392642, abs=1e-5))
    assert mean_interval([0.5]) == (0.5, 0.5, 0.5)


def _rec(env: str, env_id: str, task: str, success: bool, metrics=None, error=None) -> dict:
    return {"env": env, "env_id": env_id, "task": task, "success": success, "metrics": metrics or {}, "error": error}


def test_table_layout_subtasks_similarity_average_overall_and_errors() -> None:
    recs = []
    # Sokoban: 3 of 4 succeed, plus one endpoint failure that must not count
    recs += [_rec("sokoban", "worldloop/Sokoban-v0", "6x6-1box", s) for s in (True, True, True, False)]
    recs.append(_rec("sokoban", "worldloop/Sokoban-v0", "6x6-1box", False, error="http_500"))
    # Navigation with two sub-tasks: common_sense 1/2, base 2/2 (order must follow Table 2: base first)
    recs += [_rec("navigation", "worldloop/Navigation-v0", "common_sense", s) for s in (True, False)]
    recs += [_rec("navigation", "worldloop/Navigation-v0", "base", True) for _ in range(2)]
    # SVG: a pixel similarity (the fallback "similarity" alias must not become a column)
    recs += [_rec("svg", "worldloop/SVG-v0", "base", False, {"pixel_similarity": v, "similarity": v, "pixel_mae": 0.1})
             for v in (0.2, 0.4, 0.6, 0.8, 1.0)]
    # FrozenLake listed last but shown first, as in Table 2
    recs += [_rec("frozenlake", "worldloop/FrozenLake-v0", "4x4", s) for s in (True, False)]
    table = build_table(recs)
    labels = [c.label for c in table.cells]
    assert labels == ["FrozenLake", "Sokoban", "Navigation: base", "Navigation: common_sense", "Navigation: Average",
                      "SVG: pixel_similarity", "Overall"]
    cell = {c.label: c for c in table.cells}
    assert cell["Sokoban"].value == 0.75 and cell["Sokoban"].n == 4
    assert (cell["Sokoban"].low, cell["Sokoban"].high) == pytest.approx(wilson_interval(3, 4))
    assert cell["Navigation: Average"].value == pytest.approx((1.0 + 0.5) / 2)
    # the average's interval: se_i = Wilson half width / z; mean +- z * sqrt(se_1^2 + se_2^2) / 2
    se = [(hi - lo) / (2 * Z95) for lo, hi in (wilson_interval(2, 2), wilson_interval(1, 2))]
    half = Z95 * math.sqrt(se[0] ** 2 + se[1] ** 2) / 2
    assert cell["Navigation: Average"].low == pytest.approx(max(0.0, 0.75 - half))
    assert cell["Navigation: Average"].high == pytest.approx(min(1.0, 0.75 + half))
    assert cell["SVG: pixel_similarity"].value == pytest.approx(0.6)
    assert cell["SVG: pixel_similarity"].high == pytest.approx(0.6 + 0.392642, abs=1e-5)
    # Overall = mean of the task values (FrozenLake 0.5, Sokoban 0.75, Navigation 0.75, SVG 0.6)
    assert cell["Overall"].value == pytest.approx((0.5 + 0.75 + 0.75 + 0.6) / 4)
    assert cell["Overall"].n == 2 + 4 + 4 + 5
    assert table.errors == {"sokoban": 1} and table.error_reasons == {"http_500": 1}

    text = table.render_text("title")
    assert "PrimitiveSkill" not in text and "pixel_similarity" in text and "not DreamSim or DINO" in text
    assert "1 episode(s) failed" in text and "http_500" in text
    md = table.render_markdown("t", "my-model")
    assert "| my-model | 0.50 | 0.75 | 1.00 | 0.50 | 0.75 | 0.60 |" in md
    rows = list(csv.DictReader(io.StringIO(table.render_csv("my-model"))))
    assert [r["kind"] for r in rows] == ["success", "success", "success", "success", "average", "similarity", "overall"]
    assert rows[1]["n"] == "4" and float(rows[1]["value"]) == 0.75


def test_table_family_with_only_errors_and_duplicate_task_labels() -> None:
    recs = [_rec("taxi", "worldloop/Taxi-v0", "5x5", False, error="timeout")]
    # the same task label from two presets of one env stays apart
    recs += [_rec("a", "worldloop/Maze-v0", "11x11", True), _rec("b", "worldloop/Maze-v0", "11x11", False)]
    table = build_table(recs)
    cell = {c.label: c for c in table.cells}
    assert cell["Taxi"].value is None and cell["Taxi"].n == 0
    assert cell["Maze: a:11x11"].value == 1.0 and cell["Maze: b:11x11"].value == 0.0
    assert cell["Overall"].value is None  # a task without episodes leaves the overall undefined
    assert "-" in table.render_text()
