"""``worldloop status``: one screen with the state of a run, read from its Redis.

Shows, for the rollouts / scored / dead-letter streams, the length, every
consumer group's pending count and lag and every consumer's idle time; the
control record (policy version, max_turns, run_state, age); the processes
that sent a heartbeat in the last :data:`SEEN_WINDOW_S` seconds; and the
run-wide counters of ``{ns}:stats`` (judge failures, fallbacks, learner drops).

Lag is XINFO's ``lag`` on Redis >= 7; on 6.2 it is ``length - pending``, which
is exact under the transport's ack-and-delete design (one group per stream).
"""

from __future__ import annotations

import argparse
import sys
import time

import redis

from worldloop.common.contracts.config import Config
from worldloop.common.contracts.keys import Keys
from worldloop.common.transport.control import list_processes, read_control, read_stats
from worldloop.common.transport.key_migration import legacy_keys_left
from worldloop.common.secrets import strip_password
from worldloop.common.transport.streams import connect, stream_info

SEEN_WINDOW_S = 60.0


def collect(r: redis.Redis, keys: Keys, now: float | None = None) -> dict:
    """Everything the status screen shows, as plain data."""
    now = time.time() if now is None else now
    procs = [p for p in list_processes(r, keys) if now - float(p.get("seen_at") or 0) <= SEEN_WINDOW_S]
    return {
        "namespace": keys.ns,
        "streams": [stream_info(r, s) for s in (keys.rollouts, keys.scored, keys.deadletter)],
        "control": read_control(r, keys),
        "processes": procs,
        "stats": read_stats(r, keys),
        "legacy": legacy_keys_left(r, keys),
        "now": now,
    }


def _age(now: float, t: float | None) -> str:
    return "never" if not t else f"{max(now - t, 0.0):.1f}s ago"


def render(info: dict) -> str:
    """The status screen as text."""
    now = info["now"]
    lines = [f"worldloop run '{info['namespace']}'", "", "streams:"]
    for s in info["streams"]:
        lines.append(f"  {s['stream']:<32} length {s['length']}")
        for g in s["groups"]:
            lines.append(f"    group {g['name']}: pending {g['pending']}, lag {g['lag']}")
            for c in g["consumers"]:
                lines.append(f"      consumer {c['name']}: pending {c['pending']}, idle {c['idle_ms'] / 1000:.1f}s")
    c = info["control"]
    lines += [
        "",
        "control:",
        f"  policy_version {c['policy_version']}, max_turns {c['max_turns'] if c['max_turns'] is not None else '-'}, "
        f"run_state {c['run_state']}, updated {_age(now, c['updated_at'])}",
        "",
        f"processes seen in the last {SEEN_WINDOW_S:.0f}s:",
    ]
    if not info["processes"]:
        lines.append("  (none)")
    for p in info["processes"]:
        lines.append(f"  {p.get('role', '?'):<8} {p.get('id', '?'):<28} host {p.get('host', '?')}, "
                     f"seen {_age(now, p.get('seen_at'))}, metrics {p.get('metrics_url') or '-'}")
        if p.get("phase"):  # what it is doing or waiting on, and since when (common/transport/process.py)
            lines.append(f"           {p['phase']} (for {_age(now, p.get('phase_since')).removesuffix(' ago')})")
    lines += ["", "counters:"]
    lines += [f"  {k}: {v}" for k, v in info["stats"].items()] or ["  (none)"]
    if info.get("legacy"):
        lines += ["", f"keys under their old names (before {{{info['namespace']}}}:...; the next role or `worldloop up` "
                      f"to start renames them): {', '.join(info['legacy'])}"]
    return "\n".join(lines)


def run(cfg: Config, args: argparse.Namespace | None = None) -> int:
    """Print the status of the run that ``cfg.redis`` names; 1 with a message when Redis is unusable."""
    url = cfg.redis.url
    if not url:
        print("worldloop status: redis.url is null; pass the run's Redis, e.g. redis.url=redis://host:6379/0",
              file=sys.stderr)
        return 1
    shown = strip_password(url)  # never print a password (user info or ?password=)
    try:
        r = connect(url, socket_timeout_s=min(cfg.redis.socket_timeout_s, 5.0))
        r.ping()
        info = collect(r, Keys(cfg.redis.namespace))
    except redis.RedisError as e:
        print(f"worldloop status: cannot read Redis at {shown}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(render(info))
    return 0
