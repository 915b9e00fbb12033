"""Fault injection for the chaos soak (``bench/chaos.py``) and the tests: a poison entry that kills
whichever judge takes it, as a crash in native code would (a scorer's C extension, the kernel's
OOM killer), so that the soak can show that such an entry is dead-lettered after
``redis.max_deliveries`` deliveries instead of killing the judges one after another for ever.

``WORLDLOOP_FAULT_POISON=<text>``: a judge that takes a trajectory whose id contains ``<text>``
exits at once with status :data:`POISON_EXIT`, before it scores or acks anything. Unset (as it is
everywhere but in the soak and the tests), :func:`crash_if_poison` does nothing.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

POISON_ENV = "WORLDLOOP_FAULT_POISON"
POISON_EXIT = 70


def crash_if_poison(trajectory_id: str) -> None:
    """Exit the process at once (no clean-up, like a crash) when ``trajectory_id`` is a poison one."""
    mark = os.environ.get(POISON_ENV)
    if mark and mark in trajectory_id:
        log.error("fault injection (%s): trajectory %s is poison; exiting with %d", POISON_ENV, trajectory_id,
                  POISON_EXIT)
        logging.shutdown()
        os._exit(POISON_EXIT)
