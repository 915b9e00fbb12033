"""The chaos soak's output (``bench/chaos.py``): the table and the last line, from its accounting,
and each fault's recovery time."""

from __future__ import annotations

import json


def last_line(res: dict) -> str:
    return (f"chaos: produced {res['produced']}, trained once {res['trained_once']}, trained twice "
            f"{res['trained_twice']}, lost {res['lost']}, lost in host crashes (allowed) {res['lost_in_crashes']}, "
            f"lost with torn checkpoints (allowed) {res.get('lost_with_torn', 0)}, "
            f"dropped {sum(res['dropped'].values())} (stale {stale_percent(res):.1f} %), "
            f"dead-lettered {res['dead_lettered']}, queued {res['queued']}")


def verdict(res: dict) -> str:
    """What the soak must hold: no exit it did not cause, nothing trained twice, no good entry
    dead-lettered (only poison and malformed entries may be), nothing lost beyond what is allowed."""
    exits = sum(len(v) for v in res["unexpected_exits"].values())
    return (f"verdict: unexpected exits {exits}, trained twice {res['trained_twice']}, good entries dead-lettered "
            f"{res['dead_lettered']}, lost {res['lost']}")


def stale_percent(res: dict) -> float:
    return 100.0 * res["dropped"].get("stale", 0) / max(1, res["produced"])


def report(res: dict, kinds: tuple[str, ...]) -> str:
    rows = ["| fault | n | targets | recovery s (until the next trained step) |", "|---|---|---|---|"]
    for kind in kinds:
        fs = [f for f in res["faults"] if f["kind"] == kind]
        rec = ", ".join("-" if f["recovery_s"] is None else f"{f['recovery_s']:.0f}" for f in fs)
        targets = ", ".join(f"{f['target'] or '-'}{' (' + f['note'] + ')' if f['note'] else ''}" for f in fs)
        rows.append(f"| {kind} | {len(fs)} | {targets} | {rec} |")
    drop = ", ".join(f"{k} {v}" for k, v in sorted(res["dropped"].items())) or "0"
    rows += ["", "| trajectories | n |", "|---|---|",
             f"| produced (actors' logs; + unlogged: killed between XADD and log line) | {res['produced']} "
             f"(unlogged {res['unlogged']}) |",
             f"| trained once | {res['trained_once']} |", f"| trained twice | {res['trained_twice']} |",
             f"| lost | {res['lost']} |",
             f"| lost in host crashes (logged in the cut second: {res['crash_window_ids']}; allowed by appendfsync "
             f"everysec) | {res['lost_in_crashes']} |",
             f"| lost with torn checkpoints (acked with the damaged checkpoint) | {res.get('lost_with_torn', 0)} |",
             f"| dropped | {drop} (stale {stale_percent(res):.1f} % of produced) |",
             f"| dead-lettered | {res['dead_lettered']} |", f"| queued | {res['queued']} |",
             "", f"learner steps {res['steps']} (ledger gaps: {res['ledger_gaps'] or 'none'}); malformed entries "
             f"injected {res['malformed_injected']}, dead-lettered {res['malformed_dead_lettered']}; other dead "
             f"letters {res['other_dead_letters']}",
             f"poison entries injected {res['poison_injected']}, dead-lettered {res['poison_dead_lettered']} "
             f"(judges they killed: {res['poison_judge_exits']}); second learners started {res['second_learners']}, "
             f"refused {res['second_learners_refused']}; refused-write log lines (OOM etc.) {res['refused_write_lines']}; "
             f"host-crash AOF cuts {res['crash_cuts']}",
             f"run-wide counters: {json.dumps(res['stats'])}",
             f"exits not caused by the soak: {json.dumps(res['unexpected_exits']) if res['unexpected_exits'] else 'none'}",
             f"torn checkpoints: {json.dumps([{k: v for k, v in t.items() if k != 'ids'} for t in res.get('torn', [])])}",
             ]
    if res["lost_ids"]:
        rows.append(f"lost ids: {res['lost_ids'][:20]}")
    if res["twice_ids"]:
        rows.append(f"trained twice ids: {res['twice_ids'][:20]}")
    return "\n".join(rows + ["", verdict(res)])


def recovery(faults: list, steps: list[dict]) -> None:
    """Each fault's recovery time: until the first step trained after it."""
    times = sorted(float(s["time"]) for s in steps)
    for f in faults:
        after = [t for t in times if t > f.at_wall]
        f.recovery_s = (after[0] - f.at_wall) if after else None
