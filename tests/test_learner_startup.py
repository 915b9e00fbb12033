"""A newcomer's Ctrl-C during the learner's first start must not hang every later start.

DeepSpeed's CPU comm backend used to JIT-compile ``deepspeed_shm_comm`` on the first start (about a
minute), under a plain lock file in ``$TORCH_EXTENSIONS_DIR`` that an interrupted start leaves
behind; every later start then waited on it for good. The learner now never builds that op (it
serves only tensor-parallel inference), so nothing is compiled and no lock is taken.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from worldloop.up import LEARNER_QUIET_S, Progress, child_threads, learner_time_budget

START = """
import torch, deepspeed
from worldloop.common.contracts.config import load_config
from worldloop.learner.engine import init_distributed
dist = init_distributed(load_config(None, []))
print("DIST", dist.world_size, flush=True)
m = torch.nn.Linear(4, 4)
engine, *_ = deepspeed.initialize(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                                  config={"train_batch_size": 1})
loss = engine(torch.ones(1, 4)).sum()
engine.backward(loss)
engine.step()
print("READY", flush=True)
"""


def _start(ext: Path) -> subprocess.Popen:
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return subprocess.Popen([sys.executable, "-c", START], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)


def test_an_interrupted_first_start_leaves_nothing_that_blocks_the_next(tmp_path: Path) -> None:
    ext = tmp_path / "torch_extensions"
    # what an interrupted compile of an older version left behind: the baton torch waits on forever
    (ext / "deepspeed_shm_comm").mkdir(parents=True)
    (ext / "deepspeed_shm_comm" / "lock").write_text("")
    first = _start(ext)
    seen = []
    for line in first.stdout:  # log lines first, then ours
        seen.append(line)
        if line.startswith("DIST"):
            break
    assert seen and seen[-1].startswith("DIST 1"), "".join(seen)
    first.send_signal(signal.SIGINT)  # Ctrl-C in the middle of engine set-up
    first.wait(timeout=60)

    second = _start(ext)
    try:
        out, _ = second.communicate(timeout=240)  # a liveness bound: the stale lock used to block it for good
    except subprocess.TimeoutExpired:
        second.kill()
        out, _ = second.communicate()
        raise AssertionError(f"the second start still runs after 240 s (waiting on the lock?):\n{out[-3000:]}") from None
    finally:
        second.kill()
    assert second.returncode == 0 and "READY" in out, out[-3000:]
    # nothing was compiled: the extensions folder holds only the planted lock
    built = sorted(str(p.relative_to(ext)) for p in ext.rglob("*") if p.is_file())
    assert built == ["deepspeed_shm_comm/lock"], built


def test_the_progress_line_says_where_a_stuck_learner_waits() -> None:
    p = Progress()
    assert p.learner_note() == ""  # no heartbeat seen yet: nothing to say
    p.learner_phase, p.learner_phase_s, p.learner_silent_s = "building models (DeepSpeed engines)", 5.0, 1.0
    assert p.learner_note() == ""  # a short phase is normal
    p.learner_phase_s = LEARNER_QUIET_S + 40
    assert "learner: building models (DeepSpeed engines) for 60s" in p.line(20)
    p.learner_silent_s = LEARNER_QUIET_S + 1
    assert "no heartbeat for 21s" in p.line(20)
    p.learner_silent_s, p.learner_restarts = 1.0, 2
    assert "learner restarted 2x (resumed)" in p.line(20)


def test_children_share_the_cores_instead_of_each_taking_all() -> None:
    assert child_threads(4, cores=2) == 1  # learner, 2 actors, judge on 2 cores
    assert child_threads(4, cores=16) == 4
    assert child_threads(1, cores=16) == 16
    assert child_threads(20, cores=16) == 1


def test_up_time_budget_leaves_the_learner_what_is_left() -> None:
    from worldloop.common.contracts.config import Config

    cfg = Config()
    assert learner_time_budget(cfg, 500.0) is None and cfg.trainer.time_limit_s is None  # no budget: no limit
    cfg.up.time_limit_s, cfg.up.final_reserve_s = 900.0, 90.0
    assert learner_time_budget(cfg, 500.0) == pytest.approx(310.0)  # 900 - 500 - 90
    cfg.trainer.time_limit_s = 100.0  # the config's own, smaller limit wins
    assert learner_time_budget(cfg, 500.0) == pytest.approx(100.0)
    cfg.trainer.time_limit_s = None
    assert learner_time_budget(cfg, 2000.0) == pytest.approx(1.0)  # spent already: one update at most
