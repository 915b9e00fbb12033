"""The cores this process may run on: what ``worldloop up`` divides among its children's torch threads
(``OMP_NUM_THREADS``), what the evaluator counts idle cores against, and what the final evaluation's
default process count is (``trainer.final_eval_processes: 0``)."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the platform has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
