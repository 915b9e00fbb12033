"""The scaffold every long-running role process (actor, judge, learner rank 0) stands on.

    scaffold = ProcessScaffold(cfg, "judge", proc_id)
    with scaffold:                      # signals, /metrics, heartbeat and control polling start here
        scaffold.ready()                # from now on SIGTERM/SIGINT ask for a clean stop
        while not scaffold.should_stop():
            if scaffold.paused: ...
            scaffold.set_phase("scoring")
    # threads stopped, signal handlers restored

What it owns, once for all roles:

* **stop**: ``scaffold.stop`` (a ``threading.Event``) is set by SIGTERM/SIGINT (main thread only),
  by :meth:`request_stop`, and seen through :meth:`should_stop`, which is also true once the
  control record says ``stopped``. Before :meth:`ready` a signal raises ``KeyboardInterrupt``
  instead, so a Ctrl-C during minutes of model loading or engine start-up ends the process at once.
* **metrics**: ``/metrics`` on ``metrics.host``/``metrics.port`` (port 0: ephemeral), kept in
  ``scaffold.metrics_port``.
* **heartbeat**: every ``HEARTBEAT_S`` the process's entry in ``{ns}:procs`` (role, id, host, pid,
  metrics URL) plus its ``phase`` (what it is doing or waiting on) and ``phase_since``, so that
  ``worldloop up`` and ``worldloop status`` can say where a process that makes no progress is
  waiting. Its own Redis connection; a failed beat is logged and retried, never fatal.
* **control**: the control record (policy version, ``max_turns``, ``run_state``) read every
  ``CONTROL_POLL_S`` on a thread of its own into ``scaffold.control``; the last record read is kept
  while Redis is away.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any, Callable

from worldloop.common.contracts.config import Config
from worldloop.common.transport.control import read_control, register_process
from worldloop.common.contracts.keys import Keys
from worldloop.common.metrics import serve_metrics
from worldloop.common.transport.key_migration import migrate_legacy_keys
from worldloop.common.transport.redis_link import RedisLink, connect

log = logging.getLogger(__name__)

HEARTBEAT_S = 2.0
CONTROL_POLL_S = 0.5


class ProcessScaffold:
    def __init__(self, cfg: Config, role: str, proc_id: str, *, stop_message: str = "stopping cleanly",
                 poll_control: bool = True, services: bool = True, install_signals: bool = True,
                 migrate_keys: bool = True, cpu_seconds: Callable[[], float] | None = None):
        self.cfg = cfg
        self.role = role
        self.proc_id = proc_id
        self.keys = Keys(cfg.redis.namespace)
        self.stop = threading.Event()
        self.stop_message = stop_message
        self.poll_control = poll_control
        self.services = services  # False (e.g. learner ranks > 0): signals only, no metrics/heartbeat/control
        self.install_signals = install_signals
        self.migrate_keys = migrate_keys  # rename the run's pre-hash-tag keys first (common/transport/key_migration.py)
        self.cpu_seconds = cpu_seconds  # the heartbeat's cpu_s (None: this process's own, time.process_time())
        self.metrics_port: int | None = None
        self.control: dict[str, Any] = {"policy_version": 0, "max_turns": None, "run_state": "running", "updated_at": 0.0,
                                        "final_eval_by": 0.0}
        self.control_read_at = 0.0  # monotonic time of the last successful read (0: never)
        self.phase = "starting"
        self.phase_since = time.time()
        self.extra: dict[str, Any] = {"started_at": time.time()}
        self._ready = False
        self._closing = threading.Event()
        self._threads: list[threading.Thread] = []
        self._previous_handlers: dict[int, Any] = {}

    # ------------------------------------------------------------------ life cycle

    def __enter__(self) -> "ProcessScaffold":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        if self.install_signals:
            self._install_signals()
        if not self.services:
            return
        if self.migrate_keys and self.cfg.redis.url:
            self._migrate_keys()
        if self.cfg.metrics.enabled:
            self.metrics_port = serve_metrics(self.role, self.cfg.metrics.host, self.cfg.metrics.port)
        self._spawn(self._heartbeat_loop, "heartbeat")
        if self.poll_control:
            self._spawn(self._control_loop, "control")

    def ready(self) -> None:
        """Start-up is over: signals now ask for a clean stop instead of interrupting."""
        self._ready = True

    def close(self) -> None:
        self.stop.set()
        self._closing.set()
        for t in self._threads:
            t.join(timeout=HEARTBEAT_S + 1)
        self._threads.clear()
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers.clear()

    # ------------------------------------------------------------------ state

    def request_stop(self, why: str = "") -> None:
        if not self.stop.is_set() and why:
            log.info("%s %s: %s; %s", self.role, self.proc_id, why, self.stop_message)
        self.stop.set()

    @property
    def run_state(self) -> str:
        return str(self.control.get("run_state", "running"))

    @property
    def paused(self) -> bool:
        return self.run_state == "paused"

    def should_stop(self) -> bool:
        if not self.stop.is_set() and self.run_state == "stopped":
            self.request_stop("run_state is stopped (control record)")
        return self.stop.is_set()

    def set_phase(self, phase: str, **extra: Any) -> None:
        """What the process is doing now (shown by ``worldloop up``/``status``); cheap, call freely."""
        if phase != self.phase:
            self.phase, self.phase_since = phase, time.time()
        self.extra.update(extra)

    def refresh_control(self, r) -> dict:
        """Read the control record now (callers that need it fresher than the poller's)."""
        self.control = read_control(r, self.keys)
        self.control_read_at = time.monotonic()
        return self.control

    def _migrate_keys(self) -> None:
        """Rename the run's keys from their names before the hash tag, before this role uses them
        (waits for Redis like every link: ``RedisUnreachable`` after ``redis.startup_timeout_s``)."""
        r = self.cfg.redis
        link = RedisLink(r.url, self.keys.control, r.reconnect_max_s, r.socket_timeout_s, should_stop=self.stop.is_set,
                         startup_timeout_s=r.startup_timeout_s)
        try:
            link.call(lambda c: migrate_legacy_keys(c, self.keys))
        finally:
            link.close()

    # ------------------------------------------------------------------ threads

    def _spawn(self, target, name: str) -> None:
        t = threading.Thread(target=target, name=f"{self.role}-{name}", daemon=True)
        t.start()
        self._threads.append(t)

    def _heartbeat_loop(self) -> None:
        r = None
        while True:
            try:
                r = r or connect(self.cfg.redis.url, self.cfg.redis.socket_timeout_s)
                register_process(r, self.keys, self.role, self.proc_id, self.metrics_port, host=self.cfg.metrics.host,
                                 extra={"phase": self.phase, "phase_since": self.phase_since, **self.extra},
                                 cpu_s=None if self.cpu_seconds is None else self.cpu_seconds())
            except Exception as e:  # a heartbeat never takes the process down; Redis may be restarting
                log.debug("%s %s: heartbeat failed: %s", self.role, self.proc_id, e)
                r = None
            if self._closing.wait(HEARTBEAT_S):
                break
        if r is not None:
            r.close()

    def _control_loop(self) -> None:
        r = None
        while not self._closing.is_set():
            try:
                r = r or connect(self.cfg.redis.url, self.cfg.redis.socket_timeout_s)
                self.refresh_control(r)
            except Exception as e:  # keep the last record while Redis is away
                log.debug("%s %s: control read failed: %s", self.role, self.proc_id, e)
                r = None
            self._closing.wait(CONTROL_POLL_S)
        if r is not None:
            r.close()

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, _frame):
            if not self._ready:
                raise KeyboardInterrupt(f"signal {signum} during start-up")
            self.request_stop(f"signal {signum}")

        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous_handlers[sig] = signal.signal(sig, handler)
