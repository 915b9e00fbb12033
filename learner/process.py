"""``worldloop learner``: the training loop (read ``scored``, PPO update, publish, checkpoint).

Public API::

    run(cfg, args) -> int          # the CLI entry point (exit 0 after trainer.total_steps updates or at trainer.time_limit_s)
    Learner(cfg, dist)             # the loop as an object (tests drive it step by step)
        .step() -> dict | None     # one update: collect a batch, train, publish, maybe checkpoint
        .run_loop() -> int, .close()

Launching::

    worldloop learner --config X [key=value ...]                        # one process: CPU (gloo) or cuda:0
    torchrun --nproc_per_node N -m worldloop learner --config X        # N data-parallel ranks
    deepspeed --no_local_rank --num_gpus N --module worldloop.cli learner --config X

(the CLI also accepts and ignores DeepSpeed's ``--local_rank`` argument, so ``--no_local_rank`` is optional: the rank comes
from the environment.) One learner per Redis namespace: it reads as the fixed consumer
``learner-0``, and rank 0 takes the namespace's lease first (``common/transport/lease.py``): a second
learner refuses to start, naming the holder; a learner restarted on the same host after a crash
takes a dead predecessor's lease at once; a learner whose lease another learner took writes
nothing more (its acks and control writes are fenced in Redis, its files checked before each
update's writes and each checkpoint) and exits with an error.

Each update (policy version v -> v + 1):

1. rank 0 collects ``train_batch_size`` usable trajectories from ``scored`` (see
   ``learner/data.py``: validation, dedup by trajectory id, staleness drops, dead letters) and
   broadcasts them to the other ranks;
2. ``learner/trainer.py`` runs one PPO iteration over the batch;
3. the version is bumped, the policy is published on the ZeroMQ weight channel (gathered from
   ZeRO-3 shards when sharded) under the actor model's ``state_dict()`` names, and the control
   hash gets ``policy_version`` and ``max_turns`` (WMAct annealing every ``anneal_every`` updates
   when ``anneal_max_turns``). The publisher's two encoding buffers (pinned memory on a GPU) are
   allocated at start, with version 0, so no update's publish waits for an allocation;
4. one JSON line goes to ``<run_dir>/metrics.jsonl`` (read by ``worldloop up``), the trained
   trajectory ids to ``<run_dir>/learner_ledger.jsonl``, one log line to the log;
5. every ``checkpoint_every`` updates (and early when the entries held pending pass
   ``trainer.max_pending_mb``, and at the end) a checkpoint is written (``learner/checkpoint.py``)
   and only then are the stream entries it covers acked.

``run_dir`` is ``run.run_dir``, or ``runs/<run.name>`` when that is null (a stable folder, so that
``--resume`` finds the checkpoints). ``--resume`` (or ``trainer.resume``) continues from the newest
intact checkpoint of the run with the same version sequence (damaged newer ones are skipped and set
aside, see ``learner/checkpoint.py``); without one it starts fresh. A fresh learner moves an earlier
run's checkpoints aside to ``<run_dir>/checkpoints.old-<UTC time>/``. After a
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
import time

import torch

from worldloop.common.contracts.config import Config, ConfigError, run_dir_of
from worldloop.common.transport.control import control_fields, default_proc_id, list_processes, read_control
from worldloop.common.exposure import warn_plain_weights
from worldloop.common.files import append_lines
from worldloop.common.contracts.keys import Keys
from worldloop.common.transport.lease import LearnerLease, LeaseLost
from worldloop.common.metrics import metric
from worldloop.common.transport.process import HEARTBEAT_S, ProcessScaffold
from worldloop.common.transport.streams import RedisLink
from worldloop.common.versions import write_versions
from worldloop.learner import checkpoint
from worldloop.learner.data import (DedupWindow, ScoredSource, check_pending_fits, decode_batch, encode_batch,
                                    entries_fault, oldest_version, whole_group_fraction)
from worldloop.learner.engine import (DistInfo, all_reduce_sum, barrier, broadcast_bytes, build_models, gather_policy_weights,
                                      init_distributed)
from worldloop.learner.offpolicy import export_mismatch
from worldloop.learner.rewards import anneal_max_turns
from worldloop.learner.rewards import batch_reward_stats
from worldloop.learner.trainer import PPOTrainer
from worldloop.learner.trackers import final_eval_deadline, open_trackers

STEP_TIME_WINDOW = 5  # trainer.time_limit_s judges the next update by the slowest of the last this many

log = logging.getLogger("worldloop.learner")

_MULTI_RANK_WAIT_S = 30.0  # rank 0 tells the others "still waiting" this often


class Learner:
    """The learner loop of one rank; rank 0 also owns Redis, the weight publisher and the files."""

    def __init__(self, cfg: Config, dist: DistInfo, scaffold: ProcessScaffold | None = None):
        if cfg.redis.url is None:  # fail before minutes of model loading
            raise ConfigError("redis.url", "the learner needs a Redis URL (worldloop up passes its own)")
        self.cfg = cfg
        self.t = cfg.trainer
        self.dist = dist
        self.run_dir = run_dir_of(cfg)
        self.ckpt_dir = self.run_dir / "checkpoints"
        # heartbeat (with the current phase), /metrics and control polling on rank 0 from the start,
        # so that `worldloop up`/`status` can tell where a learner that makes no progress waits
        self._owns_proc = scaffold is None
        self.proc = scaffold or ProcessScaffold(cfg, "learner", default_proc_id(), services=dist.is_main,
                                                install_signals=False)
        if self._owns_proc:
            self.proc.start()
        self.proc_id = self.proc.proc_id
        self._lineage: list[dict] = []  # ledger + metrics lines since the last checkpoint (rank 0)
        self.link = self.source = self.publisher = self.lease = self.trackers = None
        if dist.is_main:  # one learner per namespace, before it writes or builds anything (common/transport/lease.py)
            self.proc.set_phase("taking the namespace's learner lease")
            self.lease = LearnerLease(cfg.redis.url, Keys(cfg.redis.namespace), self.t.lease_ttl_s,
                                      holder=f"learner {self.proc_id} ({self.run_dir})",
                                      reconnect_max_s=cfg.redis.reconnect_max_s,
                                      socket_timeout_s=cfg.redis.socket_timeout_s,
                                      startup_timeout_s=cfg.redis.startup_timeout_s,
                                      on_lost=lambda: self.proc.request_stop("the learner lease was lost")).acquire()
        try:
            self._build()
        except BaseException:
            if self.lease is not None:
                self.lease.close()
            raise

    def _build(self) -> None:
        """Trackers, models, the checkpoint to resume from, the trainer; rank 0's services."""
        cfg, dist = self.cfg, self.dist
        # run.loggers (TensorBoard, wandb, samples.jsonl) on rank 0; a missing package fails here
        self.trackers = open_trackers(self.run_dir, cfg) if dist.is_main else None
        self.proc.set_phase("building models (DeepSpeed engines)")

        torch.manual_seed(cfg.run.seed)
        self.models = build_models(cfg, dist)
        self.step_no = 0
        self.version = 0
        self.max_turns = cfg.actor.max_turns
        self.anneal_window: list[int] = []
        trained = self._restore()
        self.ckpt_step, self.ckpt_version = self.step_no, self.version
        self.dedup = DedupWindow(self.t.max_staleness, trained)
        self.trainer = PPOTrainer(cfg, self.models, seed=cfg.run.seed)
        if dist.is_main:
            self._start_main()
        self._publish()
        if dist.is_main:
            self._write_control()

    def _restore(self) -> dict[str, int]:
        """``--resume``: load the newest intact checkpoint of the run (damaged newer ones are skipped,
        logged and set aside); else (or with none) a fresh run: a new run id, and rank 0 moves an
        earlier run's checkpoints aside (``checkpoint.start_run``). Returns the trained-id window."""
        self.run_id, trained, skipped = None, {}, []
        if self.t.resume:
            path, skipped = checkpoint.find(self.ckpt_dir)
            if path is None:
                log.info("trainer.resume: no intact checkpoint in %s; starting fresh", self.ckpt_dir)
            else:
                st = checkpoint.load(self.models, path)
                self.run_id = str(st.get("run_id", ""))
                self.step_no, self.version = int(st["step"]), int(st["policy_version"])
                self.max_turns = int(st.get("max_turns") or self.max_turns)
                self.anneal_window = [int(x) for x in st.get("anneal_window", [])]
                trained = {str(k): int(v) for k, v in st.get("trained", {}).items()}
                if skipped:
                    log.warning("resumed from %s instead of the damaged %s", path, ", ".join(str(p) for p, _ in skipped))
                if self.dist.is_main:
                    self._repair_lineage(st.get("lineage", []))
        fresh = self.run_id is None
        self.run_id = checkpoint.new_run_id() if fresh else self.run_id
        barrier(self.dist)  # every rank has read the folder before rank 0 changes it
        if self.dist.is_main:
            for p, _why in skipped:
                log.warning("damaged checkpoint %s set aside as %s", p, checkpoint.set_aside(p))
            moved = checkpoint.start_run(self.ckpt_dir, self.run_id, fresh)
            if moved is not None:
                log.warning("%s held checkpoints of an earlier run and this learner starts fresh (trainer.resume "
                            "off, or nothing intact to resume): moved them aside to %s", self.ckpt_dir, moved)
        return trained

    # ------------------------------------------------------------------ rank 0 services

    @property
    def stop_requested(self) -> bool:
        return self.proc.stop.is_set()

    @stop_requested.setter
    def stop_requested(self, value: bool) -> None:
        if value:
            self.proc.stop.set()

    @property
    def metrics_port(self) -> int | None:
        return self.proc.metrics_port

    def _start_main(self) -> None:
        from worldloop.common.transport.weights import publisher_from_config

        cfg = self.cfg
        self.keys = Keys(cfg.redis.namespace)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_versions(self.run_dir)  # the versions this learner trains with (supervisor runs have no `up`)
        self.source = ScoredSource(
            cfg, self.keys, vocab_size=self.models.vocab_size, codec=self.models.codec,
            version_fn=lambda: self.version, checkpoint_version_fn=lambda: self.ckpt_version, dedup=self.dedup,
            fence=self.lease.fence,
        )
        # control-plane calls (the control record, the start-up checks) retry through a Redis outage
        # like the stream calls do: a Redis restart must not end the learner (bench/chaos.py)
        self.link = RedisLink(cfg.redis.url, self.keys.control, cfg.redis.reconnect_max_s, cfg.redis.socket_timeout_s,
                              should_stop=lambda: self.stop_requested, startup_timeout_s=cfg.redis.startup_timeout_s)
        self.link.call(lambda r: check_pending_fits(cfg, r))
        # a fresh run: admissions counted by an earlier run in this namespace are void; a resumed one:
        # recounted from what it trained and what is in flight (Redis may have lost its last second)
        self.source.admission.reset((self.keys.rollouts, self.keys.scored), version=self.version)
        if not self.t.resume or self.link.call(lambda r: read_control(r, self.keys))["run_state"] == "stopped":
            # a new run, or one resumed after it had finished: actors may produce again (a pause
            # an operator set survives a resume)
            self.lease.hset(self.keys.control, control_fields(run_state="running"))
        self.proc.set_phase("recovering its own pending entries")
        self.source.recover()
        warn_plain_weights("learner", cfg.weights.bind, cfg.weights.curve_server_secret)
        self.publisher = publisher_from_config(cfg)
        metric("worldloop_learner_max_turns").set(self.max_turns)

    def _should_stop(self) -> bool:
        return self.proc.should_stop()

    def _write_control(self) -> None:
        # the admission bound's inputs travel with the version (common/transport/admission.py)
        fields = dict(policy_version=self.version, max_turns=self.max_turns,
                      train_batch_size=self.t.train_batch_size, max_staleness=self.t.max_staleness)
        self.lease.hset(self.keys.control, control_fields(**fields))  # fenced: never after a take-over

    # ------------------------------------------------------------------ steps

    def _publish(self) -> tuple[dict, float]:
        t0 = time.perf_counter()
        weights = gather_policy_weights(self.models)
        if self.dist.is_main:
            self.lease.check()  # a learner that lost the namespace publishes nothing (LeaseLost)
            if self.publisher.version is None:  # at start: both (pinned) buffers now, so no update waits for one
                self.publisher.reserve(weights)
            self.publisher.publish(weights, self.version)
        return weights, time.perf_counter() - t0

    def _next_batch(self):
        """(items on rank 0, trajectories, stop) — the same trajectories and stop on every rank."""
        items = None
        if self.dist.is_main:
            items = self.source.collect(
                self.t.train_batch_size, self._should_stop, paused=lambda: self.proc.paused,
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
        self.proc.set_phase(f"waiting for {self.t.train_batch_size} scored trajectories", step=self.step_no)
        try:
            items, trajs, stop = self._next_batch()
            if stop:
                self.stop_requested = True
                return None
            if not trajs:
                return None
            wait_s = time.perf_counter() - t_start
            before = self.version
            self.proc.set_phase(f"training step {self.step_no + 1}")
            stats = self.trainer.update(trajs, self.step_no, version=before)
        except Exception as e:
            self._blame_entries(e)
            raise
        if self.dist.is_main:
            self.source.trained(items)  # a crash from here on is no strike against these entries
        self.step_no += 1
        self.version += 1
        weights, publish_s = self._publish()
        record = None
        if self.dist.is_main:
            self.lease.check()  # another learner took the namespace: write nothing (LeaseLost)
            self.source.mark_trained(items)
            self.dedup.prune(self.version)
            record = self._after_update(trajs, before, stats, wait_s, publish_s)
            self._lineage.append({"ledger": self._ledger_line(record, items), "record": record})
        t0 = time.perf_counter()
        if self._checkpoint_due():
            self.save_checkpoint(weights)
        if record is not None:
            record["step_seconds"]["checkpoint"] = time.perf_counter() - t0
            record["pending_entries"] = self.source.held_count
            self._write_record(record, items)
            if self.trackers is not None:
                self.trackers.log_step(record["step"], record, trajs)
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
        if self.dist.is_main:
            self.lease.check()  # the run directory is another learner's once it took the namespace
        state = {"run_id": self.run_id, "step": self.step_no, "policy_version": self.version, "max_turns": self.max_turns,
                 "anneal_window": self.anneal_window, "trained": self.dedup.to_dict(),
                 # the ledger and metrics lines of the steps this checkpoint covers: a kill between
                 # the checkpoint and their append cannot lose them (see _repair_lineage)
                 "lineage": self._lineage}
        checkpoint.save(self.models, self.ckpt_dir, state, weights=weights if self.dist.is_main else None,
                        model_dir=self.cfg.model.path, keep=self.t.keep_checkpoints)
        self.ckpt_step, self.ckpt_version = self.step_no, self.version
        self._lineage = []
        if self.dist.is_main:
            metric("worldloop_learner_checkpoints").inc()
            n = self.source.ack_held()
            log.info("checkpoint at step %d: acked %d stream entries", self.step_no, n)

    def _after_update(self, trajs: list, before: int, stats: dict, wait_s: float, publish_s: float) -> dict:
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
        lags = [before - oldest_version(tr) for tr in trajs]  # of each trajectory's oldest token
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
            "mismatch": stats.get("mismatch"),  # train-rollout mismatch, off-policy rejections (learner/offpolicy.py)
            "reward": rs["reward"],
            "success_rate": rs["success_rate"],
            "staleness_mean": sum(lags) / len(lags),
            "staleness_max": max(lags),
            # exact and cumulative over the whole run, restarts included (ScoredSource.fates)
            **self.source.fates(),
            "pending_entries": self.source.held_count,
            # GRPO groups (actor.n_samples_per_seed >= 2): whole = the fraction of this batch's
            # trajectories whose whole group is in the batch (a split group's baseline is the mean of
            # a fragment); decided / kept so far by this process when the reader holds groups
            # (trainer.whole_groups, filter_groups: the rest were all-solved or all-failed, and the
            # batch's success_rate is then that of the kept groups only)
            "groups": self._group_record(trajs),
            # gigpo: step_groups {turns, shared (step group > 1), shared_fraction}; observation_advantage
            # grounding: observation {turns, tokens}; reasoning_advantage outlook: reasoning {turns,
            # tokens} (learner/credit.py)
            "credit": stats.get("credit"),
            "tokens": stats["tokens"],
            "padding_fraction": stats.get("padding_fraction"),  # padded slots / computed slots (micro-batching)
            "response_tokens": stats["response_tokens"],
            "tokens_per_s": stats["tokens"] / busy if busy > 0 else None,
            "step_seconds": {"wait": wait_s, "forward": stats["forward_seconds"], "backward": stats["backward_seconds"],
                             "publish": publish_s},
            "max_turns": self.max_turns,
        }
        self._export_metrics(record, lags)
        return record

    def _group_record(self, trajs: list) -> dict | None:
        size = self.cfg.actor.n_samples_per_seed
        if size < 2:
            return None
        rec = {"whole": whole_group_fraction([tr.group_id for tr in trajs], size)}
        if self.source.group_size:
            rec.update(decided=self.source.groups_decided, kept=self.source.groups_kept)
        return rec

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
        export_mismatch(rec["mismatch"])
        if rec["groups"] is not None:
            metric("worldloop_learner_whole_group_fraction").set(rec["groups"]["whole"])

    @staticmethod
    def _ledger_line(rec: dict, items) -> dict:
        return {"step": rec["step"], "policy_version": rec["policy_version"],
                "trained": [it.trajectory_id for it in items], "entries": [it.entry_id for it in items]}

    def _append_lines(self, rec: dict, ledger: dict) -> None:
        # a full disk fails here naming the file, with no torn line; the step's entries stay pending
        # in Redis until a checkpoint holds them, so a restart (--resume) trains them again
        append_lines(self.run_dir / "metrics.jsonl", [json.dumps(rec) + "\n"])
        append_lines(self.run_dir / "learner_ledger.jsonl", [json.dumps(ledger) + "\n"])

    def _repair_lineage(self, lineage: list[dict]) -> None:
        """On resume: append the ledger and metrics lines of checkpointed steps that a kill right
        after the checkpoint kept from reaching the files, so the ledger always covers every step
        the checkpoint holds. Lines of steps after the checkpoint (lost updates, trained again now)
        stay; for each step the last line is the surviving one."""
        path = self.run_dir / "learner_ledger.jsonl"
        have = set()
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    have.add(int(json.loads(line)["step"]))
                except (ValueError, KeyError, TypeError):
                    continue
        missing = [x for x in lineage if int(x["ledger"]["step"]) not in have]
        for x in missing:
            self._append_lines(dict(x["record"], repaired=True), x["ledger"])
        if missing:
            log.warning("resume: restored the ledger lines of steps %s from the checkpoint",
                        [x["ledger"]["step"] for x in missing])

    def _write_record(self, rec: dict, items) -> None:
        self._append_lines(rec, self._ledger_line(rec, items))
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

    def _out_of_time(self, started: float, recent: list[float]) -> bool:
        """``trainer.time_limit_s``: would the next update end past it? (the same answer on every rank)"""
        limit = self.t.time_limit_s
        late = 0.0
        if limit is not None and recent:  # less what the final evaluation needs beyond up.final_reserve_s
            limit -= self.trackers.final_eval_extra_s(self.cfg) if self.trackers is not None else 0.0
            late = float(time.monotonic() - started + max(recent[-STEP_TIME_WINDOW:]) > limit)
        if self.dist.world_size > 1:
            late = all_reduce_sum([late], self.dist)[0]
        return late > 0

    def _blame_entries(self, e: Exception) -> None:
        """Deciding or training the entries in flight raised: when the failure is theirs (not Redis's,
        the lease's, the memory's or the disk's), the next learner counts a delivery against each
        (``redis.max_deliveries`` of them dead-letter it as poison). A learner killed from outside
        blames nothing (docs/architecture.md "Learner: reading, batches, checkpoint-then-ack")."""
        if not self.dist.is_main or self.source is None or not entries_fault(e):
            return
        n = self.source.blame()
        log.error("deciding or training failed (%s: %s): the %d entries in flight are blamed, one delivery each "
                  "at the next start", type(e).__name__, e, n)

    def run_loop(self) -> int:
        started, started_wall = time.monotonic(), time.time()
        recent: list[float] = []  # wall seconds of the updates so far (waiting for data included)
        timed_out = False
        while self.step_no < self.t.total_steps and not self.stop_requested:
            if self._out_of_time(started, recent):
                timed_out = True
                break
            t0 = time.monotonic()
            self.step()
            recent.append(time.monotonic() - t0)
        if self.dist.is_main and self.lease.lost.is_set():  # the renewal found another learner: exit 3, not 0
            raise LeaseLost(f"the learner lease of namespace {self.keys.ns!r} was taken by another learner: stopped "
                            "without a checkpoint")
        if self.step_no > self.ckpt_step:
            self.save_checkpoint()
        if timed_out:
            log.info("trainer.time_limit_s=%.0f: stopping after %d of %d updates (%.0fs; the next would end "
                     "past the limit)", self.t.time_limit_s, self.step_no, self.t.total_steps,
                     time.monotonic() - started)
        if self.step_no >= self.t.total_steps or timed_out:
            log.info("trained %d updates (policy version %d): done", self.step_no, self.version)
            if self.dist.is_main:  # the run is over: actors and judges stop instead of producing into it
                self.lease.hset(self.keys.control, control_fields(
                    run_state="stopped", final_eval_by=final_eval_deadline(self.cfg, started_wall) or 0))  # 0: no deadline
                self._await_final_eval()
        return 0

    def _await_final_eval(self) -> None:
        """Keep the trackers open until a live evaluator has evaluated the final version (it takes it
        from the checkpoint just written), so TensorBoard/wandb hold it too; bounded, and no wait
        without a live evaluator."""
        if self.trackers is None or self.t.eval_every <= 0 or self.t.final_eval_wait_s <= 0:
            return

        def evaluator_alive() -> bool:
            try:
                procs = list_processes(self.link.r, self.keys)
            except Exception:  # Redis away: nobody to wait for that we could see
                return False
            return any(p.get("role") == "evaluator" and time.time() - float(p.get("seen_at") or 0) < 3 * HEARTBEAT_S
                       for p in procs)

        self.proc.set_phase(f"waiting for the held-out evaluation of v{self.version}")
        if self.trackers.wait_for_eval(self.version, evaluator_alive, self.t.final_eval_wait_s,
                                       should_stop=lambda: self.stop_requested):
            log.info("the final version v%d's held-out evaluation is in the trackers", self.version)
        else:
            log.info("no held-out evaluation of v%d came in (no live evaluator, or not within "
                     "trainer.final_eval_wait_s); eval.jsonl gets it if one comes later", self.version)

    def close(self) -> None:
        if self.trackers is not None:
            self.trackers.close()
        if self._owns_proc:
            self.proc.close()
        if self.source is not None:
            self.source.close()
        if self.publisher is not None:
            self.publisher.close()
        if self.link is not None:
            self.link.close()
        if self.lease is not None:
            self.lease.close()  # hands the lease back (not when lost: it is another learner's)


def run(cfg: Config, args: argparse.Namespace) -> int:
    if getattr(args, "resume", False):
        cfg.trainer.resume = True
    dist = init_distributed(cfg)
    # a signal during start-up (minutes of model loading) interrupts at once; after it the current
    # update finishes, a checkpoint is written and the process exits. The other ranks follow rank
    # 0's decision (it reaches them with the next batch).
    scaffold = ProcessScaffold(cfg, "learner", default_proc_id(), services=dist.is_main,
                               stop_message="finishing the current update, then checkpoint and exit")
    with scaffold:
        learner = Learner(cfg, dist, scaffold)
        scaffold.ready()
        try:
            return learner.run_loop()
        finally:
            learner.close()
