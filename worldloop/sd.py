"""``worldloop sd``: Prometheus ``file_sd`` targets from the processes' heartbeats.

Every learner, actor and judge records a heartbeat in Redis (``{<namespace>}:procs``, see
:func:`worldloop.common.transport.control.register_process`) with the URL of its ``/metrics``. This command
turns the live ones into a Prometheus file-based service discovery file, so a Prometheus with

    scrape_configs:
      - job_name: worldloop
        file_sd_configs: [{files: [/var/lib/worldloop/targets.json]}]

scrapes every process of the run wherever it started, actors on other machines included (they
bind ``metrics.host=0.0.0.0`` and advertise their primary address). Each target is labelled
``role``, ``namespace``, ``host`` (the machine's name) and ``process_id``. A process whose last
heartbeat is older than ``--timeout`` seconds is dropped. The file is replaced atomically (a temporary
file beside it, then rename), so Prometheus never reads half of it.

    worldloop sd --config C --out targets.json                 write once
    worldloop sd --config C --out targets.json --interval 10   keep refreshing until stopped
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from worldloop.common.contracts.config import Config, ConfigError
from worldloop.common.transport.control import list_processes
from worldloop.common.contracts.keys import Keys

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0  # heartbeats come every 2 s


def targets(processes: list[dict], namespace: str, now: float, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[dict]:
    """``file_sd`` target groups (one per live process with a /metrics URL), sorted by role and id."""
    groups = []
    for p in processes:
        url = p.get("metrics_url")
        seen = p.get("seen_at")
        if not url or not isinstance(seen, (int, float)) or now - seen > timeout_s:
            continue
        parts = urlsplit(url)
        if not parts.hostname or not parts.port:
            continue
        groups.append({
            "targets": [parts.netloc],
            "labels": {
                "role": str(p.get("role", "")),
                "namespace": namespace,
                "host": str(p.get("host", "")),
                "process_id": str(p.get("id", "")),
                **({"__metrics_path__": parts.path} if parts.path not in ("", "/metrics") else {}),
            },
        })
    return sorted(groups, key=lambda g: (g["labels"]["role"], g["labels"]["process_id"], g["targets"][0]))


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` in one rename (readers see the old or the new file, never half)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; the Prometheus user must read it
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_targets(r, cfg: Config, out: Path, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[dict]:
    groups = targets(list_processes(r, Keys(cfg.redis.namespace)), cfg.redis.namespace, time.time(), timeout_s)
    write_atomic(out, json.dumps(groups, indent=2) + "\n")
    return groups


def run(cfg: Config, args: argparse.Namespace) -> int:
    if not cfg.redis.url:
        raise ConfigError("redis.url", "worldloop sd reads the heartbeats from the run's Redis (redis://host:port/db)")
    out = args.out
    interval = getattr(args, "interval", None)
    timeout_s = getattr(args, "timeout", None) or DEFAULT_TIMEOUT_S
    if (interval is not None and interval <= 0) or timeout_s <= 0:
        print("worldloop sd: --interval and --timeout must be > 0 seconds", file=sys.stderr)
        return 2
    from worldloop.common.transport.streams import connect

    r = connect(cfg.redis.url, cfg.redis.socket_timeout_s)
    if interval is None:
        groups = write_targets(r, cfg, Path(out), timeout_s)
        log.info("wrote %d targets to %s", len(groups), out)
        return 0
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    last = None
    while not stop.is_set():
        try:
            groups = write_targets(r, cfg, Path(out), timeout_s)
            now = [g["targets"][0] for g in groups]
            if now != last:
                log.info("%d targets in %s: %s", len(now), out, ", ".join(now) or "none")
                last = now
        except Exception as e:  # Redis restarting: keep the last file, retry on the next tick
            log.warning("cannot refresh %s: %s", out, e)
        stop.wait(interval)
    return 0
