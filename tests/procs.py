"""Child ``worldloop`` processes for the tests, and waiting on them so that a failure explains itself.

Each child writes stdout and stderr to a log file (never a pipe that nobody drains while the test
polls). ``wait_for`` fails at once when a child exits, and on a timeout it asks every live child
for the stacks of all its threads (``worldloop`` installs a SIGUSR1 stack dump) before it fails,
so the assertion message carries the logs' tails and where each child was stuck.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class Child:
    """A ``python -m worldloop ARGS`` process whose output goes to ``log``."""

    def __init__(self, args: list[str], log: Path, env: dict | None = None, new_session: bool = False):
        self.args = list(args)
        self.log = Path(log)
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), **(env or {})}
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "worldloop", *self.args], cwd=ROOT, env=full_env,
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=new_session)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def output(self, tail: int | None = 4000) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return text if tail is None else text[-tail:]

    def describe(self, tail: int = 4000) -> str:
        state = "running" if self.proc.poll() is None else f"exited with {self.proc.returncode}"
        return f"\n--- worldloop {' '.join(self.args[:1])} (pid {self.pid}, {state}), log {self.log}:\n{self.output(tail)}"

    def dump_stacks(self) -> None:
        """Ask a live child to print every thread's stack into its log."""
        if self.proc.poll() is None and hasattr(signal, "SIGUSR1"):
            try:
                os.kill(self.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.dump_stacks()
            time.sleep(1.0)
            raise AssertionError(f"still running after {timeout:.0f} s" + self.describe()) from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


def wait_for(pred, what: str, timeout: float, children: list[Child] = (), extra=None):
    """Poll ``pred`` until it returns something truthy and return that (a liveness bound, never a
    speed assertion). Fails at once if a child exits; on timeout, with every child's stacks and log.
    ``extra`` is a callable whose text (e.g. stream lengths) is added to the failure message."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        for c in children:
            if c.returncode is not None:
                raise AssertionError(f"a child exited while waiting for {what}" + _context(children, extra))
        if time.monotonic() >= deadline:
            for c in children:
                c.dump_stacks()
            time.sleep(1.0 if children else 0.0)
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}" + _context(children, extra))
        time.sleep(0.05)


def _context(children: list[Child], extra) -> str:
    text = "".join(c.describe() for c in children)
    if extra is not None:
        try:
            text += f"\n--- {extra()}"
        except Exception as e:  # the context must never hide the real failure
            text += f"\n--- (context unavailable: {e!r})"
    return text
