"""Child ``worldloop`` processes for the tests, and waiting on them so that a failure explains itself.

Each child writes stdout and stderr to a log file (never a pipe that nobody drains while the test
polls). ``wait_for`` fails at once when a child exits, and on a timeout it asks every live child
for the stacks of all its threads (``worldloop`` installs a SIGUSR1 stack dump) before it fails,
so the assertion message carries the logs' tails and where each child was stuck.

Every other bounded wait of a test goes through one of these too, never a bare timeout:

    Child(args, log) / Child.script(code, args, log)          # python -m worldloop ARGS / python -c CODE ARGS
    wait_for(pred, what, timeout, children=(), extra=None)   # poll a state
    exit_code(popen, timeout, what, log=None) -> int         # a subprocess.Popen to end
    run_to_end(cmd, timeout, what, **kwargs) -> CompletedProcess   # subprocess.run, output captured
    returns_within(fn, what, timeout) -> fn()'s result       # a call that must not block for ever

Their timeouts are liveness bounds, never speed claims: a test's own waits must add up to less than
its pytest timeout (``tests/README.md``), so that these diagnostics print before pytest kills it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class Child:
    """A ``python -m worldloop ARGS`` process whose output goes to ``log``."""

    def __init__(self, args: list[str], log: Path, env: dict | None = None, new_session: bool = False,
                 launcher: tuple[str, ...] = ("-m", "worldloop")):
        self.args = list(args)
        self.log = Path(log)
        self.name = "worldloop" if launcher == ("-m", "worldloop") else "python"
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), **(env or {})}
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, *launcher, *self.args], cwd=ROOT, env=full_env,
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=new_session)

    @classmethod
    def script(cls, code: str, args: list[str], log: Path, env: dict | None = None) -> "Child":
        """A ``python -c CODE ARGS`` child: a helper process the test itself writes (e.g. one that
        holds a lease), with its output in ``log`` like any other child."""
        return cls(args, log, env=env, launcher=("-c", code))

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
        return f"\n--- {self.name} {' '.join(self.args[:1])} (pid {self.pid}, {state}), log {self.log}:\n{self.output(tail)}"

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

    def stop(self, grace: float = 30.0) -> None:
        """The teardown of a ``worldloop up`` child: SIGTERM, on which up stops its own children (each in
        its own session, so a SIGKILL of up alone would leave them running, a vLLM worker spinning on a core
        for the rest of the suite), then SIGKILL after ``grace`` seconds."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.kill()


def wait_for(pred, what: str, timeout: float, children: list[Child] = (), extra=None):
    """Poll ``pred`` until it returns something truthy and return that (a liveness bound, never a
    speed assertion). Fails at once if a child exits; on timeout, with every child's stacks and log.
    ``extra`` is a callable whose text (e.g. stream lengths) is added to the failure message.

    A Redis read in ``pred`` that gets no answer within its client's socket timeout (redis-py's
    default 5 s: once seen on a loaded 2-core VM while a ``worldloop up`` started) is "not yet",
    not a failure: the state is asked again until the deadline, and the message counts such reads."""
    import redis

    deadline = time.monotonic() + timeout
    slow_reads = 0
    while True:
        try:
            got = pred()
        except redis.exceptions.TimeoutError:
            got, slow_reads = None, slow_reads + 1
        if got:
            return got
        for c in children:
            if c.returncode is not None:
                raise AssertionError(f"a child exited while waiting for {what}" + _context(children, extra))
        if time.monotonic() >= deadline:
            for c in children:
                c.dump_stacks()
            time.sleep(1.0 if children else 0.0)
            slow = f" ({slow_reads} Redis reads got no answer in time)" if slow_reads else ""
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}{slow}" + _context(children, extra))
        time.sleep(0.05)


def _context(children: list[Child], extra) -> str:
    text = "".join(c.describe() for c in children)
    if extra is not None:
        try:
            text += f"\n--- {extra()}"
        except Exception as e:  # the context must never hide the real failure
            text += f"\n--- (context unavailable: {e!r})"
    return text


def exit_code(proc: subprocess.Popen, timeout: float, what: str, log: Path | None = None) -> int:
    """``proc.wait(timeout)``; past it an AssertionError naming ``what`` with the tail of ``log``."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        tail = Path(log).read_text(errors="replace")[-4000:] if log is not None and Path(log).exists() else ""
        raise AssertionError(f"{what}: still running after {timeout:.0f} s (pid {proc.pid}), log {log}:\n{tail}") from None


def run_to_end(cmd: list[str], timeout: float, what: str, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, timeout=timeout, **kwargs)``; past the timeout the
    child is killed and an AssertionError names ``what`` with the tails of what it printed."""
    try:
        return subprocess.run(cmd, capture_output=True, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise AssertionError(f"{what}: still running after {timeout:.0f} s, killed\n--- stdout:\n{out[-2000:]}"
                             f"\n--- stderr:\n{err[-4000:]}") from None


def returns_within(fn, what: str, timeout: float):
    """``fn()`` run in a thread: its result, or its exception raised here; if it has not returned after
    ``timeout`` s, an AssertionError naming ``what`` with the stack where it is stuck (the thread is
    left running, a daemon)."""
    box: dict = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # handed to the caller below
            box["error"] = e

    th = threading.Thread(target=target, name=f"returns_within: {what}", daemon=True)
    th.start()
    th.join(timeout)
    if th.is_alive():
        frame = sys._current_frames().get(th.ident)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no stack)"
        raise AssertionError(f"{what}: did not return within {timeout:.0f} s; it is at:\n{stack}")
    if "error" in box:
        raise box["error"]
    return box["result"]


# --------------------------------------------------------------------------- two ranks under torchrun

_RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def two_ranks(script: Path, args: list[str], out: Path, what: str, timeout: float = 600) -> dict:
    """``script --worker *args out`` on 2 ranks under ``torch.distributed.run`` (gloo on the CPU),
    from the repository root with ``tests/`` importable; the JSON that rank 0 wrote to ``out``."""
    import json

    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k not in _RANK_ENV}
    env["PYTHONPATH"] = str(root) + os.pathsep + str(root / "tests")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script), "--worker", *args, str(out)]
    done = run_to_end(cmd, timeout, what, cwd=root, env=env)
    assert done.returncode == 0, done.stdout.decode()[-2000:] + done.stderr.decode()[-4000:]
    return json.loads(Path(out).read_text())


def rank0_compares(out: str | Path, check, **facts) -> None:
    """In a worker of :func:`two_ranks`: rank 0 runs ``check()`` (assertions) and writes
    ``{"same": "ok" or the failure's tail, **facts}`` to ``out``; then every rank meets at a barrier."""
    import json

    import torch.distributed as tdist

    if int(os.environ["RANK"]) == 0:
        try:
            check()
            same = "ok"
        except AssertionError:
            same = "differ: " + traceback.format_exc()[-1500:]
        Path(out).write_text(json.dumps({"same": same, **facts}))
    tdist.barrier()
