"""Score an outlook reasoning: what the agent says each move runs into, against the env's own outlook.

Public API::

    outlook_cells(text) -> dict[str, str]          # {"left": "ice", "down-left": "hole", ...}
    outlook_score(said, truth) -> float | None     # share of the truth's cells said right

An outlook (the env's ``move_outlook()``, FrozenLake) is a list of ``Name word`` items separated by
commas, semicolons or a full stop: ``"Left ice, Down hole, Right edge, Up goal; Down-left ice, ..."``.
The truth comes from the turn's ``state_before.outlook``; the agent's text is its ``<reasoning>``.

Scoring: the truth's cells are the keys of ``outlook_cells(truth)``; the score is the share of them
whose name the agent's text gives the same word. An item of the agent's that names a cell twice
counts by its first mention, so listing both words never earns the cell; items the truth has no cell
for earn nothing and cost nothing. Case and spacing do not matter; the order of the items does not
either. A missing or empty text scores 0.0; a truth with no cell (or none at all) gives None: the
turn has nothing to be scored on.
"""
from __future__ import annotations

import re

_ITEM = re.compile(r"^([a-z]+(?:-[a-z]+)?)\s+([a-z]+)$")
_SPLIT = re.compile(r"[,;.\n]")


def outlook_cells(text: str | None) -> dict[str, str]:
    """``{name: word}`` of every ``Name word`` item in ``text``, lower case, the first mention of a name."""
    cells: dict[str, str] = {}
    if not isinstance(text, str):
        return cells
    for item in _SPLIT.split(text.lower()):
        m = _ITEM.match(" ".join(item.split()))
        if m is not None and m.group(1) not in cells:
            cells[m.group(1)] = m.group(2)
    return cells


def outlook_score(said: str | None, truth: str | None) -> float | None:
    """The share of ``truth``'s cells that ``said`` names right (module docstring); None when the truth
    has no cell."""
    want = outlook_cells(truth)
    if not want:
        return None
    got = outlook_cells(said)
    return sum(got.get(name) == word for name, word in want.items()) / len(want)
