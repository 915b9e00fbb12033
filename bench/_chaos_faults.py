"""The chaos soak's faults added for issue 31 (``bench/chaos.py`` dispatches to these), and the AOF
sampler that the host-crash cut needs. Each fault function takes the running ``Chaos`` and the
``Fault`` it fills in (target, note).

* ``redis_kill_at_backlog``: SIGSTOP the learner until ``scored`` holds ``redis.max_backlog``
  undelivered entries (the judges block on it), kill -9 Redis there, restart it, SIGCONT.
* ``poison``: a trajectory into ``rollouts`` that kills whichever judge takes it
  (``worldloop.common.faults``: the judges run with ``WORLDLOOP_FAULT_POISON``); it must end
  dead-lettered after ``redis.max_deliveries`` attempts, with the judges restarted meanwhile.
* ``redis_oom``: ``CONFIG SET maxmemory 1`` for 30 s (every write Redis counts as growing is
  refused), then back to 0.
* ``host_crash``: kill -9 Redis and every process of the run at once, cut Redis's append-only file
  back to where it stood at least a second earlier (what ``appendfsync everysec`` may lose), and
  restart Redis; the processes are restarted by the soak's supervisor (the learner with
  ``--resume``). The ids the actors logged after that point are the losses the promise allows.
* ``second_learner``: start another learner on the same namespace; it must refuse to start (exit 2,
  naming the holder) and write nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

POISON_MARK = "chaos-poison"
OOM_SECONDS = 30.0
CUT_AGE_S = 1.0  # the host crash loses the AOF's writes of at least this long ago


@dataclass
class Fault:
    kind: str
    offset_s: float  # planned, from the soak's start
    at_wall: float = 0.0
    target: str = ""
    note: str = ""
    recovery_s: float | None = None


def malformed_entries() -> list[dict]:
    """The ``malformed`` fault's entries: not msgpack, the wrong schema, no ``data`` field."""
    from worldloop.common.contracts.schemas import packb

    return [{b"data": b"\xc1 this is not msgpack"},
            {b"data": packb({"schema": "not-a-trajectory", "x": 1})},
            {b"payload": b"an entry without the data field"}]


@dataclass
class AofSample:
    at: float  # monotonic
    inode: int
    size: int
    produced: dict[str, int] = field(default_factory=dict)  # actor log file -> bytes


class AofSampler:
    """Every 0.2 s: the size of Redis's growing AOF and of every actor's produced log."""

    def __init__(self, redis, produced_dir: Path):
        self.redis, self.produced_dir = redis, produced_dir
        self.samples: deque[AofSample] = deque(maxlen=200)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="aof-sampler", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            try:
                st = self.redis.aof_file().stat()
                produced = {p.name: p.stat().st_size for p in self.produced_dir.glob("*.ids")}
            except OSError:  # Redis restarting: no file for a moment
                continue
            self.samples.append(AofSample(time.monotonic(), st.st_ino, st.st_size, produced))

    def before(self, age_s: float) -> AofSample | None:
        """The newest sample at least ``age_s`` old."""
        now = time.monotonic()
        old = [s for s in self.samples if now - s.at >= age_s]
        return old[-1] if old else None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


def allowed_losses(c) -> set[str]:
    """Trajectory ids the actors logged between a host crash's AOF sample and the crash: the XADDs
    that appendfsync everysec may lose (an id logged there whose XADD came before the sample is
    in the AOF and not lost; an XADD after the sample is logged after it)."""
    ids: set[str] = set()
    for sample, logged in c.crash_cuts:
        for name, end in logged.items():
            with open(c.produced_dir / name, "rb") as fh:
                fh.seek(sample.produced.get(name, 0))
                ids.update(x.strip() for x in fh.read(end - sample.produced.get(name, 0)).decode(errors="replace").split())
    return ids


def _learner(c, timeout_s: float = 180.0):
    """The supervised learner once it is alive and holds the namespace's lease (it may be restarting
    after an earlier fault: waited for, supervising meanwhile), or None."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        p = next((p for p in c.procs if p.role == "learner" and p.alive), None)
        holder = c.call(lambda r: r.hget(c.keys.learner_lease, "pid"))
        if p is not None and holder is not None and int(holder) == p.popen.pid:
            return p
        c.wait(0.5)
    return None


def _backlog(c, stream: str) -> int:
    def run(r) -> int:
        length = int(r.xlen(stream))
        pending = sum(int(g.get("pending") or 0) for g in r.xinfo_groups(stream)) if r.exists(stream) else 0
        return length - pending
    return c.call(run)


def redis_kill_at_backlog(c, f) -> None:
    learner = _learner(c)
    if learner is None:
        f.note = "no learner alive"
        return
    limit = int(c.cfg["redis"]["max_backlog"])
    learner.signal(signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 60  # the admission window may hold less than the limit: not forever
        while time.monotonic() < deadline and _backlog(c, c.keys.scored) < limit:
            c.wait(0.5)
        reached = _backlog(c, c.keys.scored)
        down = c.rng.uniform(1.0, 4.0)
        c.redis.stop(kill=True)
        c.wait(down)
        c.redis.start(timeout=120)
    finally:
        learner.signal(signal.SIGCONT)
    f.target, f.note = "redis", f"scored backlog {reached}/{limit}, down {down:.1f}s"


def poison(c, f) -> None:
    from worldloop.common.contracts.schemas import encode_trajectory
    from worldloop.testing.trajectories import make_trajectory

    tid = f"{POISON_MARK}-{len(c.poisoned)}"
    c.poisoned.append((c._xadd(c.keys.rollouts, {b"data": encode_trajectory(make_trajectory(tid))}), tid))
    f.target, f.note = "rollouts", tid


def redis_oom(c, f) -> None:
    c.call(lambda r: r.config_set("maxmemory", 1))
    try:
        c.wait(OOM_SECONDS)
    finally:
        c.call(lambda r: r.config_set("maxmemory", 0))
    f.target, f.note = "redis", f"maxmemory 1 for {OOM_SECONDS:.0f}s"


def host_crash(c, f) -> None:
    sample = c.sampler.before(CUT_AGE_S)
    for p in c.procs:
        if p.alive:
            p.signal(signal.SIGKILL)
    path = c.redis.aof_file()
    c.redis.stop(kill=True)
    note = "no AOF sample yet: nothing cut"
    if sample is not None:
        st = path.stat()
        if st.st_ino != sample.inode or st.st_size < sample.size:
            note = "AOF rewritten since the sample: nothing cut"
        else:
            os.truncate(path, sample.size)
            logged = {p.name: p.stat().st_size for p in c.produced_dir.glob("*.ids")}  # what the actors logged
            c.crash_cuts.append((sample, logged))
            note = f"AOF cut by {st.st_size - sample.size} bytes ({time.monotonic() - sample.at:.1f}s)"
    c.redis.start(timeout=120)
    f.target, f.note = "redis+all", note


def second_learner(c, f) -> None:
    # only while the soak's learner holds the lease: started in a gap after the learner died, the
    # second one would rightly take over the dead one's lease and be the run's learner
    if _learner(c) is None:
        f.note = "no learner holding the lease"
        return
    log = c.run_dir / "logs" / f"second-learner-{len(c.second_learners)}.log"
    with open(log, "wb") as out:
        popen = subprocess.Popen(c.procs[0].argv, cwd=Path(__file__).resolve().parent.parent, env=c.procs[0].env,
                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120  # the refusal comes before any model is built
    while popen.poll() is None and time.monotonic() < deadline:
        c.wait(0.5)
    if popen.poll() is None:  # not refused: it is building a learner; stop it before it writes
        popen.kill()
        popen.wait()
    text = log.read_text(errors="replace")
    refused = popen.returncode == 2 and "already has a learner" in text
    c.second_learners.append(refused)
    f.target, f.note = "learner", f"exit {popen.returncode}: {'refused, naming the holder' if refused else 'NOT refused'}"


NEW_KINDS = {"redis_kill_at_backlog": redis_kill_at_backlog, "poison": poison, "redis_oom": redis_oom,
             "host_crash": host_crash, "second_learner": second_learner}
