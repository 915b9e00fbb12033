"""The chaos soak's learner faults of issue 38 (``bench/chaos.py`` dispatches to these) and the part
of the accounting they need.

* ``learner_crash_loop``: the learner killed (-9) :data:`CRASH_LOOP_KILLS` times in a row, each
  time right after its restart took back the entries its predecessor left pending (the log's
  "recovered N entries"), so the loop fits in one checkpoint interval. A restart must not count
  a delivery against every pending entry: good entries dead-lettered by restarts alone are a
  finding (``good entries dead-lettered`` in the report).
* ``torn_checkpoint``: once the run has two checkpoints (waited for, bounded), the learner killed,
  then a DeepSpeed file of its newest checkpoint cut to
  half its size (as a disk that lost writes would leave it); the restarted learner (``--resume``)
  must skip it, saying why, and resume from the checkpoint before. The updates between the two
  were acked with the damaged checkpoint: their trajectories are lost with it (documented in
  docs/operations.md), and are counted apart from other losses.

Accounting: :func:`surviving_ledger` is the learner's lineage, for each step its last line, up to
the step of the final checkpoint (lines of steps past it belong to a lineage a fall-back dropped).
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

from _chaos_faults import _learner
from _records import jsonl_records

CRASH_LOOP_KILLS = 6
RECOVERED_WAIT_S = 240.0  # a restarted learner builds its models, then recovers: bounded per kill
TWO_CHECKPOINTS_WAIT_S = 240.0  # torn_checkpoint waits for a checkpoint to fall back to
BOUND_S = CRASH_LOOP_KILLS * (180 + RECOVERED_WAIT_S) + TWO_CHECKPOINTS_WAIT_S + 180  # both faults (chaos.wall_bound_s)
_RECOVERED = re.compile(r"recovered \d+ entries a previous learner process left pending|^.*step \d+/\d+ v\d+", re.M)


def learner_crash_loop(c, f) -> None:
    kills, recovered = 0, 0
    ckpts = c.run_dir / "checkpoints"
    before = {q.name for q in ckpts.glob("step_*")}
    for _ in range(CRASH_LOOP_KILLS):
        p = _learner(c)
        if p is None:
            break
        pid = p.popen.pid
        deadline = time.monotonic() + RECOVERED_WAIT_S
        while time.monotonic() < deadline and p.alive and p.popen.pid == pid and not _RECOVERED.search(p.this_life()):
            c.wait(0.2)
        recovered += bool(_RECOVERED.search(p.this_life()))
        if p.signal(signal.SIGKILL):
            kills += 1
        c.wait(0.5)  # the supervisor restarts it (with --resume)
    new = sorted({q.name for q in ckpts.glob("step_*")} - before)
    f.target = "learner" if kills else ""
    f.note = (f"killed {kills} times in a row ({recovered} after taking back its pending entries); "
              f"checkpoints written meanwhile: {new or 'none'}")


def torn_checkpoint(c, f) -> None:
    from worldloop.learner import checkpoint

    root = c.run_dir / "checkpoints"
    deadline = time.monotonic() + TWO_CHECKPOINTS_WAIT_S  # early in a soak there may be one checkpoint only
    while len(checkpoint._candidates(root)) < 2 and time.monotonic() < deadline:
        c.wait(1.0)
    p = _learner(c)
    if p is None:
        f.note = "no learner holding the lease"
        return
    p.signal(signal.SIGKILL)  # nothing writes the folder while it is torn; the supervisor restarts it
    p.popen.wait(30)
    found = checkpoint._candidates(root)
    if len(found) < 2:
        f.target, f.note = "learner", f"{len(found)} checkpoint(s): nothing to fall back to, not torn"
        return
    (newest, st), (_prev, prev_st) = found[0], found[1]
    shard = max(newest.glob("policy/ds/*model_states*"), key=lambda q: q.stat().st_size)
    size = shard.stat().st_size
    os.truncate(shard, size // 2)
    lost_steps = range(int(prev_st["step"]) + 1, int(st["step"]) + 1)
    ledger = _last_lines(c.run_dir / "learner_ledger.jsonl")
    c.torn.append({"checkpoint": newest.name, "falls_back_to": int(prev_st["step"]),
                   "ids": sorted(t for s in lost_steps for t in ledger.get(s, {}).get("trained", []))})
    f.target = "learner"
    f.note = (f"{newest.name}/{shard.relative_to(newest)} cut {size} -> {size // 2} bytes; resume falls back "
              f"to step {prev_st['step']}")


def _last_lines(path: Path) -> dict[int, dict]:
    by_step: dict[int, dict] = {}
    for line in jsonl_records(path):
        if "step" in line:
            by_step[int(line["step"])] = line  # the last line of a step wins
    return by_step


def surviving_ledger(run_dir: Path) -> dict[int, dict]:
    """The learner's lineage: for each step its last line, up to the final checkpoint's step."""
    from worldloop.learner import checkpoint

    by_step = _last_lines(run_dir / "learner_ledger.jsonl")
    final = checkpoint.latest(run_dir / "checkpoints", verify_files=False) if (run_dir / "checkpoints").is_dir() else None
    if final is not None:
        end = int(checkpoint.read_state(final)["step"])
        by_step = {s: x for s, x in by_step.items() if s <= end}
    return by_step


def torn_losses(c) -> set[str]:
    """Trajectories trained in the updates that a torn checkpoint took with it (acked with it)."""
    return {t for rec in c.torn for t in rec["ids"]}


KINDS = {"learner_crash_loop": learner_crash_loop, "torn_checkpoint": torn_checkpoint}
