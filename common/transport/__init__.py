"""worldloop's transport machinery: the code that moves data between processes.

- Redis: ``redis_link`` (connections and retry), ``streams`` (XADD, acks, the dead-letter stream),
  ``stream_consumer`` (XREADGROUP, XAUTOCLAIM, recovery), ``admission`` (the rollout budget),
  ``lease`` (the learner lease and its fencing token), ``control`` (control record, heartbeats,
  counters), ``redis_local`` (a private ``redis-server`` for ``up`` and the tests);
- ZeroMQ: ``weights/`` (the weight channel: codec, publisher, subscriber, fetcher);
- ``process``: the scaffold of every role process.

These are the only modules that speak Redis or ZeroMQ. They import contracts and the utilities of
``worldloop.common``, never a role (``tools/check_layers.py``).
"""
