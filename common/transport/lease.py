"""One learner per namespace: a lease in Redis with a fencing token.

Two learners on one namespace would share consumer ``learner-0``'s pending list and the run
directory, and train entries twice across lineages. So rank 0 of a learner takes the namespace's
lease before it builds anything, keeps it while it runs, and writes nothing once it lost it.

Keys (``Keys``): ``{ns}:learner:lease`` (hash: token, holder, host, pid, pid_start, since; expires
``trainer.lease_ttl_s`` after the last renewal), ``{ns}:learner:owner`` (the token of the last
learner that took the lease; no expiry) and ``{ns}:learner:epoch`` (a counter; each token starts
with its next value, so tokens grow with every hand-over).

* **Taking it.** :meth:`LearnerLease.acquire` takes a free (or expired) lease. One held by a live
  learner makes it raise :class:`LeaseHeld`, naming the holder (host, pid, since) and when the
  lease runs out. One held by a dead learner *on the same host* (its pid is gone, or now belongs
  to a process that started later) is taken over at once: that is the restart after a crash or a
  ``kill -9`` (``--resume``, supervisord, ``worldloop up``), which must not wait out the TTL. A
  learner that died on another host is waited out: its lease expires ``lease_ttl_s`` after its
  last renewal, by Redis's clock (PEXPIRE).
* **Keeping it.** A daemon thread renews it every third of the TTL (PEXPIRE, only while the token
  is still the lease's). A lease that expired while its holder could not reach Redis (Redis was
  down or restarted, even without persistence) is taken back by the same token when nobody took
  it in between (``owner`` still names this token, or is gone with the data). Otherwise the lease
  is lost: :attr:`lost` is set and ``on_lost`` runs (the learner stops). The fenced scripts and
  :meth:`check` agree on a missing ``owner`` (a Redis restarted without persistence): it is still
  the holder's, who re-claims it with the same token (the scripts set it again); before, the
  scripts refused it while ``check`` accepted it, and the learner stopped as if fenced (exit 3).
* **Fencing.** A learner that lost its lease writes nothing more. In Redis this is atomic: the
  learner's acks and dead letters (``StreamConsumer(fence=...)``) and its control-record writes
  (:meth:`hset`) run as scripts that first compare ``owner`` with the learner's token and fail
  with ``FENCED`` (:class:`worldloop.common.transport.redis_link.Fenced`; :class:`LeaseLost` is one) when
  another learner took over.
  Its files (checkpoints, ``metrics.jsonl``, the ledger) are guarded by :meth:`check`, a Redis
  read right before each update's writes and each checkpoint. A learner paused exactly between
  that check and its write could still write once; the Redis side cannot be overtaken.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from typing import Callable

from worldloop.common.contracts.keys import Keys
from worldloop.common.transport.redis_link import Fenced, RedisLink, redis_address

log = logging.getLogger(__name__)

# KEYS: lease hash, owner, epoch; ARGV: ttl_ms, token suffix, steal (the token of a dead holder we
# may replace, or ''), then holder fields as name, value pairs. {1, token} or {0} (held)
ACQUIRE_LUA = """
local cur = redis.call('HGET', KEYS[1], 'token')
if cur and cur ~= ARGV[3] then return {0} end
local token = redis.call('INCR', KEYS[3]) .. '-' .. ARGV[2]
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'token', token, unpack(ARGV, 4))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('SET', KEYS[2], token)
return {1, token}
"""

# KEYS: lease hash, owner; ARGV: token, ttl_ms, then holder fields. 1 renewed, 2 taken back (it had
# expired and nobody took it since), 0 lost (another learner took it)
RENEW_LUA = """
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
local owner = redis.call('GET', KEYS[2])
if redis.call('EXISTS', KEYS[1]) == 0 and (owner == false or owner == ARGV[1]) then
  redis.call('HSET', KEYS[1], 'token', ARGV[1], unpack(ARGV, 3))
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('SET', KEYS[2], ARGV[1])
  return 2
end
return 0
"""

def fence_lua(key: int | str, arg: int | str) -> str:
    """The Lua lines a fenced write script starts with: fail with FENCED when ``KEYS[key]`` (the
    owner key) holds another token than ``ARGV[arg]``; an empty token means unfenced. A missing
    owner key (Redis restarted without persistence, and no learner took the namespace since) is
    the holder's to re-claim: the script sets it to the token and goes on, as :meth:`LearnerLease.check`
    accepts it and the renewal takes the lease back (a learner taking the namespace afterwards
    sets its own token, and this one is fenced from then on)."""
    return f"""
if ARGV[{arg}] ~= '' then
  local owner = redis.call('GET', KEYS[{key}])
  if owner == false then
    redis.call('SET', KEYS[{key}], ARGV[{arg}])
  elseif owner ~= ARGV[{arg}] then
    return redis.error_reply('FENCED another learner holds this namespace now (owner ' ..
      owner .. ', ours ' .. ARGV[{arg}] .. ')')
  end
end
"""


# KEYS: owner, hash; ARGV: token, then field, value pairs
FENCED_HSET_LUA = fence_lua(1, 1) + """
redis.call('HSET', KEYS[2], unpack(ARGV, 2))
return 1
"""

# KEYS: lease hash, owner; ARGV: token: a clean stop hands the lease back at once
RELEASE_LUA = """
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then redis.call('DEL', KEYS[1]) return 1 end
return 0
"""


class LeaseHeld(RuntimeError):
    """Another live learner holds the namespace's lease (the message names it)."""


class LeaseLost(Fenced):
    """This learner's lease was taken over by another learner: it must write nothing more."""


def _pid_start(pid: int) -> str:
    """When process ``pid`` started (clock ticks since boot, /proc/PID/stat field 22), '' if unknown."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _alive(pid: int, start: str) -> bool:
    """Is the process that took the lease (pid, started at ``start``) still running here?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user has the pid: not ours
        return bool(start) and _pid_start(pid) == start
    return not start or _pid_start(pid) in ("", start)


class LearnerLease:
    """The namespace's learner lease held by this process (see the module docstring)."""

    def __init__(self, url: str, keys: Keys, ttl_s: float, *, holder: str, reconnect_max_s: float = 30.0,
                 socket_timeout_s: float = 10.0, startup_timeout_s: float | None = None,
                 on_lost: Callable[[], None] | None = None):
        self.keys = keys
        self.ttl_ms = int(ttl_s * 1000)
        self.token: str | None = None
        self.lost = threading.Event()
        self.on_lost = on_lost
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self.info = {"holder": holder, "host": socket.gethostname(), "pid": str(os.getpid()),
                     "pid_start": _pid_start(os.getpid()), "since": f"{time.time():.3f}", "redis": redis_address(url)}
        self.link = RedisLink(url, keys.learner_lease, reconnect_max_s, socket_timeout_s,
                              should_stop=self._closing.is_set, startup_timeout_s=startup_timeout_s)
        r = self.link  # scripts need no client yet: a cluster one is built at the first call
        self._acquire, self._renew = r.register_script(ACQUIRE_LUA), r.register_script(RENEW_LUA)
        self._hset, self._release = r.register_script(FENCED_HSET_LUA), r.register_script(RELEASE_LUA)

    @property
    def fence(self) -> tuple[str, str]:
        """(owner key, token): what a fenced write script compares."""
        assert self.token is not None, "acquire() first"
        return self.keys.learner_owner, self.token

    def _fields(self) -> list[str]:
        return [x for kv in self.info.items() for x in kv]

    def acquire(self) -> "LearnerLease":
        """Take the lease (or a dead same-host holder's) and start renewing it; :class:`LeaseHeld`
        when a live learner holds it."""
        lease_keys = [self.keys.learner_lease, self.keys.learner_owner, self.keys.learner_epoch]
        while True:
            cur = {k.decode(): v.decode() for k, v in (self.link.call(lambda r: r.hgetall(self.keys.learner_lease)) or {}).items()}
            steal = ""
            if cur:
                if cur.get("host") != self.info["host"] or _alive(int(cur.get("pid") or 0), cur.get("pid_start", "")):
                    pttl = self.link.call(lambda r: r.pttl(self.keys.learner_lease))
                    raise LeaseHeld(
                        f"namespace {self.keys.ns!r} already has a learner: {cur.get('holder')} on {cur.get('host')} "
                        f"(pid {cur.get('pid')}, since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(float(cur.get('since') or 0)))}); "
                        f"its lease runs out in {max(pttl, 0) / 1000:.0f} s unless it renews it. Stop that learner, or "
                        "use another redis.namespace")
                steal = cur.get("token", "")
                log.warning("learner lease of %s: its holder (pid %s on this host) is dead: taking it over",
                            self.keys.ns, cur.get("pid"))
            res = self.link.call(lambda r: self._acquire(keys=lease_keys, args=[self.ttl_ms, uuid.uuid4().hex[:12], steal,
                                                                                *self._fields()], client=r))
            if int(res[0]) == 1:
                self.token = res[1].decode() if isinstance(res[1], bytes) else str(res[1])
                break  # else the lease changed hands between our look and our take: look again
        log.info("learner lease of namespace %s taken (token %s, ttl %.0f s)", self.keys.ns, self.token, self.ttl_ms / 1000)
        self._thread = threading.Thread(target=self._keep, name="learner-lease", daemon=True)
        self._thread.start()
        return self

    def renew(self) -> bool:
        """Renew now; False (and :attr:`lost` set, ``on_lost`` run) when another learner took it."""
        res = int(self.link.call(lambda r: self._renew(keys=[self.keys.learner_lease, self.keys.learner_owner],
                                                       args=[self.token, self.ttl_ms, *self._fields()], client=r)))
        if res == 2:
            log.warning("learner lease of %s had expired (Redis away?) and nobody took it: taken back", self.keys.ns)
        if res == 0 and not self.lost.is_set():
            self.lost.set()
            log.error("learner lease of %s lost: another learner took the namespace; writing nothing more", self.keys.ns)
            if self.on_lost is not None:
                self.on_lost()
        return res != 0

    def check(self) -> None:
        """Raise :class:`LeaseLost` unless this learner still owns the namespace (a Redis read; call
        right before writing files that another learner would share). A missing owner key (Redis
        lost it) is accepted, as the fenced scripts accept it (:func:`fence_lua`)."""
        owner = self.link.call(lambda r: r.get(self.keys.learner_owner))
        if self.lost.is_set() or (owner is not None and owner.decode() != self.token):
            self.lost.set()
            raise LeaseLost(f"another learner took namespace {self.keys.ns!r} (owner {owner!r}, ours {self.token}): "
                            "this learner writes nothing more")

    def hset(self, key: str, mapping: dict) -> None:
        """HSET ``mapping`` into ``key`` only while this learner owns the namespace (else ``Fenced``)."""
        args = [x for kv in mapping.items() for x in (kv[0], str(kv[1]))]
        self.link.call(lambda r: self._hset(keys=[self.keys.learner_owner, key], args=[self.token, *args], client=r))

    def _keep(self) -> None:
        every = self.ttl_ms / 3000
        while not self._closing.wait(every):
            try:
                if not self.renew():
                    return
            except Exception as e:  # Redis away (renew retries) or asked to stop: the next round retries
                log.debug("learner lease renewal failed: %s", e)

    def close(self, release: bool = True) -> None:
        """Stop renewing; ``release`` hands the lease back at once (a clean stop)."""
        self._closing.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if release and self.token is not None and not self.lost.is_set():
            try:
                self.link.call(lambda r: self._release(keys=[self.keys.learner_lease, self.keys.learner_owner],
                                                       args=[self.token], client=r), should_stop=lambda: True)
            except Exception as e:  # Redis away: the lease expires by itself
                log.debug("learner lease not released: %s", e)
        self.link.close()
