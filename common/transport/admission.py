"""Rollout admission: staleness bounded at the source, for all actors on all machines at once.

An actor starts an episode only once the run's admission budget, kept atomically in Redis, lets
it. With learner version ``v``, train batch ``B`` and staleness bound ``s``, at most
``(v + s + 1) * B`` trajectories may have been admitted in all (minus those given back). The
learner consumes ``B`` per version, so at most ``(s + 1) * B`` are ever admitted but not yet
trained, and an episode admitted while its actor held weights ``v_a`` is trained at a version
``<= v_a + s`` as long as episodes finish in about the order they were admitted. Consequences:

* ``max_staleness: 0`` is synchronous on-policy PPO: one batch per version, then the actors wait
  (phase "waiting for admission") until they hold the next weights.
* The version used is the *lower* of the learner's published one and the actor's own weights
  (``admit(..., actor_version=...)``): an actor that has not applied ``v`` yet is admitted as of
  its older weights, so its turns are never older than the bound allows.
* GRPO groups are admitted whole (one call with all ``n_samples_per_seed`` ids) when the whole
  group fits the budget. Admitting a group while any budget was left let it pass the bound by its
  size − 1: with groups of 8 and batches of 4 almost two versions, enough for the last members of
  such groups to arrive stale. The fit rule alone could deadlock (one member of a group refunded: one
  slot free, no group fits it, and the learner waits for a batch that cannot fill), so while fewer
  than a batch are admitted and untrained (``admitted - v_learner * B < B``) a group is admitted
  whenever any budget is left, passing the bound by at most its size − 1.

The budget never leaks, so the run never stalls:

* every admitted id holds a **lease** (``{ns}:admission:leases``, expiry time by Redis's own clock,
  so that no machine's clock skew can end a lease early or keep it late) that its actor renews
  while the episode runs (:meth:`Admission.renew`) and settles when the trajectory is in the
  stream (:meth:`Admission.settle`). A lease that expires (the actor was SIGKILLed, or its machine
  vanished) gives its budget back; any admission call reaps expired leases first and keeps those
  ids in ``{ns}:admission:expired``. A trajectory whose lease had expired but that arrives after
  all (a paused actor) is counted again on settle, or when the learner trains it if that comes
  first. A settle that comes after the learner already retired or refunded its id counts nothing:
  the actor settles once its XADD returned, and over a slow link (200 ms each way) the judge and
  the learner can have scored and trained the trajectory before that; counting it again there
  leaked one slot each time until every actor waited for admission and the run stalled.
* whoever dead-letters an entry (a judge or the learner: undecodable, too large, delivered
  ``redis.max_deliveries`` times, unusable) **refunds** the trajectory it names
  (:meth:`Admission.refund_payload`, the consumers' ``on_deadletter`` hook);
* the learner **refunds** an admitted trajectory it cannot train (dead-lettered, unusable, stale)
  and **retires** the ones it trains. Both go through the set ``{ns}:admission:ids`` of ids
  admitted and not yet retired: SREM answers whether this is the first time, so a refund happens
  at most once per id even when a restarted learner decides the same entry again, and a
  duplicate of an already-trained trajectory refunds nothing.

Keys: ``{ns}:admission`` (hash: ``admitted``, ``expired``, ``refunded``), ``{ns}:admission:leases``
(zset id -> expiry), ``{ns}:admission:ids`` (set), ``{ns}:admission:expired`` (set: ids whose lease
ran out before they arrived; one per episode lost with a killed actor, cleared by a fresh learner).
The learner writes ``train_batch_size`` and ``max_staleness`` into the control record, so the
bound is the learner's even when an actor's config differs; before the learner wrote them, the
actor's own values are used.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from worldloop.common.contracts.keys import Keys
from worldloop.common.metrics import metric
from worldloop.common.transport.redis_link import RedisLink
from worldloop.common.contracts.schemas import trajectory_id_of

log = logging.getLogger(__name__)

# the time every lease is measured in: Redis's own clock (TIME), never a caller's, unless a test
# passes an explicit time (ARGV now >= 0)
_NOW_LUA = """
local now = tonumber(ARGV[1])
if now < 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
"""

# KEYS: admission hash, leases zset, ids set, expired set, control hash
# ARGV: now (-1: Redis's clock), lease_s, max_staleness, batch, actor_version, n, id_1 .. id_n
ADMIT_LUA = _NOW_LUA + """
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
for _, id in ipairs(expired) do
  redis.call('ZREM', KEYS[2], id)
  if redis.call('SREM', KEYS[3], id) == 1 then
    redis.call('HINCRBY', KEYS[1], 'admitted', -1)
    redis.call('HINCRBY', KEYS[1], 'expired', 1)
    redis.call('SADD', KEYS[4], id)
  end
end
local vl = tonumber(redis.call('HGET', KEYS[5], 'policy_version') or '0')
local v = vl
local va = tonumber(ARGV[5])
if va < v then v = va end
local s = tonumber(redis.call('HGET', KEYS[5], 'max_staleness') or ARGV[3])
local b = tonumber(redis.call('HGET', KEYS[5], 'train_batch_size') or ARGV[4])
local limit = (v + s + 1) * b
local admitted = tonumber(redis.call('HGET', KEYS[1], 'admitted') or '0')
local n = tonumber(ARGV[6])
-- the whole group must fit; only while fewer than a batch are admitted and untrained (the learner
-- waits for trajectories that no fitting group can bring) may a group pass the bound
local starving = admitted < limit and admitted - vl * b < b
if admitted + n > limit and not starving then return {0, admitted, limit} end
local until_t = now + tonumber(ARGV[2])
for i = 1, n do
  local id = ARGV[6 + i]
  if redis.call('SADD', KEYS[3], id) == 1 then admitted = admitted + 1 end
  redis.call('ZADD', KEYS[2], until_t, id)
end
redis.call('HSET', KEYS[1], 'admitted', admitted)
return {1, admitted, limit}
"""

# KEYS: leases zset; ARGV: now (-1: Redis's clock), lease_s, id_1 .. id_n (only ids still leased)
RENEW_LUA = _NOW_LUA + """
local until_t = now + tonumber(ARGV[2])
for i = 3, #ARGV do redis.call('ZADD', KEYS[1], 'XX', until_t, ARGV[i]) end
return #ARGV - 2
"""

# KEYS: admission hash, leases zset, ids set, expired set; ARGV: id
# 1: settled; 2: its lease had expired, counted again; 0: nothing to do (the learner already
# retired or refunded it: its actor's link to Redis was slower than the judge-to-learner path)
SETTLE_LUA = """
if redis.call('ZREM', KEYS[2], ARGV[1]) == 1 then return 1 end
if redis.call('SREM', KEYS[4], ARGV[1]) == 1 then
  redis.call('SADD', KEYS[3], ARGV[1])
  redis.call('HINCRBY', KEYS[1], 'admitted', 1)
  return 2
end
return 0
"""

# KEYS: admission hash, leases zset, ids set, expired set; ARGV: refund (1/0), id_1 .. id_n
RELEASE_LUA = """
local n = 0
local again = 0
for i = 2, #ARGV do
  redis.call('ZREM', KEYS[2], ARGV[i])
  if redis.call('SREM', KEYS[3], ARGV[i]) == 1 then
    n = n + 1
  elseif redis.call('SREM', KEYS[4], ARGV[i]) == 1 and ARGV[1] ~= '1' then
    again = again + 1
  end
end
if ARGV[1] == '1' and n > 0 then
  redis.call('HINCRBY', KEYS[1], 'admitted', -n)
  redis.call('HINCRBY', KEYS[1], 'refunded', n)
end
if again > 0 then
  redis.call('HINCRBY', KEYS[1], 'admitted', again)
end
return n
"""


# KEYS: admission hash, leases zset, ids set, expired set: keep only what is leased (in flight);
# ARGV: the trajectories the learner has trained (its version x batch), counted as admitted
RESET_LUA = """
local leased = redis.call('ZRANGE', KEYS[2], 0, -1)
redis.call('DEL', KEYS[1], KEYS[3], KEYS[4])
for _, id in ipairs(leased) do redis.call('SADD', KEYS[3], id) end
redis.call('HSET', KEYS[1], 'admitted', #leased + tonumber(ARGV[1]))
return #leased
"""

# KEYS: admission hash, ids set; ARGV: ids already in the streams: count each one not counted yet
ADOPT_LUA = """
local n = 0
for i = 1, #ARGV do
  if redis.call('SADD', KEYS[2], ARGV[i]) == 1 then n = n + 1 end
end
if n > 0 then redis.call('HINCRBY', KEYS[1], 'admitted', n) end
return n
"""


@dataclass
class Decision:
    admitted: bool
    total: int  # admitted so far (after this call when admitted)
    limit: int


class Admission:
    """The run's admission budget (see the module docstring)."""

    def __init__(self, url: str, keys: Keys, *, max_staleness: int, batch_size: int, lease_s: float = 120.0,
                 reconnect_max_s: float = 30.0, socket_timeout_s: float = 10.0,
                 should_stop: Callable[[], bool] | None = None, startup_timeout_s: float | None = None):
        self.keys = keys
        self.max_staleness = int(max_staleness)
        self.batch_size = int(batch_size)
        self.lease_s = float(lease_s)
        self.link = RedisLink(url, keys.admission, reconnect_max_s, socket_timeout_s, should_stop=should_stop,
                              startup_timeout_s=startup_timeout_s)
        r = self.link  # scripts need no client yet: a cluster one is built at the first call
        self._admit, self._settle, self._release = (r.register_script(ADMIT_LUA), r.register_script(SETTLE_LUA),
                                                    r.register_script(RELEASE_LUA))
        self._reset, self._renew = r.register_script(RESET_LUA), r.register_script(RENEW_LUA)
        self._adopt = r.register_script(ADOPT_LUA)
        self._keys4 = [keys.admission, keys.admission_leases, keys.admission_ids, keys.admission_expired]

    def admit(self, ids: list[str], actor_version: int, now: float | None = None) -> Decision:
        """Admit all of ``ids`` (one group) or none; leases start now by Redis's clock (so no
        machine's clock skew can expire a lease early or late), or at ``now`` when a test gives one."""
        if not ids:
            raise ValueError("admit needs at least one id")
        res = self.link.call(lambda r: self._admit(
            keys=[*self._keys4, self.keys.control],
            args=[-1 if now is None else now, self.lease_s, self.max_staleness, self.batch_size, int(actor_version),
                  len(ids), *ids],
            client=r))
        ok, total, limit = (int(x) for x in res)
        if ok:
            metric("worldloop_actor_admitted_episodes").inc(len(ids))
        return Decision(bool(ok), total, limit)

    def renew(self, ids: list[str], now: float | None = None) -> None:
        """Extend the leases of episodes still running (only ids that still hold a lease), from now
        by Redis's clock (or ``now``)."""
        if ids:
            self.link.call(lambda r: self._renew(keys=[self.keys.admission_leases],
                                                 args=[-1 if now is None else now, self.lease_s, *ids], client=r))

    def settle(self, trajectory_id: str) -> None:
        """The trajectory is in the stream: its lease ends, its budget stays spent."""
        if self.link.call(lambda r: self._settle(keys=self._keys4, args=[trajectory_id], client=r)) == 2:
            log.info("trajectory %s arrived after its lease expired: counted again", trajectory_id)

    def release(self, ids: list[str], *, refund: bool) -> int:
        """Retire ids that were trained (``refund=False``) or give back the budget of ids that
        will never be trained (``refund=True``); returns how many were still admitted."""
        if not ids:
            return 0
        n = int(self.link.call(lambda r: self._release(keys=self._keys4, args=["1" if refund else "0", *ids], client=r)))
        if refund and n:
            metric("worldloop_learner_admission_refunds").inc(n)
        return n

    def refund_payload(self, payload: bytes) -> int:
        """Give back the budget of the trajectory a dead-lettered payload holds (when it names one and
        that id is still admitted): the hook of a StreamConsumer's ``on_deadletter``."""
        tid = trajectory_id_of(payload)
        return self.release([tid], refund=True) if tid else 0

    def reset(self, streams: tuple[str, ...] = (), version: int = 0) -> int:
        """Start the count again for a learner at ``version`` (0: a fresh learner; a resumed one
        passes its checkpoint's version, and the ``version x batch_size`` trajectories it has trained
        count as admitted): forget every other admission, except the trajectories this learner will
        still train or refund: the episodes in flight (they hold leases and will settle) and the
        trajectories already in ``streams`` (``rollouts`` and ``scored``: pushed by this run's actors
        before the learner was up, as ``worldloop up`` starts every child at once, or left by an
        earlier run; a resumed learner's entries trained after its checkpoint are still there, not
        acked). Returns how many are counted besides the trained ones.

        A resumed learner recounts because the count can be wrong after a crash of Redis itself:
        ``appendfsync everysec`` loses up to a second of writes, admissions included, and every
        admission lost that way was a slot over the bound for the rest of the run (the chaos soak's
        host crashes cut 0.5-0.7 MB of its AOF on a fast machine, and 14 % of what it produced
        afterwards was dropped as stale).

        Forgetting the pushed ones (as reset did before issue 31) was never made good: they were
        trained all the same, so the count stayed short by them for the whole run, every one of
        them a slot over the bound. The chaos soak's learner, up a minute after its actors, ran
        about 16 over a window of 20 and dropped a fifth of its trajectories as stale. Scanning after
        the leases are kept misses nothing: a trajectory pushed before the reset is in a stream (a
        judge moves it from ``rollouts`` to ``scored`` atomically, and they are scanned in that
        order), one pushed after it still held its lease."""
        trained = max(0, int(version)) * self.batch_size
        kept = int(self.link.call(lambda r: self._reset(keys=self._keys4, args=[trained], client=r)))
        ids: set[str] = set()
        for stream in streams:
            start = "-"
            while True:
                rows = self.link.call(lambda r: r.xrange(stream, start, "+", count=256))
                ids.update(t for t in (trajectory_id_of(f.get(b"data", b"")) for _, f in rows) if t)
                if len(rows) < 256:
                    break
                start = "(" + (rows[-1][0].decode() if isinstance(rows[-1][0], bytes) else str(rows[-1][0]))
        ids_sorted = sorted(ids)
        adopted = 0
        for i in range(0, len(ids_sorted), 512):
            chunk = ids_sorted[i:i + 512]
            adopted += int(self.link.call(lambda r: self._adopt(keys=[self.keys.admission, self.keys.admission_ids],
                                                                args=chunk, client=r)))
        log.info("admission reset at v%d: %d trained, %d episodes in flight and %d trajectories already pushed "
                 "count against the budget", version, trained, kept, adopted)
        return kept + adopted

    def state(self) -> dict[str, int]:
        raw = self.link.call(lambda r: r.hgetall(self.keys.admission)) or {}
        out = {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}
        out["leases"] = int(self.link.call(lambda r: r.zcard(self.keys.admission_leases)))
        return out

    def close(self) -> None:
        self.link.close()
