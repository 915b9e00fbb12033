"""Moving a run's keys from the names before issue 38 (``<ns>:rollouts``) to the hash-tagged ones
(``{<ns>}:rollouts``, :mod:`worldloop.common.contracts.keys`).

Every role (actor, judge, learner, evaluator) and ``worldloop up`` call :func:`migrate_legacy_keys`
before they touch a run's keys. In one Lua script (atomic on a single Redis) it renames every old
key whose new name is free: streams keep their entries, consumer groups and pending lists, the
learner lease keeps its TTL. So a run started by an older worldloop resumes where it stopped, and
the first process to start does the move; the others find nothing left to move.

When a key exists under both names (a process of an older worldloop still runs and writes the old
names, or someone started the new version beside it) nothing is renamed and
:class:`LegacyKeysClash` is raised, naming the keys and the redis-cli commands that settle it.

A Redis Cluster is skipped: no run could work there under the old names (its scripts would have
failed with CROSSSLOT), and a script over old and new names would span slots.
"""

from __future__ import annotations

import logging

import redis

from worldloop.common.contracts.keys import Keys

log = logging.getLogger(__name__)

# KEYS: old_1 .. old_n, new_1 .. new_n. Renames each existing old key to its new name, all or none:
# {0, clashes...} (old and new both exist: nothing renamed) or {1, renamed old names...}
MIGRATE_LUA = """
local n = #KEYS / 2
local clash, moved = {}, {}
for i = 1, n do
  if redis.call('EXISTS', KEYS[i]) == 1 and redis.call('EXISTS', KEYS[n + i]) == 1 then
    table.insert(clash, KEYS[i])
  end
end
if #clash > 0 then return {0, unpack(clash)} end
for i = 1, n do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    redis.call('RENAME', KEYS[i], KEYS[n + i])
    table.insert(moved, KEYS[i])
  end
end
return {1, unpack(moved)}
"""


class LegacyKeysClash(RuntimeError):
    """A run's key exists under its old name and its new one: the message says how to settle it."""


def _text(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def migrate_legacy_keys(r: "redis.Redis | redis.RedisCluster", keys: Keys) -> list[str]:
    """Rename the run's keys from their old names (``<ns>:...``) to the current ones; the old names
    renamed ([] when there were none, and always on a cluster). :class:`LegacyKeysClash` when a key
    exists under both names (nothing renamed then)."""
    if isinstance(r, redis.RedisCluster):
        return []
    legacy = keys.legacy()
    new, old = list(legacy), list(legacy.values())
    res = r.eval(MIGRATE_LUA, 2 * len(new), *old, *new)
    ok, names = int(res[0]), [_text(x) for x in res[1:]]
    if not ok:
        pairs = [(o, next(k for k, v in legacy.items() if v == o)) for o in names]
        raise LegacyKeysClash(
            f"namespace {keys.ns!r} has keys under both their old names and the current hash-tagged ones: "
            + ", ".join(f"{o} and {n}" for o, n in pairs)
            + ". A process of a worldloop older than the {namespace} key names still writes the old ones: stop "
              "every process of the run first. Then keep one of each pair, e.g. to keep the old run's data: "
            + "; ".join(f"redis-cli DEL '{n}' && redis-cli RENAME '{o}' '{n}'" for o, n in pairs)
            + " (or DEL the old names to drop it), and start again (docs/operations.md \"Key names\")")
    if names:
        log.warning("namespace %s: renamed %d keys from their old names to the hash-tagged ones ({%s}:...): %s",
                    keys.ns, len(names), keys.ns, ", ".join(names))
    return names


def legacy_keys_left(r: "redis.Redis | redis.RedisCluster", keys: Keys) -> list[str]:
    """The run's old key names that still exist (read only; [] on a cluster)."""
    if isinstance(r, redis.RedisCluster):
        return []
    old = list(keys.legacy().values())
    p = r.pipeline(transaction=False)
    for o in old:
        p.exists(o)
    return [o for o, n in zip(old, p.execute()) if n]
