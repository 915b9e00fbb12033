"""The evaluator's CPU budget (worldloop/eval/cpu.py) with explicit CPU counters, the heartbeats'
CPU seconds on a real Redis, and `worldloop up`'s CPU seconds per role."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from worldloop.common.metrics import process_tree_cpu_seconds
from worldloop.common.transport.control import list_processes, register_process
from worldloop.common.contracts.keys import Keys
from worldloop.common.transport.streams import connect
from worldloop.eval.cpu import CpuBudget, cpu_by_role


def _beat(role: str, pid: str, cpu: float) -> dict:
    return {"role": role, "id": pid, "cpu_s": cpu}


def test_an_evaluation_starts_only_while_the_next_one_keeps_the_share() -> None:
    own = [4.0]  # the evaluator's process CPU: 4 s of start-up so far
    b = CpuBudget(0.25, own_cpu=lambda: own[0])
    assert b.allows()  # version 0: the start of the curve, no estimate yet
    own[0] += 6.0
    b.charge(6.0)  # it took 6 CPU seconds
    b.observe([_beat("learner", "l", 12.0), _beat("actor", "a", 18.0), _beat("evaluator", "me", 99.0)],
              self_key="evaluator:me")  # its own heartbeat lags: its live count is used instead
    assert b.run_cpu() == 12 + 18 + 10
    # spent + estimate = 12 <= 0.25 * (run + 6) needs run >= 42: 40 is not enough
    assert not b.allows()
    b.observe([_beat("learner", "l", 13.5), _beat("actor", "a", 18.0)], self_key="evaluator:me")
    assert b.run_cpu() == 41.5 and not b.allows()
    b.observe([_beat("learner", "l", 14.0)], self_key="evaluator:me")  # run 42: 12 <= 0.25 * 48
    assert b.allows()
    assert b.share() == 6 / 42
    assert b.snapshot() == {"in_run_eval_s": 6.0, "evaluator_s": 10.0, "run_s": 42.0, "in_run_eval_share": round(6 / 42, 4),
                            "evaluator_share": round(10 / 42, 4), "budget_share": 0.25}


def test_the_run_cpu_never_shrinks_when_a_process_restarts_or_an_old_beat_arrives() -> None:
    b = CpuBudget(0.5, own_cpu=lambda: 0.0)
    b.observe([_beat("actor", "a-1", 30.0)], "evaluator:me")
    b.observe([_beat("actor", "a-1", 20.0), _beat("actor", "a-2", 5.0), {"role": "judge", "id": "j"}], "evaluator:me")
    # a-1 crashed and a-2 took over: both count; a late, older beat and one without cpu_s change nothing
    assert b.run_cpu() == 35.0


def test_over_a_simulated_run_the_in_run_share_stays_within_the_budget() -> None:
    """The others burn 1.8 CPU s per second; an evaluation is due every 10 s and costs 4 to 6 CPU s
    (never more than the one before it plus 1). After the first one, no evaluation may leave the
    share above 15 %, and the evaluations keep coming."""
    own = [2.0]
    b = CpuBudget(0.15, own_cpu=lambda: own[0])
    costs = iter([5.0, 5.5, 4.0, 6.0, 5.0] * 40)
    others, done, shares = 0.0, [], []
    for second in range(1, 1201):
        others += 1.8
        b.observe([_beat("learner", "l", others)], "evaluator:me")
        due = not done or second - done[-1] >= 10
        if due and b.allows():
            cost = next(costs)
            limit = b.estimate
            own[0] += cost
            b.charge(cost)
            done.append(second)
            if limit is not None and cost <= limit:
                shares.append(b.share())
    assert shares and max(shares) <= 0.15
    assert b.share() <= 0.15
    assert 50 <= len(done) < 120  # deferred (due every 10 s: 120), never starved


def test_a_share_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match=r"share must be in \(0, 1\], got 0.0"):
        CpuBudget(0.0)


def test_heartbeats_carry_the_process_cpu_seconds(redis_url: str) -> None:
    r, keys = connect(redis_url), Keys("cpu")
    before = time.process_time()
    sum(i * i for i in range(200_000))  # some CPU of our own
    register_process(r, keys, "actor", "a", None)
    (beat,) = list_processes(r, keys)
    assert before <= beat["cpu_s"] <= time.process_time() + 0.01


def test_a_process_trees_cpu_counts_its_children_and_goes_into_the_heartbeat(redis_url: str) -> None:
    # an inference server's engine and workers are its children: their CPU is the server's
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 1.5: pass\nprint('done', flush=True)\ntime.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "done"  # 1.5 CPU seconds spent, still running
        own = time.process_time()
        tree = process_tree_cpu_seconds()
        assert tree >= own + 1.5 - 0.05, (tree, own)
        assert process_tree_cpu_seconds(child.pid) >= 1.5 - 0.05
        r, keys = connect(redis_url), Keys("cpu-tree")
        register_process(r, keys, "server", "s", None, cpu_s=tree)
        assert list_processes(r, keys)[0]["cpu_s"] == round(tree, 3)
    finally:
        child.kill()
        child.wait()


def test_cpu_by_role_sums_the_last_scrapes() -> None:
    scrapes = {
        "learner:l": {"metrics": {"process_cpu_seconds_total": 30.0}},
        "actor:a-0": {"metrics": {"process_cpu_seconds_total": 10.0}},
        "actor:a-1": {"metrics": {"process_cpu_seconds_total": 20.0}},
        "evaluator:e": {"metrics": {"process_cpu_seconds_total": 15.0, "worldloop_eval_episodes_total": 64}},
        "judge:j": {"metrics": {}},  # a process collector that was not there: left out
        # vLLM's collector counts the API server alone; worldloop's gauge its engine and workers too
        "server:s": {"metrics": {"process_cpu_seconds_total": 2.0, "worldloop_server_cpu_seconds": 25.0}},
    }
    assert cpu_by_role(scrapes) == {"seconds": {"actor": 30.0, "evaluator": 15.0, "learner": 30.0, "server": 25.0},
                                    "total_s": 100.0,
                                    "share": {"actor": 0.3, "evaluator": 0.15, "learner": 0.3, "server": 0.25}}
    assert cpu_by_role({}) == {"seconds": {}, "total_s": 0.0, "share": {}}
