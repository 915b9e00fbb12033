"""What the benches read back from a run directory: its JSON-lines files (``metrics.jsonl``,
``eval.jsonl``, ``learner_ledger.jsonl``), shared by ``bench/chaos.py`` and ``bench/async.py``."""

from __future__ import annotations

import json
from pathlib import Path


def jsonl_records(path: Path) -> list[dict]:
    """The JSON lines of ``path`` that parse (a killed writer's partial last line is skipped); [] if absent."""
    out = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out
