"""worldloop.eval.compare: the paired comparison of two eval outputs, counted by hand."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from worldloop.eval.compare import main, outcomes, paired


def _write(path: Path, rows: list[tuple[str, int, bool, str | None]]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "episodes.jsonl", "w") as f:
        for env, seed, success, error in rows:
            f.write(json.dumps({"env": env, "seed": seed, "success": success, "error": error}) + "\n")
    return path


def _bench_ablation():
    """``bench/ablation.py`` as a module (bench/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("bench_ablation", Path(__file__).resolve().parent.parent / "bench" / "ablation.py")
    ablation = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ablation)
    return ablation


def test_paired_counts_and_sign_test_by_hand(tmp_path: Path, capsys) -> None:
    base = _write(tmp_path / "base", [("sokoban", 1, True, None), ("sokoban", 2, False, None), ("sokoban", 3, False, None),
                                      ("sokoban", 4, True, None), ("sokoban", 5, False, "env_error"),
                                      ("frozenlake", 1, False, None), ("sokoban", 6, False, None)])
    new = _write(tmp_path / "new", [("sokoban", 1, True, None), ("sokoban", 2, True, None), ("sokoban", 3, True, None),
                                    ("sokoban", 4, False, None), ("sokoban", 5, True, None),
                                    ("frozenlake", 1, True, None),
                                    # an episode recorded with an error, then replayed: the newer line wins
                                    ("sokoban", 6, True, "env_error"), ("sokoban", 6, True, None),
                                    ("sokoban", 99, True, None)])
    a, b = outcomes(base), outcomes(new / "episodes.jsonl")
    assert (("sokoban", 5) not in a) and b[("sokoban", 6)] is True
    r = paired(a, b)
    # shared without an error: sokoban 1, 2, 3, 4, 6 and frozenlake 1 (sokoban 5 errored in base, 99 only in new)
    assert r.n == 6
    assert (r.base_solved, r.new_solved) == (2, 5)
    assert (r.wins, r.losses) == (4, 1)  # sokoban 2, 3, 6, frozenlake 1 / sokoban 4
    # sign test: 2 * (C(5,0) + C(5,1)) / 2^5 = 12 / 32
    assert r.p == pytest.approx(0.375)
    assert r.rate("base") == pytest.approx(2 / 6) and r.rate("new") == pytest.approx(5 / 6)
    assert main([str(base), str(new), "--label", "x"]) == 0
    out = capsys.readouterr().out
    assert "| x | 6 | 0.333 [" in out and "| +0.500 | 4 / 1 | 0.375 |" in out


def test_compare_says_what_is_wrong(tmp_path: Path, capsys) -> None:
    a = _write(tmp_path / "a", [("sokoban", 1, True, None)])
    b = _write(tmp_path / "b", [("sokoban", 2, True, None)])
    assert main([str(a), str(b)]) == 2
    assert "share no (env, seed)" in capsys.readouterr().err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "episodes.jsonl").write_text('{"env": "sokoban"}\n')
    assert main([str(a), str(tmp_path / "bad")]) == 2
    assert "episodes.jsonl:1: not an episode record" in capsys.readouterr().err
    assert main([str(a), str(tmp_path / "missing")]) == 2


def test_ablation_pairs_two_arms_per_run_seed_and_pools_without_merging_seeds() -> None:
    """bench/ablation.py --paired: each run seed's rows, then the pooled row over (env, run seed,
    held-out seed), where held-out seed 1 of run seed 0 and of run seed 1 are two pairs, not one."""
    ablation = _bench_ablation()
    per_seed = {("frozenlake", 0): ({("FrozenLake", 1): True, ("FrozenLake", 2): False},
                                    {("FrozenLake", 1): False, ("FrozenLake", 2): True}),
                ("frozenlake", 1): ({("FrozenLake", 1): False, ("FrozenLake", 2): False},
                                    {("FrozenLake", 1): True, ("FrozenLake", 2): True})}
    rows = ablation.paired_report("VAGEN-Base", "VAGEN-Full", per_seed).splitlines()
    seed0, seed1, pooled = rows[-3:]
    # seed 0: one seed each way (p 1); seed 1: two only-new, none only-base (p 2 x 1/4 = 0.5)
    assert seed0.startswith("| FrozenLake, run seed 0 | 2 | 0.500") and "| 1 / 1 | 1.000 |" in seed0
    assert seed1.startswith("| FrozenLake, run seed 1 | 2 | 0.000") and "| 2 / 0 | 0.500 |" in seed1
    # pooled: 4 pairs, base solved 1, new 3; 3 only-new against 1 only-base: p = 2 x (4 + 1) / 16
    assert pooled.startswith("| pooled | 4 | 0.250") and "| 0.750 [" in pooled and "| 3 / 1 | 0.625 |" in pooled


def test_ablation_pairs_each_arm_with_the_warm_start_it_began_from() -> None:
    """bench/ablation.py --paired with --warm-start shipped: one row per (arm, env, run seed), each
    paired with that env's warm start on the seeds both played."""
    ablation = _bench_ablation()
    start = {("FrozenLake", s): s < 2 for s in range(4)}  # the warm start solves seeds 0 and 1
    finals = {("VAGEN-Base", "frozenlake", 0): {("FrozenLake", s): True for s in range(4)},
              ("VAGEN-Full", "frozenlake", 0): {("FrozenLake", s): s in (1, 2) for s in range(4)},
              ("VAGEN-Full", "frozenlake", 1): {("FrozenLake", s): s == 0 for s in range(3)}}  # seed 3 not played
    rows = ablation.start_report({"frozenlake": start}, finals).splitlines()[-3:]
    # Base solves all 4: 2 only-new, 0 only-base, p = 2 x 1/4
    assert rows[0].startswith("| VAGEN-Base, FrozenLake, run seed 0 | 4 | 0.500") and "| +0.500 | 2 / 0 | 0.500 |" in rows[0]
    # Full seed 0 solves 1 and 2: seed 2 only-new, seed 0 only-base, p 1
    assert rows[1].startswith("| VAGEN-Full, FrozenLake, run seed 0 | 4 | 0.500") and "| +0.000 | 1 / 1 | 1.000 |" in rows[1]
    # Full seed 1 played seeds 0-2: 3 pairs, the start solves 2 of them, Full 1; seed 1 only-base, p 1
    assert rows[2].startswith("| VAGEN-Full, FrozenLake, run seed 1 | 3 | 0.667") and "| -0.333 | 0 / 1 | 1.000 |" in rows[2]
