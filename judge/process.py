"""``worldloop judge``: one judge worker of the pool.

Loop: read up to ``judge.batch_size`` trajectories from ``<ns>:rollouts`` (consumer group
``judges``; entries idle longer than ``redis.claim_idle_ms`` in a dead judge's pending list are
reclaimed first), score them concurrently on one asyncio loop (:class:`judge.scoring.TrajectoryScorer`,
LLM requests limited by ``judge.concurrency``), and hand each scored trajectory to ``<ns>:scored``
as soon as it is done. At most ``batch_size`` trajectories are held at once. Undecodable entries go
to the dead-letter stream (done by the consumer); a trajectory whose scoring raises is forwarded
with flagged fallback scores, so nothing stalls.

Exactly once into ``scored``. Forwarding is one Lua script, atomic in Redis::

    XACK rollouts judges <id>      -- 0: another judge already finished this entry -> drop ours
    XDEL rollouts <id>
    ZADD NX <ns>:judge:forwarded <now> <trajectory_id>   -- 0: this trajectory id was forwarded
                                                         --    already (an actor's duplicate) -> drop
    XADD scored * data <payload>

A judge that dies before the script ran left the entry pending: another judge reclaims and
forwards it. A judge that dies after it ran has nothing left to do. Two judges holding the same
entry (a slow judge whose entry was reclaimed) both run the script, but only the first XACK
removes it from the pending list, so only one XADD happens. (A live judge refreshes the idle time
of the entries it works on every ``claim_idle_ms / 3``, so a slow endpoint does not make other
judges reclaim live work; a dead judge refreshes nothing.) A reply lost to a connection error is
retried: the retry finds the entry acked and adds nothing. The id set forgets ids older than
``judge.dedup_window_s``. The scored stream's backpressure (``redis.max_backlog`` undelivered
entries) is waited for before the script runs.

Process conventions: Prometheus ``/metrics`` (``metrics.*``), a heartbeat in ``<ns>:procs`` every
2 s, run-wide counters ``judge_failures`` (failed LLM attempts) and ``judge_fallbacks`` in
``<ns>:stats``, new work paused while the control record says ``paused``, a clean stop (exit 0) on
SIGTERM/SIGINT or ``stopped``: no new reads, the trajectories in flight get
``STOP_GRACE_S`` to finish; any left unfinished stay pending and are reclaimed by another judge.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common.config import Config, ConfigError
from common.control import ROLLOUTS_GROUP, Keys, default_proc_id, read_control, register_process, stats_incr
from common.metrics import metric, serve_metrics
from common.schemas import SchemaError, decode_trajectory, encode_trajectory
from common.streams import DATA_FIELD, Message, RedisLink, StreamConsumer, StreamProducer, connect
from judge.llm import LLMClient, api_key_from_env
from judge.scoring import TrajectoryScorer, fallback_trajectory, needs_llm

log = logging.getLogger(__name__)

HEARTBEAT_S = 2.0
CONTROL_POLL_S = 0.5
STOP_GRACE_S = 10.0
BUSY_BLOCK_MS = 50  # XREADGROUP block while trajectories are in flight (they need the loop)

FORWARD_LUA = """
local acked = redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
if acked == 0 then return 0 end
redis.call('XDEL', KEYS[1], ARGV[2])
local now = tonumber(ARGV[5])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - tonumber(ARGV[6]))
if redis.call('ZADD', KEYS[3], 'NX', now, ARGV[4]) == 0 then return -1 end
redis.call('XADD', KEYS[2], '*', ARGV[7], ARGV[3])
return 1
"""
FORWARDED, LOST_RACE, DUPLICATE = 1, 0, -1


def forwarded_ids_key(keys: Keys) -> str:
    """Sorted set of trajectory ids already forwarded to ``scored`` (score: time forwarded)."""
    return f"{keys.ns}:judge:forwarded"


class Forwarder:
    """The atomic ack-and-forward of one scored trajectory (see the module docstring)."""

    def __init__(self, url: str, keys: Keys, *, max_backlog: int, dedup_window_s: float,
                 reconnect_max_s: float = 30.0, socket_timeout_s: float = 10.0):
        self.keys = keys
        self.dedup_window_s = dedup_window_s
        self.link = RedisLink(url, keys.scored, reconnect_max_s, socket_timeout_s)
        self.producer = StreamProducer(url, keys.scored, max_backlog, reconnect_max_s=reconnect_max_s,
                                       socket_timeout_s=socket_timeout_s)
        self._m_produced = metric("worldloop_stream_produced_messages").labels(stream=keys.scored)
        self._m_bytes = metric("worldloop_stream_produced_bytes").labels(stream=keys.scored)
        self._m_acked = metric("worldloop_stream_acked_messages").labels(stream=keys.rollouts)

    def forward(self, entry_id: str, payload: bytes, trajectory_id: str, should_stop=lambda: False) -> int | None:
        """Run the script; FORWARDED, LOST_RACE or DUPLICATE, or None when abandoned on stop."""
        if not self.producer.wait_for_room(should_stop=should_stop):
            return None

        def run(r) -> int:
            return int(r.register_script(FORWARD_LUA)(
                keys=[self.keys.rollouts, self.keys.scored, forwarded_ids_key(self.keys)],
                args=[ROLLOUTS_GROUP, entry_id, payload, trajectory_id, time.time(), self.dedup_window_s, DATA_FIELD]))

        try:
            status = self.link.call(run, should_stop=should_stop)  # reconnects with backoff meanwhile
        except (RedisConnectionError, RedisTimeoutError):
            return None  # asked to stop while Redis is away: still pending, another judge (or our restart) reclaims it
        if status != LOST_RACE:
            self._m_acked.inc()
        if status == FORWARDED:
            self._m_produced.inc()
            self._m_bytes.inc(len(payload))
        return status

    def close(self) -> None:
        self.producer.close()
        self.link.close()


class JudgeWorker:
    """One judge process's state; :meth:`run` blocks until stopped."""

    def __init__(self, cfg: Config, proc_id: str | None = None):
        if not cfg.redis.url:
            raise ConfigError("redis.url", "the judge needs a Redis URL (redis.url is null)")
        if needs_llm(cfg.judge) and not cfg.judge.base_url and not api_key_from_env(cfg.judge)[1]:
            raise ConfigError("judge.base_url", f"the llm/hybrid scorers need judge.base_url (an OpenAI-compatible "
                                                f"endpoint) or ${cfg.judge.api_key_env} for the default one")
        self.cfg = cfg
        self.keys = Keys(cfg.redis.namespace)
        self.proc_id = proc_id or f"judge-{default_proc_id()}"
        self.stop_event = threading.Event()
        self.metrics_port: int | None = None
        self._pool = ThreadPoolExecutor(max_workers=cfg.judge.batch_size + 2, thread_name_prefix="judge-io")
        self._sent = {"judge_failures": 0, "judge_fallbacks": 0}
        self.scorer: TrajectoryScorer | None = None
        self.llm: LLMClient | None = None
        self.forwarded = 0
        self._held: dict[asyncio.Task, str] = {}

    def stop(self, *_args) -> None:
        self.stop_event.set()

    # ------------------------------------------------------------------ entry

    def run(self) -> int:
        cfg = self.cfg
        if not cfg.judge.enabled:
            log.warning("judge.enabled is false: actors write straight to %s and nothing will arrive here",
                        self.keys.scored)
        if cfg.metrics.enabled:
            self.metrics_port = serve_metrics("judge", cfg.metrics.host, cfg.metrics.port)
        r = connect(cfg.redis.url, cfg.redis.socket_timeout_s)
        consumer = StreamConsumer(cfg.redis.url, self.keys.rollouts, ROLLOUTS_GROUP, self.proc_id,
                                  decode=decode_trajectory, deadletter_stream=self.keys.deadletter,
                                  block_ms=cfg.redis.block_ms, claim_idle_ms=cfg.redis.claim_idle_ms,
                                  reconnect_max_s=cfg.redis.reconnect_max_s,
                                  socket_timeout_s=cfg.redis.socket_timeout_s)
        forwarder = Forwarder(cfg.redis.url, self.keys, max_backlog=cfg.redis.max_backlog,
                              dedup_window_s=cfg.judge.dedup_window_s, reconnect_max_s=cfg.redis.reconnect_max_s,
                              socket_timeout_s=cfg.redis.socket_timeout_s)
        heartbeat = threading.Thread(target=self._heartbeat, args=(r,), name="judge-heartbeat", daemon=True)
        heartbeat.start()
        log.info("judge %s: %s -> %s, scorers %s, concurrency %d", self.proc_id, self.keys.rollouts,
                 self.keys.scored, cfg.judge.scorers, cfg.judge.concurrency)
        try:
            asyncio.run(self._main(consumer, forwarder, r))
        finally:
            self.stop_event.set()
            heartbeat.join(timeout=HEARTBEAT_S + 1)
            self._flush_stats(r)
            consumer.close()
            forwarder.close()
            self._pool.shutdown(wait=False, cancel_futures=True)
            r.close()
        log.info("judge %s stopped after forwarding %d trajectories", self.proc_id, self.forwarded)
        return 0

    # ------------------------------------------------------------------ the loop

    async def _main(self, consumer: StreamConsumer, forwarder: Forwarder, r) -> None:
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        self.llm = LLMClient(cfg.judge) if needs_llm(cfg.judge) else None
        self.scorer = TrajectoryScorer(cfg.judge, self.llm)
        inflight: set[asyncio.Task] = set()
        self._held = {}  # task -> the rollouts entry id it works on
        run_state, checked, touched = "running", 0.0, time.monotonic()
        touch_every = max(0.05, cfg.redis.claim_idle_ms / 3000)
        try:
            while not self.stop_event.is_set():
                if time.monotonic() - checked >= CONTROL_POLL_S:
                    checked = time.monotonic()
                    run_state = await self._io(loop, _run_state, r, self.keys, run_state)
                if self._held and time.monotonic() - touched >= touch_every:
                    touched = time.monotonic()
                    await self._io(loop, touch_pending, r, self.keys, self.proc_id, list(self._held.values()))
                if run_state == "stopped":
                    log.info("judge %s: run_state is stopped", self.proc_id)
                    break
                room = cfg.judge.batch_size - len(inflight)
                if run_state == "paused" or room <= 0:
                    inflight = await _wait_some(inflight, 0.2)
                    continue
                block = BUSY_BLOCK_MS if inflight else min(cfg.redis.block_ms, 1000)
                msgs = await self._io(loop, consumer.read, room, block)
                for m in msgs:
                    task = asyncio.create_task(self._handle(m, consumer, forwarder))
                    task.add_done_callback(self._held.pop)
                    self._held[task] = m.id
                    inflight.add(task)
                inflight = await _wait_some(inflight, 0)
            if inflight:
                log.info("judge %s: stopping, %d trajectories in flight", self.proc_id, len(inflight))
                done, pending = await asyncio.wait(inflight, timeout=STOP_GRACE_S)
                for t in pending:  # abandoned: not acked, another judge reclaims them
                    t.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
        finally:
            if self.llm is not None:
                await self.llm.close()

    async def _io(self, loop, fn, *args):
        return await loop.run_in_executor(self._pool, fn, *args)

    async def _handle(self, msg: Message, consumer: StreamConsumer, forwarder: Forwarder) -> None:
        loop = asyncio.get_running_loop()
        traj = msg.value
        tid = str(traj.get("trajectory_id"))
        try:
            scored = await self.scorer.score(traj)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a scorer bug must not stall the trajectory: forward it flagged
            log.exception("judge %s: scoring trajectory %s failed; forwarding fallback scores", self.proc_id, tid)
            scored = fallback_trajectory(decode_trajectory(msg.payload), self.cfg.judge,
                                         f"scorer error: {type(e).__name__}: {e}")
            self.scorer.fallbacks += 1
            metric("worldloop_judge_fallbacks").inc()
        try:
            payload = encode_trajectory(scored)
        except SchemaError as e:
            await self._io(loop, consumer.deadletter, msg, f"scored trajectory is invalid: {e}")
            return
        status = await self._io(loop, forwarder.forward, msg.id, payload, tid, self.stop_event.is_set)
        if status == FORWARDED:
            self.forwarded += 1
            metric("worldloop_judge_trajectories").inc()
        elif status == LOST_RACE:
            log.info("judge %s: entry %s (%s) was finished by another judge; dropped ours", self.proc_id, msg.id, tid)
        elif status == DUPLICATE:
            log.info("judge %s: trajectory %s was already forwarded; acked the duplicate entry %s",
                     self.proc_id, tid, msg.id)

    # ------------------------------------------------------------------ heartbeat and stats

    def _heartbeat(self, r) -> None:
        while True:
            try:
                register_process(r, self.keys, "judge", self.proc_id, self.metrics_port, self.cfg.metrics.host)
                self._flush_stats(r)
            except (RedisConnectionError, RedisTimeoutError) as e:
                log.warning("judge %s: heartbeat failed: %s", self.proc_id, e)
            if self.stop_event.wait(HEARTBEAT_S):
                return

    def _flush_stats(self, r) -> None:
        now = {"judge_failures": self.llm.failures if self.llm else 0,
               "judge_fallbacks": self.scorer.fallbacks if self.scorer else 0}
        for name, value in now.items():
            delta = value - self._sent[name]
            if delta > 0:
                try:
                    stats_incr(r, self.keys, name, delta)
                    self._sent[name] = value
                except (RedisConnectionError, RedisTimeoutError):
                    return


def touch_pending(r, keys: Keys, consumer: str, ids: list[str]) -> int:
    """Reset the idle time of the entries this judge is still working on (XCLAIM to itself), so
    that a slow endpoint does not make other judges reclaim live work; only entries still pending
    for ``consumer`` are touched. A dead judge touches nothing and its entries go idle."""
    if not ids:
        return 0
    try:
        mine = {row["message_id"].decode() for row in r.xpending_range(
            keys.rollouts, ROLLOUTS_GROUP, min="-", max="+", count=len(ids) + 1000, consumername=consumer)}
        keep = [i for i in ids if i in mine]
        if keep:
            r.xclaim(keys.rollouts, ROLLOUTS_GROUP, consumer, 0, keep, justid=True)
        return len(keep)
    except (RedisConnectionError, RedisTimeoutError) as e:
        log.warning("judge %s: could not refresh pending entries: %s", consumer, e)
        return 0


def _run_state(r, keys: Keys, previous: str) -> str:
    try:
        return read_control(r, keys)["run_state"]
    except (RedisConnectionError, RedisTimeoutError):
        return previous


async def _wait_some(tasks: set[asyncio.Task], timeout: float) -> set[asyncio.Task]:
    """Wait up to ``timeout`` for any task; return the unfinished ones (finished ones re-raise bugs)."""
    if not tasks:
        if timeout:
            await asyncio.sleep(timeout)
        return tasks
    done, pending = await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    for t in done:
        if not t.cancelled() and t.exception() is not None:
            raise t.exception()
    return pending


def run(cfg: Config, args: argparse.Namespace | None = None) -> int:
    """CLI entry of ``worldloop judge``: run until SIGTERM/SIGINT or run_state ``stopped``."""
    worker = JudgeWorker(cfg)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, worker.stop)
        signal.signal(signal.SIGINT, worker.stop)
    return worker.run()
