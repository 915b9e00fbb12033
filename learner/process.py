"""``worldloop learner``: the training loop (read ``scored``, PPO update, publish, checkpoint).

Public API::

    run(cfg, args) -> int          # the CLI entry point (exit 0 after trainer.total_steps updates)
    Learner(cfg, dist)             # the loop as an object (tests drive it step by step)
        .step() -> dict | None     # one update: collect a batch, train, publish, maybe checkpoint
        .run_loop() -> int, .close()

Launching::

    worldloop learner --config X [key=value ...]                        # one process: CPU (gloo) or cuda:0
    torchrun --nproc_per_node N -m common.cli learner --config X        # N data-parallel ranks
    deepspeed --no_local_rank --num_gpus N --module common.cli learner --config X

(the CLI also accepts and ignores DeepSpeed's ``--local_rank`` argument, so ``--no_local_rank`` is optional: the rank comes
from the environment.) One learner per Redis namespace: it reads as the fixed consumer
``learner-0``.

Each update (policy version v -> v + 1):

1. rank 0 collects ``train_batch_size`` usable trajectories from ``scored`` (see
   ``learner/data.py``: validation, dedup by trajectory id, staleness drops, dead letters) and
   broadcasts them to the other ranks;
2. ``learner/trainer.py`` runs one PPO iteration over the batch;
3. the version is bumped, the policy is published on the ZeroMQ weight channel (gathered from
   ZeRO-3 shards when sharded) under the actor model's ``state_dict()`` names, and the control
   hash gets ``policy_version`` and ``max_turns`` (WMAct annealing every ``anneal_every`` updates
   when ``anneal_max_turns``);
4. one JSON line goes to ``<run_dir>/metrics.jsonl`` (read by ``worldloop up``), the trained
   trajectory ids to ``<run_dir>/learner_ledger.jsonl``, one log line to the log;
5. every ``checkpoint_every`` updates (and early when the entries held pending pass
   ``trainer.max_pending_mb``, and at the end) a checkpoint is written (``learner/checkpoint.py``)
   and only then are the stream entries it covers acked.

``run_dir`` is ``run.run_dir``, or ``runs/<run.name>`` when that is null (a stable folder, so that
``--resume`` finds the checkpoints). ``--resume`` (or ``trainer.resume``) continues from the newest
complete checkpoint with the same version sequence; without a checkpoint it starts fresh. After a
kill -9 the restarted learner re-reads the entries the dead one held pending; ``metrics.jsonl``
and the ledger keep the lines of the lost updates, and the re-done steps are appended after them
(the last line of a step wins).

Stops cleanly (finishes the update in progress, checkpoints, acks, exit 0) on SIGTERM/SIGINT and
when the control record's ``run_state`` is ``stopped``; reads nothing new while it is ``paused``.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading
import time
from pathlib import Path

import torch

from common.config import Config, ConfigError
from common.control import Keys, default_proc_id, read_control, register_process, write_control
from common.metrics import metric, serve_metrics
from common.streams import connect
from learner import checkpoint
from learner.data import DedupWindow, ScoredSource, check_pending_fits, decode_batch, encode_batch
from learner.engine import DistInfo, all_reduce_sum, broadcast_bytes, build_models, gather_policy_weights, init_distributed
from learner.rewards import anneal_max_turns
from learner.trainer import PPOTrainer, batch_reward_stats

log = logging.getLogger("worldloop.learner")

_HEARTBEAT_S = 2.0
_CONTROL_POLL_S = 1.0
_MULTI_RANK_WAIT_S = 30.0  # rank 0 tells the others "still waiting" this often


def run_dir_of(cfg: Config) -> Path:
    return Path(cfg.run.run_dir) if cfg.run.run_dir else Path("runs") / cfg.run.name


class Learner:
    """The learner loop of one rank; rank 0 also owns Redis, the weight publisher and the files."""

    def __init__(self, cfg: Config, dist: DistInfo):
        if cfg.redis.url is None:  # fail before minutes of model loading
            raise ConfigError("redis.url", "the learner needs a Redis URL (worldloop up passes its own)")
        self.cfg = cfg
        self.t = cfg.trainer
        self.dist = dist
        self.run_dir = run_dir_of(cfg)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.stop_requested = False
        self._closing = threading.Event()
        self._control_at = 0.0
        self._run_state = "running"
        self.r = self.source = self.publisher = None
        self._heartbeat = None
        self.metrics_port = None

        torch.manual_seed(cfg.run.seed)
        self.models = build_models(cfg, dist)
        self.step_no = 0
        self.version = 0
        self.max_turns = cfg.actor.max_turns
        self.anneal_window: list[int] = []
        trained: dict[str, int] = {}
        if self.t.resume:
            path = checkpoint.latest(self.ckpt_dir)
            if path is None:
                log.info("trainer.resume: no complete checkpoint in %s; starting fresh", self.ckpt_dir)
            else:
                st = checkpoint.load(self.models, path)
                self.step_no, self.version = int(st["step"]), int(st["policy_version"])
                self.max_turns = int(st.get("max_turns") or self.max_turns)
                self.anneal_window = [int(x) for x in st.get("anneal_window", [])]
                trained = {str(k): int(v) for k, v in st.get("trained", {}).items()}
        elif checkpoint.latest(self.ckpt_dir) is not None:
            log.warning("%s holds checkpoints but trainer.resume is off: starting fresh, they will be overwritten", self.ckpt_dir)
        self.ckpt_step, self.ckpt_version = self.step_no, self.version
        self.dedup = DedupWindow(self.t.max_staleness, trained)
        self.trainer = PPOTrainer(cfg, self.models, seed=cfg.run.seed)
        if dist.is_main:
            self._start_main()
        self._publish()
        if dist.is_main:
            self._write_control()

    # ------------------------------------------------------------------ rank 0 services

    def _start_main(self) -> None:
        from common.weights import publisher_from_config

        cfg = self.cfg
        self.keys = Keys(cfg.redis.namespace)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.source = ScoredSource(
            cfg, self.keys, vocab_size=self.models.vocab_size, codec=self.models.codec,
            version_fn=lambda: self.version, checkpoint_version_fn=lambda: self.ckpt_version, dedup=self.dedup,
        )
        self.r = connect(cfg.redis.url, cfg.redis.socket_timeout_s)
        check_pending_fits(cfg, self.r)
        if cfg.metrics.enabled:
            self.metrics_port = serve_metrics("learner", cfg.metrics.host, cfg.metrics.port)
        self.proc_id = default_proc_id()
        register_process(self.r, self.keys, "learner", self.proc_id, self.metrics_port, host=cfg.metrics.host)
        self._heartbeat = threading.Thread(target=self._beat, name="learner-heartbeat", daemon=True)
        self._heartbeat.start()
        self.source.recover()
        self.publisher = publisher_from_config(cfg)
        metric("worldloop_learner_max_turns").set(self.max_turns)

    def _beat(self) -> None:
        while not self._closing.wait(_HEARTBEAT_S):
            try:
                register_process(self.r, self.keys, "learner", self.proc_id, self.metrics_port, host=self.cfg.metrics.host)
            except Exception as e:  # Redis away for a moment: the next beat retries
                log.debug("heartbeat failed: %s", e)

    def _control_state(self) -> str:
        now = time.monotonic()
        if now - self._control_at >= _CONTROL_POLL_S:
            self._control_at = now
            try:
                self._run_state = read_control(self.r, self.keys)["run_state"]
            except Exception as e:  # keep the last known state while Redis is away
                log.debug("control read failed: %s", e)
        return self._run_state

    def _should_stop(self) -> bool:
        if self.stop_requested:
            return True
        if self._control_state() == "stopped":
            log.info("control run_state is 'stopped': stopping")
            self.stop_requested = True
        return self.stop_requested

    def _write_control(self) -> None:
        write_control(self.r, self.keys, policy_version=self.version, max_turns=self.max_turns)

    # ------------------------------------------------------------------ steps

    def _publish(self) -> tuple[dict, float]:
        t0 = time.perf_counter()
        weights = gather_policy_weights(self.models)
        if self.dist.is_main:
            self.publisher.publish(weights, self.version)
        return weights, time.perf_counter() - t0

    def _next_batch(self):
        """(items on rank 0, trajectories, stop) — the same trajectories and stop on every rank."""
        items = None
        if self.dist.is_main:
            items = self.source.collect(
                self.t.train_batch_size, self._should_stop, paused=lambda: self._control_state() == "paused",
                max_wait_s=_MULTI_RANK_WAIT_S if self.dist.world_size > 1 else None,
            )
        if self.dist.world_size == 1:
            return items, [it.traj for it in items or []], items is None
        data = broadcast_bytes(encode_batch(items or [], stop=items is None) if self.dist.is_main else None, self.dist)
        stop, trajs = decode_batch(data)
        return items, trajs, stop

    def step(self) -> dict | None:
        """One update; None when a stop was requested (or, multi-rank, no batch came in time)."""
        t_start = time.perf_counter()
        items, trajs, stop = self._next_batch()
        if stop:
            self.stop_requested = True
            return None
        if not trajs:
            return None
        wait_s = time.perf_counter() - t_start
        before = self.version
        stats = self.trainer.update(trajs, self.step_no)
        self.step_no += 1
        self.version += 1
        weights, publish_s = self._publish()
        record = None
        if self.dist.is_main:
            self.source.mark_trained(items)
            self.dedup.prune(self.version)
            record = self._after_update(trajs, before, stats, wait_s, publish_s)
        t0 = time.perf_counter()
        if self._checkpoint_due():
            self.save_checkpoint(weights)
        if record is not None:
            record["step_seconds"]["checkpoint"] = time.perf_counter() - t0
            record["pending_entries"] = self.source.held_count
            self._write_record(record, items)
        return record if record is not None else stats

    def _checkpoint_due(self) -> bool:
        due = 0.0
        if self.dist.is_main:
            due = float(
                self.step_no % self.t.checkpoint_every == 0
                or self.step_no >= self.t.total_steps
                or self.source.held_bytes >= self.t.max_pending_mb * 2**20
            )
        if self.dist.world_size > 1:
            due = all_reduce_sum([due], self.dist)[0]
        return due > 0

    def save_checkpoint(self, weights: dict | None = None) -> None:
        """Write a checkpoint of the current step (every rank), then (rank 0) ack what it covers."""
        if weights is None:
            weights = gather_policy_weights(self.models)
        state = {"step": self.step_no, "policy_version": self.version, "max_turns": self.max_turns,
                 "anneal_window": self.anneal_window, "trained": self.dedup.to_dict()}
        checkpoint.save(self.models, self.ckpt_dir, state, weights=weights if self.dist.is_main else None,
                        model_dir=self.cfg.model.path, keep=self.t.keep_checkpoints)
        self.ckpt_step, self.ckpt_version = self.step_no, self.version
        if self.dist.is_main:
            metric("worldloop_learner_checkpoints").inc()
            n = self.source.ack_held()
            log.info("checkpoint at step %d: acked %d stream entries", self.step_no, n)

    def _after_update(self, trajs: list[dict], before: int, stats: dict, wait_s: float, publish_s: float) -> dict:
        t = self.t
        rs = batch_reward_stats(trajs, t.wmact_rescale)
        if t.anneal_max_turns:
            self.anneal_window.extend(rs["turns"])
            if self.step_no % t.anneal_every == 0:
                new = anneal_max_turns(self.max_turns, self.anneal_window)
                if new != self.max_turns:
                    log.info("WMAct annealing: max_turns %d -> %d", self.max_turns, new)
                self.max_turns, self.anneal_window = new, []
        self._write_control()
        lags = [before - min(int(x["policy_version"]) for x in tr["turns"]) for tr in trajs]
        compute_s = stats["forward_seconds"] + stats["backward_seconds"]
        busy = compute_s + publish_s
        record = {
            "step": self.step_no,
            "policy_version": self.version,
            "time": time.time(),
            "trajectories": len(trajs),
            "losses": {"policy": stats.get("policy_loss"), "value": stats.get("value_loss"),
                       "entropy": stats.get("policy_entropy"), "kl": stats.get("policy_kl_loss")},
            "kl": stats["kl"],
            "entropy": stats.get("policy_entropy"),
            "clip_fraction": stats.get("policy_clip_fraction"),
            "approx_kl": stats.get("policy_approx_kl"),
            "value_clip_fraction": stats.get("value_clip_fraction"),
            "explained_variance": stats.get("value_explained_variance"),
            "advantage": {k: stats[f"advantage_{k}"] for k in ("mean", "std", "max", "min")},
            "return_mean": stats["return_mean"],
            "importance_weight": {"mean": stats.get("policy_iw_mean"), "max": stats.get("policy_iw_max"),
                                  "min": stats.get("policy_iw_min"),
                                  "truncated_fraction": stats.get("policy_iw_truncated_fraction")},
            "ratio": {"mean": stats.get("policy_ratio_mean"), "max": stats.get("policy_ratio_max"),
                      "min": stats.get("policy_ratio_min")},
            "grad_norm": {k[len("grad_norm_"):]: v for k, v in stats.items() if k.startswith("grad_norm_")},
            "reward": rs["reward"],
            "success_rate": rs["success_rate"],
            "staleness_mean": sum(lags) / len(lags),
            "staleness_max": max(lags),
            "dropped": dict(self.source.dropped),
            "pending_entries": self.source.held_count,
            "tokens": stats["tokens"],
            "response_tokens": stats["response_tokens"],
            "tokens_per_s": stats["tokens"] / busy if busy > 0 else None,
            "step_seconds": {"wait": wait_s, "forward": stats["forward_seconds"], "backward": stats["backward_seconds"],
                             "publish": publish_s},
            "max_turns": self.max_turns,
        }
        self._export_metrics(record, lags)
        return record

    def _export_metrics(self, rec: dict, lags: list[int]) -> None:
        metric("worldloop_learner_steps").inc()
        metric("worldloop_learner_policy_version").set(rec["policy_version"])
        for phase, s in rec["step_seconds"].items():
            metric("worldloop_learner_step_seconds").labels(phase=phase).set(s)
            metric("worldloop_learner_step_phase_seconds").labels(phase=phase).observe(s)
        if rec["tokens_per_s"] is not None:
            metric("worldloop_learner_tokens_per_second").set(rec["tokens_per_s"])
        metric("worldloop_learner_trained_tokens").inc(rec["tokens"])
        metric("worldloop_learner_trained_trajectories").inc(rec["trajectories"])
        for lag in lags:
            metric("worldloop_learner_staleness_versions").observe(max(lag, 0))
        for term, v in rec["losses"].items():
            if v is not None:
                metric("worldloop_learner_loss").labels(term=term).set(v)
        metric("worldloop_learner_kl").set(rec["kl"])
        for name, key in (("worldloop_learner_entropy", "entropy"), ("worldloop_learner_clip_fraction", "clip_fraction")):
            if rec[key] is not None:
                metric(name).set(rec[key])
        for stat, v in rec["advantage"].items():
            metric("worldloop_learner_advantage").labels(stat=stat).set(v)
        for stat, v in rec["importance_weight"].items():
            if v is not None:
                metric("worldloop_learner_importance_weight").labels(stat=stat).set(v)
        for comp, v in rec["reward"].items():
            metric("worldloop_learner_reward").labels(component=comp).set(v)
        for env, v in rec["success_rate"].items():
            metric("worldloop_learner_success_rate").labels(env=env).set(v)
        for model, v in rec["grad_norm"].items():
            metric("worldloop_learner_grad_norm").labels(model=model).set(v)
        metric("worldloop_learner_max_turns").set(rec["max_turns"])

    def _write_record(self, rec: dict, items) -> None:
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        ledger = {"step": rec["step"], "policy_version": rec["policy_version"],
                  "trained": [it.trajectory_id for it in items], "entries": [it.entry_id for it in items]}
        with open(self.run_dir / "learner_ledger.jsonl", "a") as f:
            f.write(json.dumps(ledger) + "\n")
        s = rec["step_seconds"]
        iw = rec["importance_weight"]
        log.info(
            "step %d/%d v%d | %d traj, %.0f tok/s | wait %.2fs fwd %.2fs bwd %.2fs pub %.2fs ckpt %.2fs | "
            "pg %.4f vf %s kl %.2e ent %.3f clip %.3f iw %.3f [%.3f, %.3f] | reward %.3f success %.2f | "
            "stale %.2f dropped %s | max_turns %d",
            rec["step"], self.t.total_steps, rec["policy_version"], rec["trajectories"], rec["tokens_per_s"] or 0.0,
            s["wait"], s["forward"], s["backward"], s["publish"], s.get("checkpoint", 0.0),
            rec["losses"]["policy"] or 0.0, "-" if rec["losses"]["value"] is None else f"{rec['losses']['value']:.4f}",
            rec["kl"], rec["entropy"] or 0.0, rec["clip_fraction"] or 0.0, iw["mean"] or 0.0, iw["min"] or 0.0,
            iw["max"] or 0.0, rec["reward"]["total"], rec["success_rate"]["all"], rec["staleness_mean"],
            rec["dropped"] or 0, rec["max_turns"],
        )

    # ------------------------------------------------------------------ loop

    def run_loop(self) -> int:
        while self.step_no < self.t.total_steps and not self.stop_requested:
            self.step()
        if self.step_no > self.ckpt_step:
            self.save_checkpoint()
        if self.step_no >= self.t.total_steps:
            log.info("trained %d updates (policy version %d): done", self.step_no, self.version)
        return 0

    def close(self) -> None:
        self._closing.set()
        if self.source is not None:
            self.source.close()
        if self.publisher is not None:
            self.publisher.close()
        if self.r is not None:
            try:
                self.r.close()
            except Exception:  # closing a dead connection may fail; nothing to recover
                pass


def run(cfg: Config, args: argparse.Namespace) -> int:
    if getattr(args, "resume", False):
        cfg.trainer.resume = True
    dist = init_distributed(cfg)
    learner: Learner | None = None

    def on_signal(signum, _frame):
        if learner is None:
            raise KeyboardInterrupt
        if dist.is_main:  # the other ranks follow rank 0's decision (it reaches them with the next batch)
            log.info("signal %d: finishing the current update, then checkpoint and exit", signum)
            learner.stop_requested = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        learner = Learner(cfg, dist)
        try:
            return learner.run_loop()
        finally:
            learner.close()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
