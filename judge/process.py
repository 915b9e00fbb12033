"""``worldloop judge``: one judge worker of the pool.

Loop: read up to ``judge.batch_size`` trajectories from ``{ns}:rollouts`` (consumer group
``judges``; entries idle longer than ``redis.claim_idle_ms`` in a dead judge's pending list are
reclaimed first), score them concurrently on one asyncio loop (:class:`worldloop.judge.scoring.TrajectoryScorer`,
LLM requests limited by ``judge.concurrency``), and hand each scored trajectory to ``{ns}:scored``
as soon as it is done. At most ``batch_size`` trajectories are held at once. Undecodable or
oversized entries go to the dead-letter stream (done by the consumer); a trajectory whose scoring
raises is forwarded with flagged fallback scores, so nothing stalls. Any other error on one entry
(an I/O error, a bug) leaves it pending and the judge carries on; an entry delivered
``redis.max_deliveries`` times (each judge that took it died or gave up) is dead-lettered as
``poison``. A reclaimed entry runs alone (nothing else in flight beside it, one at a time), so a
poison entry that kills its judge counts an attempt against no other entry; an entry reclaimed
and not yet started counts none. Whatever a judge dead-letters gives its admission budget back.

Exactly once into ``scored``: each scored trajectory is handed over with
:class:`worldloop.common.transport.streams.Forwarder` (XACK + XDEL of the rollouts entry, a trajectory-id
dedup set ``{ns}:judge:forwarded`` and the XADD to ``scored``, in one Lua script; see there). A
live judge refreshes the idle time of the entries it works on every ``claim_idle_ms / 3``
(:meth:`StreamConsumer.touch`), so a slow endpoint does not make other judges reclaim live work;
a dead judge refreshes nothing and its entries are reclaimed.

Process conventions (:class:`worldloop.common.transport.process.ProcessScaffold`): Prometheus ``/metrics``
(``metrics.*``), a heartbeat in ``{ns}:procs`` every 2 s with the current phase, run-wide counters ``judge_failures`` (failed LLM attempts) and ``judge_fallbacks`` in
``{ns}:stats``, new work paused while the control record says ``paused``, a clean stop (exit 0) on
SIGTERM/SIGINT or ``stopped``: no new reads, the trajectories in flight get
``STOP_GRACE_S`` to finish; any left unfinished stay pending and are reclaimed by another judge.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from worldloop.common.transport.admission import Admission
from worldloop.common.contracts.config import Config, ConfigError
from worldloop.common.transport.control import default_proc_id, stats_incr
from worldloop.common.faults import crash_if_poison
from worldloop.common.contracts.keys import ROLLOUTS_GROUP, Keys
from worldloop.common.metrics import metric
from worldloop.common.transport.process import HEARTBEAT_S, ProcessScaffold
from worldloop.common.contracts.schemas import SchemaError, decode_trajectory, encode_trajectory
from worldloop.common.transport.stream_consumer import consumer_limits
from worldloop.common.transport.streams import DUPLICATE, FORWARDED, LOST_RACE, Forwarder, Message, StreamConsumer, connect
from worldloop.judge.llm import LLMClient, api_key_from_env
from worldloop.judge.scoring import TrajectoryScorer, fallback_trajectory, needs_llm

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0
PRUNE_EVERY_S = 60.0
PRUNE_IDLE_MS = 300_000  # a consumer idle this long (and 10x claim_idle_ms) holding nothing is gone
BUSY_BLOCK_MS = 50  # XREADGROUP block while trajectories are in flight (they need the loop)

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
        self.proc = ProcessScaffold(cfg, "judge", self.proc_id,
                                    stop_message="no new reads; finishing the trajectories in flight")
        self.stop_event = self.proc.stop
        self._pool = ThreadPoolExecutor(max_workers=cfg.judge.batch_size + 2, thread_name_prefix="judge-io")
        self._sent = {"judge_failures": 0, "judge_fallbacks": 0}
        self.scorer: TrajectoryScorer | None = None
        self.llm: LLMClient | None = None
        self.forwarded = 0
        self._held: dict[asyncio.Task, str] = {}

    def stop(self, *_args) -> None:
        self.proc.request_stop()

    @property
    def metrics_port(self) -> int | None:
        return self.proc.metrics_port

    # ------------------------------------------------------------------ entry

    def run(self) -> int:
        cfg = self.cfg
        if not cfg.judge.enabled:
            log.warning("judge.enabled is false: actors write straight to %s and nothing will arrive here",
                        self.keys.scored)
        links = dict(reconnect_max_s=cfg.redis.reconnect_max_s, socket_timeout_s=cfg.redis.socket_timeout_s,
                     should_stop=self.stop_event.is_set, startup_timeout_s=cfg.redis.startup_timeout_s)
        consumer = forwarder = r = admission = None
        with self.proc:
            self.proc.ready()
            try:
                if cfg.actor.admission:  # what the judge dead-letters gives its admission budget back
                    admission = Admission(cfg.redis.url, self.keys, max_staleness=cfg.trainer.max_staleness,
                                          batch_size=cfg.trainer.train_batch_size, **links)
                consumer = StreamConsumer(cfg.redis.url, self.keys.rollouts, ROLLOUTS_GROUP, self.proc_id,
                                          decode=decode_trajectory, deadletter_stream=self.keys.deadletter,
                                          block_ms=cfg.redis.block_ms, claim_idle_ms=cfg.redis.claim_idle_ms,
                                          stats_key=self.keys.stats, **consumer_limits(cfg.redis),
                                          max_deliveries=cfg.redis.max_deliveries,
                                          on_deadletter=admission.refund_payload if admission else None,
                                          **links)  # dead letters counted run-wide
                forwarder = Forwarder(cfg.redis.url, self.keys.rollouts, ROLLOUTS_GROUP, self.keys.scored,
                                      self.keys.judge_forwarded, max_backlog=cfg.redis.max_backlog,
                                      dedup_window_s=cfg.judge.dedup_window_s, **links)
                r = connect(cfg.redis.url, cfg.redis.socket_timeout_s)
                log.info("judge %s: %s -> %s, scorers %s, concurrency %d", self.proc_id, self.keys.rollouts,
                         self.keys.scored, cfg.judge.scorers, cfg.judge.concurrency)
                asyncio.run(self._main(consumer, forwarder, r))
            except (RedisConnectionError, RedisTimeoutError):
                if not self.stop_event.is_set():
                    raise
                log.info("judge %s: stopped while Redis is unreachable", self.proc_id)
            finally:
                self.stop_event.set()
                if r is not None:
                    self._flush_stats(r)
                if consumer is not None and not self._held:
                    consumer.leave()  # nothing pending: the group no longer lists this judge
                for obj in (consumer, forwarder, r, admission):
                    if obj is not None:
                        obj.close()
                self._pool.shutdown(wait=False, cancel_futures=True)
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
        # entries reclaimed (their consumer died or gave up on them): each runs alone, so a poison
        # entry that kills the process counts no attempt against any other entry
        self._quarantine: list[Message] = []
        self._alone: set[asyncio.Task] = set()
        timers = {"touched": time.monotonic(), "flushed": time.monotonic(), "pruned": 0.0}
        try:
            while not self.proc.should_stop():
                await self._housekeeping(loop, consumer, r, timers)
                room = cfg.judge.batch_size - len(inflight)
                self.proc.set_phase("paused" if self.proc.paused else "scoring" if inflight else "waiting for rollouts",
                                    in_flight=len(inflight), forwarded=self.forwarded)
                if not self.proc.paused and self._quarantine and not inflight:
                    task = self._start(self._quarantine.pop(0), consumer, forwarder)
                    self._alone.add(task)
                    inflight.add(task)
                if self.proc.paused or room <= 0 or self._quarantine or self._alone & inflight:
                    inflight = await _wait_some(inflight, 0.2)
                    continue
                block = BUSY_BLOCK_MS if inflight else min(cfg.redis.block_ms, 1000)
                for m in await self._io(loop, consumer.read, room, block):
                    if m.reclaimed:
                        self._quarantine.append(m)
                    else:
                        inflight.add(self._start(m, consumer, forwarder))
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

    def _start(self, m: Message, consumer: StreamConsumer, forwarder: Forwarder) -> asyncio.Task:
        task = asyncio.create_task(self._handle(m, consumer, forwarder))
        task.add_done_callback(self._held.pop)
        task.add_done_callback(self._alone.discard)
        self._held[task] = m.id
        return task

    async def _housekeeping(self, loop, consumer: StreamConsumer, r, timers: dict[str, float]) -> None:
        """Refresh the idle time of the entries held (in flight or quarantined), flush the run-wide
        counters, prune dead judges' names: each when it is due."""
        now = time.monotonic()
        held = [*self._held.values(), *(m.id for m in self._quarantine)]
        if held and now - timers["touched"] >= max(0.05, self.cfg.redis.claim_idle_ms / 3000):
            timers["touched"] = now
            await self._io(loop, consumer.touch, held)
        if now - timers["flushed"] >= HEARTBEAT_S:
            timers["flushed"] = now
            await self._io(loop, self._flush_stats, r)
        if now - timers["pruned"] >= PRUNE_EVERY_S:
            timers["pruned"] = now  # dead judges' names, once they hold nothing
            await self._io(loop, consumer.prune_consumers, max(PRUNE_IDLE_MS, 10 * self.cfg.redis.claim_idle_ms))

    async def _io(self, loop, fn, *args):
        return await loop.run_in_executor(self._pool, fn, *args)

    async def _handle(self, msg: Message, consumer: StreamConsumer, forwarder: Forwarder) -> None:
        """Score and forward one entry. Nothing that goes wrong with one entry ends the judge: the
        entry stays pending, is reclaimed after ``redis.claim_idle_ms`` and, delivered
        ``redis.max_deliveries`` times, dead-lettered (its admission budget given back)."""
        try:
            if await self._io(asyncio.get_running_loop(), consumer.attempt, msg):  # else dead-lettered: poison
                await self._score_and_forward(msg, consumer, forwarder)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # an I/O error or a bug on this entry: left pending, never fatal
            metric("worldloop_judge_abandoned_entries").inc()
            log.exception("judge %s: entry %s (delivery %d) failed: %s: %s; left pending for a retry", self.proc_id,
                          msg.id, msg.deliveries, type(e).__name__, e)

    async def _score_and_forward(self, msg: Message, consumer: StreamConsumer, forwarder: Forwarder) -> None:
        loop = asyncio.get_running_loop()
        traj = msg.value
        tid = traj.trajectory_id
        crash_if_poison(tid)  # the chaos soak's poison entry (common/faults.py); a no-op otherwise
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

    # ------------------------------------------------------------------ stats

    def _flush_stats(self, r) -> None:
        """Add the counts not yet sent to the run-wide counters. Never raises: it also runs in
        :meth:`run`'s ``finally``, where an error (Redis away, or refusing writes) would replace the
        one that ended the judge; what was not sent goes out with a later flush."""
        now = {"judge_failures": self.llm.failures if self.llm else 0,
               "judge_fallbacks": self.scorer.fallbacks if self.scorer else 0}
        for name, value in now.items():
            delta = value - self._sent[name]
            if delta > 0:
                try:
                    stats_incr(r, self.keys, name, delta)
                    self._sent[name] = value
                except RedisError as e:
                    log.warning("judge %s: run-wide counters not sent yet: %s", self.proc_id, e)
                    return


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
    return JudgeWorker(cfg).run()
