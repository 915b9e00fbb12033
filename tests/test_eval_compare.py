"""worldloop.eval.compare: the paired comparison of two eval outputs, counted by hand."""

from __future__ import annotations

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
