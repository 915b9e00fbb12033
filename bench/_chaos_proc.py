"""The chaos soak's supervised processes (``bench/chaos.py``): each ``python -m worldloop ROLE`` child,
its log, and which of its exits the soak caused."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Proc:
    """One supervised ``python -m worldloop ROLE`` child, its output appended to ``log``."""

    name: str
    role: str
    argv: list[str]
    log: Path
    env: dict
    popen: subprocess.Popen | None = None
    starts: int = 0
    killed_by_us: set = field(default_factory=set)  # pids we SIGKILLed
    exits: list = field(default_factory=list)  # (pid, code, killed or stopped by us)
    paused_until: float | None = None
    stopping: bool = False
    expected_codes: tuple = ()  # exit codes the soak causes (a judge killed by the poison entry)

    def start(self) -> None:
        argv = list(self.argv)
        if self.role == "learner" and self.starts > 0:
            argv.append("--resume")  # supervisord-style restart of the learner: continue from its checkpoint
        with open(self.log, "ab") as f:
            f.write(f"\n=== chaos: start #{self.starts + 1} at {time.strftime('%H:%M:%S')}: {' '.join(argv)}\n".encode())
            f.flush()
            self.popen = subprocess.Popen(argv, cwd=ROOT, env=self.env, stdout=f, stderr=subprocess.STDOUT,
                                          start_new_session=True)
        self.starts += 1

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def reap(self) -> bool:
        """True when the process ended (its exit is recorded once)."""
        if self.popen is None or self.popen.poll() is None:
            return False
        # an exit asked for (the drain's SIGTERM) or caused (the poison entry) is no finding either
        code = self.popen.returncode
        self.exits.append((self.popen.pid, code, self.popen.pid in self.killed_by_us or self.stopping
                           or code in self.expected_codes))
        self.popen = None
        self.paused_until = None
        return True

    def signal(self, sig: int) -> bool:
        if not self.alive:
            return False
        try:
            os.kill(self.popen.pid, sig)
        except ProcessLookupError:
            return False
        if sig == signal.SIGKILL:
            self.killed_by_us.add(self.popen.pid)
        return True

    def stop(self, grace_s: float) -> int | None:
        """SIGTERM (SIGCONT first when paused), SIGKILL after ``grace_s``; the exit code."""
        self.stopping = True
        if not self.alive:
            return None
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.popen.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.popen.wait(30)
        code = self.popen.returncode
        self.reap()
        return code

    def unexpected_exits(self) -> list[tuple[int, int]]:
        return [(pid, code) for pid, code, ours in self.exits if not ours]

    def this_life(self) -> str:
        """Its log since its current (or just ended) start: :meth:`start` writes a header per start."""
        return self.log.read_text(errors="replace").rsplit("=== chaos: start #", 1)[-1]

    def last_lines(self, n: int = 20) -> str:
        """The last ``n`` lines of :meth:`this_life`: why it exited."""
        return "\n".join(self.this_life().rstrip().splitlines()[-n:])
