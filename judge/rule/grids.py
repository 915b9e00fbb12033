"""Symbolic grids stated in free text: the longest block of text lines as wide as the truth's grid,
as (row, column, symbol) cells (untrusted text; nothing here raises on any text).

A grid's rows keep their spaces only where they need them to line up (Taxi's wide cells); where
spaces only separate symbols (Maze's "P o *") they are dropped, in the truth and the text alike.

Public API::

    keeps_spaces(symbolic) -> bool    grid_rows(symbolic) -> list[str]
    grid_block(text, symbolic) -> list[str] | None
    grid_items(text, symbolic, background) -> list[Item]
"""
from __future__ import annotations

import re
from typing import Iterable

from worldloop.judge.rule.f1 import Item


def _norm_row(line: str, keep_spaces: bool) -> str:
    row = line.expandtabs().strip().strip("`").strip()
    return row if keep_spaces else row.replace(" ", "")


def keeps_spaces(symbolic: str) -> bool:
    """Grids whose rows only line up with their spaces (Taxi's wide cells) are compared with them;
    grids whose spaces only separate symbols (Maze's "P o *") without."""
    lines = [ln for ln in symbolic.splitlines() if ln.strip()]
    if len({len(_norm_row(ln, False)) for ln in lines}) <= 1:
        return False
    return len({len(_norm_row(ln, True)) for ln in lines}) == 1


def _grid_rows(s: str, keep_spaces: bool) -> list[str]:
    return [_norm_row(ln, keep_spaces) for ln in s.splitlines() if ln.strip()]


def _grid_like(line: str) -> bool:
    return not re.search(r"[A-Za-z]{2,}\s+[A-Za-z]{2,}", line) and not line.strip().endswith(":")


def grid_block(text: str, symbolic: str) -> list[str] | None:
    """The longest run of consecutive text lines as wide as the truth grid."""
    keep = keeps_spaces(symbolic)
    truth_rows = _grid_rows(symbolic, keep)
    if not truth_rows:
        return None
    width = max(len(r) for r in truth_rows)
    charset = set("".join(truth_rows))
    best: list[str] = []
    run: list[str] = []
    for line in text.splitlines():
        row = _norm_row(line, keep)
        if len(row) == width and _grid_like(line) and sum(ch in charset for ch in row) >= 0.5 * width:
            run.append(row)
            if len(run) > len(best):
                best = list(run)
        else:
            run = []
    need = 2 if len(truth_rows) >= 2 else 1
    return best[: len(truth_rows)] if len(best) >= need else None


def grid_rows(symbolic: str) -> list[str]:
    """The rows of a grid (spaces kept only where the rows need them to line up)."""
    return _grid_rows(symbolic, keeps_spaces(symbolic))


def grid_items(text: str, symbolic: str, background: Iterable[str]) -> list[Item]:
    """The (row, column, symbol) cells of the grid block of ``text`` (see :func:`grid_block`),
    ``background`` symbols (walls, floor) left out."""
    skip = set(background)
    block = grid_block(text, symbolic) or []
    return [frozenset([(r, c, ch)]) for r, row in enumerate(block) for c, ch in enumerate(row) if ch not in skip]
