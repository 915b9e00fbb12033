"""What the run's evaluator may spend: its share of the run's CPU, measured and enforced.

Public API::

    CpuBudget(share, own_cpu=time.process_time)   # the evaluator's in-run budget
        .observe(processes, self_key)   # the run's processes' CPU seconds, from their heartbeats
        .allows() -> bool               # may an in-run evaluation start now?
        .charge(cpu_s)                  # an in-run evaluation took cpu_s CPU seconds
        .run_cpu() -> float, .share() -> float | None, .snapshot() -> dict
    cpu_by_role(last_values) -> dict    # `worldloop up`: CPU seconds per role from the last scrapes
    usable_cores() -> int               # the cores this process may run on (worldloop.common.cores)
    idle_cores(sample_s=1.0) -> float | None   # how many of them were idle over the next sample_s seconds

**The rule.** Every process of a run puts its CPU seconds so far (``time.process_time()``, all its
threads) into its heartbeat (``cpu_s``, :func:`worldloop.common.transport.control.register_process`). The
run's CPU is their sum: the newest value of every process ever seen (a restarted process is a new
one; the evaluator's own value is read live). An in-run evaluation starts only while

    spent + estimate <= share * (run + estimate)

where ``spent`` is the CPU of the in-run evaluations so far and ``estimate`` the cost of the last
one: if the next costs no more, the share still holds when it ends, whatever the others did
meanwhile (they only add to ``run``). The first evaluation (version 0, the start of the curve) has
no estimate and always runs. A due evaluation that the budget defers waits, and then evaluates the
newest version, so a run on a busy machine gets fewer evaluation points, never a starved learner.
The final evaluation, after the learner has stopped, is not charged: the run's CPU is free then.

The clock and the counters are arguments, so the rule is tested with explicit numbers.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

from worldloop.common.cores import usable_cores  # noqa: F401  (part of this module's API: worldloop up)


class CpuBudget:
    def __init__(self, share: float, own_cpu: Callable[[], float] = time.process_time):
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share}")
        self.cpu_share = share
        self.own_cpu = own_cpu
        self.others: dict[str, float] = {}  # "role:id" -> newest cpu_s of every other process seen
        self.spent = 0.0  # CPU seconds of the in-run evaluations
        self.evaluations = 0
        self.estimate: float | None = None  # the last in-run evaluation's CPU seconds

    def observe(self, processes: Iterable[dict], self_key: str) -> None:
        """Take the ``cpu_s`` of every heartbeat but this process's own (``role:id`` ``self_key``)."""
        for p in processes:
            key = f"{p.get('role')}:{p.get('id')}"
            cpu = p.get("cpu_s")
            if key != self_key and isinstance(cpu, (int, float)):
                self.others[key] = max(float(cpu), self.others.get(key, 0.0))

    def run_cpu(self) -> float:
        """CPU seconds of the whole run so far: every other process's newest and this one's own."""
        return sum(self.others.values()) + self.own_cpu()

    def allows(self) -> bool:
        """Whether an in-run evaluation may start now (see the module docstring)."""
        if self.estimate is None:
            return True
        return self.spent + self.estimate <= self.cpu_share * (self.run_cpu() + self.estimate)

    def charge(self, cpu_s: float) -> None:
        self.spent += cpu_s
        self.estimate = cpu_s
        self.evaluations += 1

    def share(self) -> float | None:
        """The in-run evaluations' share of the run's CPU so far (None before any CPU was counted)."""
        run = self.run_cpu()
        return self.spent / run if run > 0 else None

    def snapshot(self) -> dict:
        """What an evaluation record says about the CPU: seconds and shares so far."""
        own, run = self.own_cpu(), self.run_cpu()
        return {"in_run_eval_s": round(self.spent, 2), "evaluator_s": round(own, 2), "run_s": round(run, 2),
                "in_run_eval_share": round(self.spent / run, 4) if run > 0 else None,
                "evaluator_share": round(own / run, 4) if run > 0 else None, "budget_share": self.cpu_share}


def cpu_by_role(last_values: dict[str, dict]) -> dict:
    """CPU seconds per role (``process_cpu_seconds_total`` of the last scrape of each process, or an
    inference server's ``worldloop_server_cpu_seconds``, its engine and workers included;
    ``"role:id" -> {"metrics": {...}}`` as ``worldloop up`` keeps them), their total and each role's
    share of it."""
    seconds: dict[str, float] = {}
    for key, value in last_values.items():
        metrics = value.get("metrics") or {}
        cpu = metrics.get("worldloop_server_cpu_seconds", metrics.get("process_cpu_seconds_total"))
        if cpu is not None:
            role = key.split(":", 1)[0]
            seconds[role] = seconds.get(role, 0.0) + float(cpu)
    total = sum(seconds.values())
    return {"seconds": {k: round(v, 1) for k, v in sorted(seconds.items())}, "total_s": round(total, 1),
            "share": {k: round(v / total, 4) for k, v in sorted(seconds.items())} if total > 0 else {}}


def idle_cores(sample_s: float = 1.0) -> float | None:
    """How many of this process's cores were idle over the next ``sample_s`` seconds (the machine's
    idle share in ``/proc/stat`` times the cores this process may use); None where there is no
    ``/proc/stat``."""
    def read() -> tuple[int, int]:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
        return ticks[3] + ticks[4], sum(ticks)

    try:
        idle0, total0 = read()
        time.sleep(sample_s)
        idle1, total1 = read()
    except (OSError, ValueError, IndexError):
        return None
    return usable_cores() * (idle1 - idle0) / (total1 - total0) if total1 > total0 else 0.0
