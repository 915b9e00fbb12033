"""A chaos soak with exact accounting: a real tiny run under random kill -9, Redis restarts,
judge pauses and poison entries, and every trajectory accounted for at the end.

    python bench/chaos.py --minutes N [--seed S] [--out DIR] [--rounds R] [--min-steps K] [--set KEY=VALUE ...]

The bench is its own supervisor (as supervisord would be): it starts a persisted Redis
(``LocalRedis(persist=True)``: AOF, a fixed data dir, restarted on the same port), a learner
(restarted with ``--resume`` after a kill), 2 actors and 2 judges as separate
``python -m worldloop <role>`` processes on a small fast config (the default preset ``configs/tiny-frozenlake.yaml``
made small: :data:`FAST`; the embedded tiny model, no SFT, ``checkpoint_every`` 2), restarts whatever dies, and from a seeded schedule injects at random
moments, in ``R`` rounds of one fault of each kind (default one round per 3 minutes):

* ``actor_kill`` / ``judge_kill`` / ``learner_kill``: kill -9 of one such process;
* ``redis_kill``: kill -9 of redis-server, down 1-4 s, restarted on the same port and data dir;
* ``judge_pause``: SIGSTOP of a judge for longer than ``redis.claim_idle_ms``, then SIGCONT;
* ``malformed``: into ``rollouts`` and ``scored`` each, an entry that is not msgpack, one of the
  wrong schema and one without the ``data`` field;
* ``redis_kill_at_backlog``, ``poison``, ``redis_oom``, ``host_crash``, ``second_learner``: see
  ``bench/_chaos_faults.py`` (Redis killed while ``scored`` is at its backlog limit; an entry that
  kills every judge that takes it, which must end dead-lettered; Redis refusing writes for 30 s;
  Redis and every process killed at once with the last second cut off Redis's append-only file;
  a second learner on the same namespace, which must refuse to start);
* ``learner_crash_loop``, ``torn_checkpoint``: see ``bench/_chaos_ckpt.py`` (the learner killed 6
  times in a row within one checkpoint interval; a file of its newest checkpoint cut in half before
  its restart, which must fall back to the checkpoint before).

``--kinds a,b`` runs only those kinds (a short soak of the new faults).

The soak's clock starts at the first trained step; after it (and, with ``--min-steps K``, once the
learner's surviving lineage holds K steps: an amount of work, not a time), the run drains (actors
stopped, judges and the learner finish what they can, the learner stops with a checkpoint). Every wait
is bounded; :meth:`Chaos.wall_bound_s` adds the bounds up (``tests/test_chaos.py`` sizes its
timeout with it).

Accounting. The exact source of what entered ``rollouts`` is the actors' own record: with
``WORLDLOOP_PRODUCED_LOG`` set, an actor appends each trajectory id (fsynced) once its XADD
returned (``worldloop.actor.process.ProducedLog``). It does not depend on the learner, the
judges or Redis's content (tailing the stream could miss entries that judges XDEL at once, and a
second consumer group would take entries from the judges). Its one blind spot is an actor killed
between the XADD and the append; such ids turn up in a fate below, are added to ``produced`` and
reported as ``unlogged`` (never more than the actor kills). Each produced id is then, in order:

* trained once / twice: the number of times it appears in the learner's surviving lineage
  (``learner_ledger.jsonl``; for each step the last line wins);
* dead-lettered: a record in the dead-letter stream whose payload decodes to it;
* queued: still in ``rollouts`` or ``scored`` (undelivered or pending);
* dropped (stale / duplicate): a learner's "dropping" decision for it (its log), the entry acked;
* lost in a host crash: none of these, and logged by its actor within the second that a
  ``host_crash`` cut off Redis's AOF (what ``appendfsync everysec`` may lose: docs/architecture.md
  "Durability");
* lost with a torn checkpoint: none of these, and trained in an update that a ``torn_checkpoint``
  took with it (acked with the damaged checkpoint: docs/operations.md);
* lost: none of these.

Output: a table (faults by kind, recovery time of each = until the next trained step, the
accounting, processes that exited without being killed) written to ``<out>/chaos.md`` too, and the
last line exactly ``chaos: produced N, trained once T, trained twice D, lost L, lost in host
crashes (allowed) H, lost with torn checkpoints (allowed) K, dropped X (stale S %), dead-lettered Y,
queued Q``, after a verdict line (unexpected exits, trained twice, good entries dead-lettered, lost).
Exit status 1 when D or L is not 0 (2 when the run never started).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/_chaos_faults.py, also when loaded by path
import _chaos_ckpt as ckpt  # noqa: E402
import _chaos_faults as faults  # noqa: E402
from _chaos_report import last_line, recovery, report, stale_percent  # noqa: E402,F401 - the soak's output, re-exported
from _chaos_faults import Fault  # noqa: E402,F401 - re-exported
from _chaos_proc import Proc  # noqa: E402
from _records import jsonl_records  # noqa: E402

KINDS = ("actor_kill", "judge_kill", "learner_kill", "redis_kill", "judge_pause", "malformed", *faults.NEW_KINDS,
         *ckpt.KINDS)
NS = "chaos"
_DROP_RE = re.compile(r"dropping (\w+) trajectory (\S+) \(entry")


# --------------------------------------------------------------------------- schedule


def make_schedule(seed: int, soak_s: float, rounds: int, only: tuple[str, ...] = KINDS) -> list[tuple[float, str]]:
    """(offset in s from the soak's start, kind): ``rounds`` shuffled rounds of every kind (of
    ``only``), each fault at a random moment of its own equal slot of the soak."""
    rng = random.Random(seed)
    kinds: list[str] = []
    for _ in range(rounds):
        k = list(only)
        rng.shuffle(k)
        kinds += k
    slot = soak_s / len(kinds)
    return [(i * slot + rng.uniform(0.1, 0.9) * slot, kind) for i, kind in enumerate(kinds)]


PRESET = ROOT / "configs" / "tiny-frozenlake.yaml"
# the default preset made small and fast: 2-turn episodes on 3x3 lakes, batch 4, a checkpoint every
# 2 steps, claims after 3 s, reconnects every second, no SFT (the model is made once, untrained)
FAST = {
    "actor.num_envs": 2, "actor.max_turns": 2, "actor.max_new_tokens": 24, "actor.admission_lease_s": 30,
    "model.max_image_side": 56, "model.make_tiny_if_missing": False, "sft.enabled": False,
    "trainer.total_steps": 1_000_000, "trainer.train_batch_size": 4, "trainer.ppo_mini_batch_size": 2,
    "trainer.micro_batch_size": 1, "trainer.ppo_epochs": 1, "trainer.checkpoint_every": 2,
    "trainer.keep_checkpoints": 2, "trainer.eval_every": 0,
    # the poison entry kills a judge per attempt: 3 attempts keep the soak moving (default 5)
    "redis.max_deliveries": 3,
    # batches of 4 from the preset's GRPO groups of 8 (whole groups would need batches of 8): the
    # soak checks exactly-once delivery under faults, as validated before whole groups existed
    "trainer.whole_groups": False,
    # a backlog limit below the admission window ((max_staleness + 1) * batch = 20): with the learner
    # stopped, scored reaches it (the redis_kill_at_backlog fault)
    "redis.max_backlog": 16, "redis.block_ms": 500, "redis.reconnect_max_s": 1.0, "redis.startup_timeout_s": 300.0,
}
ENV_KWARGS = {"size": 3, "min_actions_to_succeed": 2}


def chaos_config(out: Path, redis_url: str, model_dir: Path, pub_port: int, fetch_port: int,
                 claim_idle_ms: int = 3000, extra: dict | None = None) -> dict:
    """The run's config: :data:`PRESET` with :data:`FAST` and ``extra`` (``--set``), on the bench's Redis, ports and model."""
    from worldloop.common.contracts.config_load import set_dotted
    cfg = yaml.safe_load(PRESET.read_text())
    overrides = dict(FAST, **(extra or {}), **{"run.name": "chaos", "run.run_dir": str(out / "run"), "redis.url": redis_url,
                              "redis.namespace": NS, "redis.claim_idle_ms": claim_idle_ms,
                              "weights.pub_port": pub_port, "weights.fetch_port": fetch_port,
                              "model.path": str(model_dir)})
    for dotted, value in overrides.items():
        set_dotted(cfg, dotted, value)
    for env in cfg["actor"]["envs"]:
        env["kwargs"] = dict(env.get("kwargs") or {}, **ENV_KWARGS)
    return cfg


# --------------------------------------------------------------------------- the soak


class Chaos:
    def __init__(self, out: Path, seed: int = 0, minutes: float = 10.0, rounds: int | None = None,
                 startup_timeout_s: float = 900.0, drain_timeout_s: float = 240.0, num_actors: int = 2,
                 claim_idle_ms: int = 3000, echo=print, min_steps: int = 0, kinds: tuple[str, ...] = KINDS,
                 overrides: dict | None = None):
        self.out = Path(out).resolve()
        self.seed = seed
        self.soak_s = minutes * 60.0
        self.rounds = rounds if rounds is not None else max(1, int(minutes / 3 + 1e-9))
        self.startup_timeout_s = startup_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.num_actors = num_actors
        self.claim_idle_ms = claim_idle_ms
        self.echo = echo
        self.min_steps = min_steps
        self.overrides = dict(overrides or {})
        self.kinds = tuple(kinds)
        self.rng = random.Random(seed + 1)
        self.faults: list[Fault] = []
        self.procs: list[Proc] = []
        self.injected: list[tuple[str, str]] = []  # (stream, entry id) of malformed entries
        self.poisoned: list[tuple[str, str]] = []  # (entry id, trajectory id) of poison entries
        self.crash_cuts: list = []  # the AOF samples that host crashes cut back to
        self.second_learners: list[bool] = []  # whether each second learner was refused
        self.torn: list[dict] = []  # each torn checkpoint: its name, the step resumed from, the ids it took
        self.sampler = self._link = None
        self.redis = None
        self.soak_started_wall: float | None = None
        self.produced_dir = self.out / "produced"
        self.run_dir = self.out / "run"

    # -------------------------------------------------------------- set-up

    def start(self) -> None:
        from worldloop.common.transport.control import write_control
        from worldloop.common.contracts.keys import Keys
        from worldloop.common.metrics import unassigned_port
        from worldloop.common.transport.redis_local import LocalRedis
        from worldloop.common.transport.streams import connect
        from worldloop.bootstrap.tiny_model import make_tiny_model

        for d in (self.out, self.run_dir / "logs", self.produced_dir):
            d.mkdir(parents=True, exist_ok=True)
        model = make_tiny_model(self.out / "model", seed=self.seed, max_image_side=56)
        self.redis = LocalRedis(data_dir=str(self.out / "redis"), persist=True).start(timeout=60)
        self.r = connect(self.redis.url, 10.0)
        self.keys = Keys(NS)
        # the weight ports below the ephemeral range, as worldloop up picks them: the learner restarts on them
        # about ten times while the actors reconnect, and a reconnect to a port of the range can connect to
        # itself and hold it (common/transport/weights/publisher.py, SELF_CONNECT)
        cfg = chaos_config(self.out, self.redis.url, model, unassigned_port(), unassigned_port(), self.claim_idle_ms,
                           self.overrides)
        self.cfg = cfg
        cfg_path = self.out / "chaos.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        write_control(self.r, self.keys, run_state="running")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env.setdefault("TORCH_EXTENSIONS_DIR", str(self.out / "torch_extensions"))
        env.setdefault("OMP_NUM_THREADS", "1")  # 5 processes on a few cores: no thread oversubscription
        base = [sys.executable, "-m", "worldloop"]
        logs = self.run_dir / "logs"
        self.procs = [Proc("learner", "learner", base + ["learner", "--config", str(cfg_path)], logs / "learner.log", env)]
        for i in range(self.num_actors):
            name = f"actor-{i}"
            self.procs.append(Proc(name, "actor", base + ["actor", "--config", str(cfg_path), f"actor.actor_id={name}"],
                                   logs / f"{name}.log",
                                   dict(env, WORLDLOOP_PRODUCED_LOG=str(self.produced_dir / f"{name}.ids"))))
        from worldloop.common.faults import POISON_ENV, POISON_EXIT

        for i in range(2):
            name = f"judge-{i}"
            self.procs.append(Proc(name, "judge", base + ["judge", "--config", str(cfg_path)], logs / f"{name}.log",
                                   dict(env, **{POISON_ENV: faults.POISON_MARK}), expected_codes=(POISON_EXIT,)))
        for p in self.procs:
            p.start()
        self.sampler = faults.AofSampler(self.redis, self.produced_dir)
        self.echo(f"chaos: redis {self.redis.url} (AOF in {self.redis.data_dir}), {len(self.procs)} processes, "
                  f"logs in {logs}")

    def supervise(self) -> None:
        """Restart whatever ended (the learner with --resume), SIGCONT paused judges when due."""
        now = time.monotonic()
        for p in self.procs:
            if p.paused_until is not None and now >= p.paused_until:
                p.signal(signal.SIGCONT)
                p.paused_until = None
            if p.reap() and not p.stopping:
                pid, code, ours = p.exits[-1]
                if not ours:  # its last lines go to the output: a CI log may be all there is to read
                    self.echo(f"chaos: {p.name} (pid {pid}) exited with {code} without being killed; restarting; "
                              f"its last lines:\n{p.last_lines()}")
                p.start()

    def wall_bound_s(self) -> float:
        """The longest :meth:`run` can take: the sum of its bounded waits, plus 120 s of set-up (the
        tiny model, Redis's first start)."""
        stops = self.num_actors * (60 + 30) + 3 * (180 + 30)  # the drain's SIGTERM grace + SIGKILL wait
        closes = (1 + self.num_actors + 2) * (30 + 30)
        restarts = self.rounds * (4 + 120)  # each redis_kill: down <= 4 s, then a start within 120 s
        drains = self.drain_timeout_s * (3 if self.min_steps else 2)
        learner_faults = self.rounds * ckpt.BOUND_S * len(set(self.kinds) & set(ckpt.KINDS)) / 2
        return 120 + 60 + self.startup_timeout_s + self.soak_s + restarts + drains + stops + closes + learner_faults

    def surviving_steps(self) -> int:
        """Distinct steps in the learner's ledger (for each step the last line wins)."""
        return len({int(x["step"]) for x in jsonl_records(self.run_dir / "learner_ledger.jsonl") if "step" in x})

    def trained_steps(self) -> list[dict]:
        """Step records of metrics.jsonl written by a training step (not restored on resume)."""
        return [x for x in jsonl_records(self.run_dir / "metrics.jsonl") if "step" in x and not x.get("repaired")]

    def wait(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.supervise()
            time.sleep(min(0.2, max(0.0, end - time.monotonic())))

    # -------------------------------------------------------------- faults

    def inject(self, f: Fault) -> None:
        f.at_wall = time.time()
        by_role = lambda role: [p for p in self.procs if p.role == role and p.alive]  # noqa: E731
        if f.kind in ("actor_kill", "judge_kill", "learner_kill"):
            role = f.kind.split("_")[0]
            live = by_role(role)
            if not live:
                f.note = "none alive (restarting)"
                return
            p = self.rng.choice(live)
            f.target = p.name
            p.signal(signal.SIGKILL)
        elif f.kind == "redis_kill":
            down = self.rng.uniform(1.0, 4.0)
            self.redis.stop(kill=True)
            self.wait(down)
            self.redis.start(timeout=120)
            f.target, f.note = "redis", f"down {down:.1f}s"
        elif f.kind == "judge_pause":
            live = [p for p in by_role("judge") if p.paused_until is None]
            if not live:
                f.note = "no judge to pause"
                return
            p = self.rng.choice(live)
            pause = self.claim_idle_ms / 1000 + self.rng.uniform(2.0, 5.0)
            p.signal(signal.SIGSTOP)
            p.paused_until = time.monotonic() + pause
            f.target, f.note = p.name, f"stopped {pause:.1f}s"
        elif f.kind in faults.NEW_KINDS:
            faults.NEW_KINDS[f.kind](self, f)
        elif f.kind in ckpt.KINDS:
            ckpt.KINDS[f.kind](self, f)
        elif f.kind == "malformed":
            for stream in (self.keys.rollouts, self.keys.scored):
                for entry in faults.malformed_entries():
                    self.injected.append((stream, self._xadd(stream, entry)))
            f.target, f.note = "rollouts+scored", f"{len(faults.malformed_entries()) * 2} entries"
        self.faults.append(f)
        self.echo(f"chaos: t+{time.time() - self.soak_started_wall:5.0f}s {f.kind} {f.target} {f.note}")

    def call(self, fn):
        """``fn(client)`` through a link that waits out Redis restarts and refused writes."""
        from worldloop.common.transport.streams import RedisLink

        if self._link is None:
            self._link = RedisLink(self.redis.url, "chaos", 1.0, 10.0)
        return self._link.call(fn)

    def _xadd(self, stream: str, entry: dict) -> str:
        eid = self.call(lambda r: r.xadd(stream, entry))
        return eid.decode() if isinstance(eid, bytes) else str(eid)

    # -------------------------------------------------------------- run

    def run(self) -> dict:
        try:
            self.start()
            self.echo("chaos: waiting for the first trained step ...")
            deadline = time.monotonic() + self.startup_timeout_s
            while not self.trained_steps():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no trained step within {self.startup_timeout_s:.0f}s; see {self.run_dir / 'logs'}")
                self.wait(1.0)
            self.soak_started_wall = time.time()
            t0 = time.monotonic()
            schedule = make_schedule(self.seed, self.soak_s, self.rounds, self.kinds)
            self.echo(f"chaos: soak of {self.soak_s / 60:.1f} min, {len(schedule)} faults (seed {self.seed})")
            for offset, kind in schedule:
                self.wait(max(0.0, t0 + offset - time.monotonic()))
                self.inject(Fault(kind, offset))
            self.wait(max(0.0, t0 + self.soak_s - time.monotonic()))
            self._await_steps()
            self._drain()
            return self.account()
        finally:
            self.close()

    def _await_steps(self) -> None:
        """``--min-steps``: the run goes on after the soak (no more faults) until the ledger holds that
        many steps, for at most ``drain_timeout_s``."""
        if self.min_steps and self.surviving_steps() < self.min_steps:
            self.echo(f"chaos: waiting for {self.min_steps} steps in the ledger (have {self.surviving_steps()}) ...")
        deadline = time.monotonic() + self.drain_timeout_s
        while self.surviving_steps() < self.min_steps:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.surviving_steps()} of --min-steps {self.min_steps} steps in the ledger "
                                   f"{self.drain_timeout_s:.0f}s after the soak; see {self.run_dir / 'logs'}")
            self.wait(1.0)

    def _drain(self) -> None:
        """Let the last fault recover, stop the actors, let judges and learner consume what they
        can, then stop the learner (it checkpoints and acks) and the judges."""
        for p in self.procs:
            if p.paused_until is not None:
                p.paused_until = 0.0
        last = max((f.at_wall for f in self.faults), default=0.0)
        self.echo("chaos: drain: waiting for a trained step after the last fault ...")
        deadline = time.monotonic() + self.drain_timeout_s
        while time.monotonic() < deadline and not any(s["time"] > last for s in self.trained_steps()):
            self.wait(1.0)
        for p in self.procs:
            if p.role == "actor":
                p.stop(60)
        batch = self.cfg["trainer"]["train_batch_size"]
        stable_since, seen = time.monotonic(), None
        deadline = time.monotonic() + self.drain_timeout_s
        while time.monotonic() < deadline:
            self.wait(1.0)
            state = (self.r.xlen(self.keys.rollouts), self.r.xlen(self.keys.scored), len(self.trained_steps()))
            if state != seen:
                seen, stable_since = state, time.monotonic()
            if state[0] == 0 and state[1] < batch and time.monotonic() - stable_since > 10:
                break
            if time.monotonic() - stable_since > 60:
                break
        for role in ("learner", "judge"):
            for p in self.procs:
                if p.role == role:
                    code = p.stop(180)
                    if code not in (0, None):
                        self.echo(f"chaos: {p.name} stopped with exit code {code}")

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()
        for p in self.procs:
            if p.alive:
                p.stop(30)
        if self._link is not None:
            self._link.close()
        if self.redis is not None:
            self.redis.stop()

    # -------------------------------------------------------------- accounting

    def account(self) -> dict:
        from worldloop.common.transport.control import read_stats
        from worldloop.common.contracts.schemas import decode_deadletter, decode_trajectory

        def tid_of(payload) -> str | None:
            try:
                return decode_trajectory(payload).trajectory_id
            except Exception:  # not a trajectory: a malformed entry
                return None

        produced: dict[str, str] = {}
        for path in sorted(self.produced_dir.glob("*.ids")):
            for line in path.read_text(errors="replace").splitlines():
                if re.fullmatch(r"[0-9a-f]{32}", line.strip()):
                    produced.setdefault(line.strip(), path.stem)
        by_step = ckpt.surviving_ledger(self.run_dir)  # the last line of a step wins
        trained = Counter(t for line in by_step.values() for t in line["trained"])
        steps = sorted(by_step)
        gaps = [s for s in range(1, steps[-1] + 1) if s not in by_step] if steps else []

        dead: dict[str, str] = {}
        injected = set(self.injected)
        malformed_dead, other_dead, poison_dead = 0, 0, 0
        for _eid, fields in self.r.xrange(self.keys.deadletter):
            rec = decode_deadletter(fields[b"data"])
            tid = tid_of(rec.payload)
            if (rec.source_stream, rec.source_id) in injected:
                malformed_dead += 1
            elif tid is not None and tid.startswith(faults.POISON_MARK):
                poison_dead += 1
            elif tid is not None:
                dead[tid] = rec.reason
            else:
                other_dead += 1
        queued: dict[str, str] = {}
        for stream in (self.keys.rollouts, self.keys.scored):
            for _eid, fields in self.r.xrange(stream):
                tid = tid_of(fields.get(b"data", b""))
                if tid is not None:
                    queued[tid] = stream.rsplit(":", 1)[-1]
        drops: dict[str, str] = {}
        for path in sorted((self.run_dir / "logs").glob("learner*.log")):
            for m in _DROP_RE.finditer(path.read_text(errors="replace")):
                drops[m.group(2)] = m.group(1)

        seen_elsewhere = set(trained) | set(dead) | set(queued)
        unlogged = sorted(seen_elsewhere - set(produced))
        for t in unlogged:
            produced[t] = "unlogged"
        allowed = faults.allowed_losses(self)  # logged in the second a host crash cut off the AOF
        torn = ckpt.torn_losses(self)  # trained in updates a torn checkpoint took with it
        fate: dict[str, str] = {}
        for t in produced:
            n = trained.get(t, 0)
            fate[t] = ("trained once" if n == 1 else "trained twice" if n >= 2 else "dead-lettered" if t in dead
                       else "queued" if t in queued else f"dropped ({drops[t]})" if t in drops
                       else "lost in a host crash" if t in allowed
                       else "lost with a torn checkpoint" if t in torn else "lost")
        counts = Counter(fate.values())
        logs = "".join(p.read_text(errors="replace") for p in sorted((self.run_dir / "logs").glob("*.log")))
        stats = read_stats(self.r, self.keys)
        recovery(self.faults, self.trained_steps())
        exits = {p.name: p.unexpected_exits() for p in self.procs if p.unexpected_exits()}
        return {
            "produced": len(produced), "unlogged": len(unlogged),
            "trained_once": counts["trained once"], "trained_twice": counts["trained twice"],
            "lost": counts["lost"], "lost_in_crashes": counts["lost in a host crash"],
            "lost_with_torn": counts["lost with a torn checkpoint"], "torn": self.torn,
            "dead_lettered": counts["dead-lettered"], "queued": counts["queued"],
            "dropped": {k[len("dropped ("):-1]: v for k, v in counts.items() if k.startswith("dropped")},
            "lost_ids": sorted(t for t, f in fate.items() if f == "lost"),
            "twice_ids": sorted(t for t, f in fate.items() if f == "trained twice"),
            "steps": len(steps), "ledger_gaps": gaps,
            "malformed_injected": len(self.injected), "malformed_dead_lettered": malformed_dead,
            "other_dead_letters": other_dead, "stats": stats,
            "faults": [f.__dict__ for f in self.faults], "unexpected_exits": exits,
            "actor_kills": sum(1 for f in self.faults if f.kind == "actor_kill" and f.target),
            "poison_injected": len(self.poisoned), "poison_dead_lettered": poison_dead,
            "poison_judge_exits": sum(1 for p in self.procs for _pid, code, _ours in p.exits
                                      if code in p.expected_codes),
            "second_learners": len(self.second_learners), "second_learners_refused": sum(self.second_learners),
            "refused_write_lines": logs.count("redis refused a write ("),
            "crash_cuts": len(self.crash_cuts), "crash_window_ids": len(allowed),
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=None, help="rounds of one fault of each kind (default: minutes/3)")
    ap.add_argument("--min-steps", type=int, default=0, help="after the soak, run on until the ledger holds this many steps")
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated fault kinds (default: all)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override of the run (key.sub=value, YAML value), e.g. --set actor.loop=episode; repeatable")
    args = ap.parse_args(argv)
    from worldloop.common.contracts.config_load import ConfigError, parse_override
    try:
        overrides = dict(parse_override(s) for s in args.set)
    except ConfigError as e:
        ap.error(f"--set: {e}")
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if set(kinds) - set(KINDS):
        ap.error(f"--kinds: unknown {sorted(set(kinds) - set(KINDS))}; known: {', '.join(KINDS)}")
    out = args.out or ROOT / "runs" / f"chaos-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        res = Chaos(out, seed=args.seed, minutes=args.minutes, rounds=args.rounds, min_steps=args.min_steps,
                    kinds=kinds, overrides=overrides).run()
    except RuntimeError as e:
        print(f"chaos: {e}", flush=True)
        return 2
    text = report(res, kinds)
    (Path(out) / "chaos.md").write_text(text + "\n\n" + last_line(res) + "\n")
    (Path(out) / "chaos.json").write_text(json.dumps(res, indent=1))
    print(text, flush=True)
    print(last_line(res), flush=True)
    return 1 if res["trained_twice"] or res["lost"] else 0


if __name__ == "__main__":
    sys.exit(main())
