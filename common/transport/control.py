"""The control record the learner publishes to actors, process heartbeats and run counters, in
Redis under the key names of :mod:`worldloop.common.contracts.keys`."""

from __future__ import annotations

import json
import os
import socket
import time

from worldloop.common.contracts.keys import RUN_STATES, Keys
from worldloop.common.metrics import metrics_url


def read_control(r, keys: Keys) -> dict:
    """The control record as typed values (defaults when the learner has not written it yet)."""
    raw = r.hgetall(keys.control) or {}
    d = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v) for k, v in raw.items()}
    return {
        "policy_version": int(d.get("policy_version", 0)),
        "max_turns": int(d["max_turns"]) if "max_turns" in d else None,
        "run_state": d.get("run_state", "running"),
        "updated_at": float(d.get("updated_at", 0.0)),
        # when the run stopped under worldloop up's time budget: by when (time.time()) the final
        # held-out evaluation should end; 0 = no deadline (learner/trackers.py final_eval_deadline)
        "final_eval_by": float(d.get("final_eval_by") or 0.0),
    }


def control_fields(**fields) -> dict[str, str]:
    """The control record's fields as written (checked, stringified, stamped ``updated_at``)."""
    for k, v in fields.items():
        if k == "run_state" and v not in RUN_STATES:
            raise ValueError(f"run_state must be one of {RUN_STATES}, got {v!r}")
    mapping = {k: str(v) for k, v in fields.items() if v is not None}
    mapping["updated_at"] = str(time.time())
    return mapping


def write_control(r, keys: Keys, **fields) -> None:
    r.hset(keys.control, mapping=control_fields(**fields))


def register_process(r, keys: Keys, role: str, proc_id: str, metrics_port: int | None, host: str = "127.0.0.1",
                     extra: dict | None = None, cpu_s: float | None = None) -> None:
    """Heartbeat: record that this process is alive, where its /metrics is and its CPU seconds so far
    (``cpu_s``, every thread, or what the caller counts instead, e.g. an inference server's engine and
    workers too; the run's evaluator sums them to keep to its CPU share) (call every few seconds);
    ``extra`` adds fields such as the process's current ``phase`` (see ``common/transport/process.py``)."""
    info = {
        **(extra or {}),
        "role": role,
        "id": proc_id,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "metrics_url": metrics_url(host, metrics_port) if metrics_port else None,
        "cpu_s": round(time.process_time() if cpu_s is None else float(cpu_s), 3),
        "seen_at": time.time(),
    }
    r.hset(keys.procs, f"{role}:{proc_id}", json.dumps(info))


def list_processes(r, keys: Keys) -> list[dict]:
    out = []
    for _, v in (r.hgetall(keys.procs) or {}).items():
        try:
            out.append(json.loads(v))
        except (ValueError, TypeError, RecursionError):
            continue
    return sorted(out, key=lambda d: (d.get("role", ""), d.get("id", "")))


def default_proc_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def stats_incr(r, keys: Keys, name: str, n: int = 1) -> int:
    """Add ``n`` to the run-wide counter ``name`` (HINCRBY ``{ns}:stats``); return the new value.

    Judges and the learner count failures here (e.g. ``judge_failures``, ``judge_fallbacks``,
    ``learner_dropped_stale``) so that ``worldloop status`` can show them for the whole run.
    """
    return int(r.hincrby(keys.stats, name, int(n)))


def read_stats(r, keys: Keys) -> dict[str, int]:
    """Every run-wide counter as ``{name: value}`` (empty when none was counted yet)."""
    out: dict[str, int] = {}
    for k, v in (r.hgetall(keys.stats) or {}).items():
        name = k.decode(errors="replace") if isinstance(k, bytes) else str(k)
        try:
            out[name] = int(v)
        except (TypeError, ValueError):
            continue
    return dict(sorted(out.items()))
