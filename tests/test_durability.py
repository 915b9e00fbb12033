"""The durability promise (issue 31, item 5; docs/architecture.md "Durability"): a host crash that
cuts the last second off Redis's append-only file. The real stream parts run in this process on a
real redis-server with AOF: the actors' producer, a judge's consumer and Forwarder, and the
learner's reader (learner/data.py ScoredSource) with checkpoints kept on "disk" (their trained set
survives the crash, as the learner's fsynced checkpoints do). Redis is killed, its AOF truncated to
where it stood before the last writes (everysec: the writes of the last second may be lost; always:
no acknowledged write is), and everything restarts. Nothing may be trained twice, and what is lost
must be exactly the trajectories whose XADD was acknowledged after the cut, counted.

The checkpoint is a dict here; that a real learner checkpoint is on the disk (every file and folder
fsynced) before its acks is checked on the real learner in tests/test_checkpoint_integrity.py."""

from __future__ import annotations

import os
from collections import Counter

import pytest

from worldloop.common.contracts.config import config_from_dict
from worldloop.common.contracts.keys import ROLLOUTS_GROUP, Keys
from worldloop.common.transport.redis_local import LocalRedis
from worldloop.common.contracts.modeling import ChatCodec
from worldloop.common.contracts.schemas import decode_trajectory, encode_trajectory
from worldloop.common.transport.streams import FORWARDED, Forwarder, StreamConsumer, StreamProducer, connect
from worldloop.learner.data import DedupWindow, ScoredSource
from worldloop.testing.trajectories import synthetic_trajectory

from procs import wait_for

NS = "dur"


@pytest.fixture(scope="module")
def codec(shared_tiny_model) -> ChatCodec:
    return ChatCodec(shared_tiny_model(max_image_side=112), max_image_side=112)


class Run:
    """The parts of a run that live in processes: rebuilt after the crash, as restarted processes are."""

    def __init__(self, srv: LocalRedis, codec: ChatCodec, disk: dict, judge_name: str):
        self.srv, self.codec, self.keys = srv, codec, Keys(NS)
        self.cfg = config_from_dict({"redis": {"url": srv.url, "namespace": NS, "claim_idle_ms": 60_000,
                                               "reconnect_max_s": 0.2},
                                     "trainer": {"train_batch_size": 4, "ppo_mini_batch_size": 2, "micro_batch_size": 1,
                                                 "max_staleness": 100},
                                     "model": {"max_model_len": 4096}})
        self.disk = disk  # the learner's last checkpoint: its trained ids and lineage
        self.producer = StreamProducer(srv.url, self.keys.rollouts, 1000, reconnect_max_s=0.2)
        self.judge = StreamConsumer(srv.url, self.keys.rollouts, ROLLOUTS_GROUP, judge_name, block_ms=10,
                                    claim_idle_ms=0, reconnect_max_s=0.2)
        self.forwarder = Forwarder(srv.url, self.keys.rollouts, ROLLOUTS_GROUP, self.keys.scored,
                                   self.keys.judge_forwarded, max_backlog=1000, dedup_window_s=600, reconnect_max_s=0.2)
        self.lineage = list(disk.get("lineage", []))  # trained ids, in order, since the checkpoint
        self.learner = ScoredSource(self.cfg, self.keys, vocab_size=2048, codec=codec, version_fn=lambda: 0,
                                    checkpoint_version_fn=lambda: 0,
                                    dedup=DedupWindow(100, dict(disk.get("trained", {}))))
        self.learner.recover()

    def produce(self, tids: list[str], acked_at: dict[str, int]) -> None:
        r = connect(self.srv.url)
        for tid in tids:
            traj = synthetic_trajectory(self.codec, trajectory_id=tid, seed=len(acked_at), turns=2, response_tokens=4)
            self.producer.add(encode_trajectory(traj))
            # the AOF file holds this XADD once Redis has written its AOF buffer: under everysec Redis
            # acknowledges first and may postpone the write by up to 2 s while a background fsync runs
            # (a busy disk), so the file's size right after the reply can still lack it
            wait_for(lambda: r.info("persistence")["aof_buffer_length"] == 0,
                     "Redis to write its AOF buffer", 30)
            acked_at[tid] = self.srv.aof_file().stat().st_size

    def judge_pass(self, n: int) -> int:
        done = 0
        while done < n:
            msgs = self.judge.read(n - done, block_ms=10)
            if not msgs:
                break
            for m in msgs:
                tid = decode_trajectory(m.payload).trajectory_id
                done += self.forwarder.forward(m.id, m.payload, tid) == FORWARDED
        return done

    def train(self, batches: int) -> None:
        for _ in range(batches):
            items = self.learner.collect(4, lambda: False, max_wait_s=2.0)
            assert len(items) == 4
            self.learner.mark_trained(items)
            self.lineage += [it.trajectory_id for it in items]

    def checkpoint(self) -> None:
        self.disk.update(trained=self.learner.dedup.to_dict(), lineage=list(self.lineage))  # fsynced, then acked
        self.learner.ack_held()

    def close(self) -> None:
        for c in (self.producer, self.judge, self.forwarder, self.learner):
            c.close()


@pytest.mark.parametrize("fsync", ["everysec", "always"])
def test_a_host_crash_that_cuts_the_aof_loses_only_what_the_promise_allows(fsync, codec, tmp_path) -> None:
    srv = LocalRedis(data_dir=str(tmp_path / "redis"), persist=True, appendfsync=fsync).start()
    try:
        assert connect(srv.url).config_get("appendfsync")["appendfsync"] == fsync
        disk: dict = {}
        acked_at: dict[str, int] = {}
        run = Run(srv, codec, disk, "judge-1")
        run.produce([f"a{i:02d}" for i in range(16)], acked_at)
        assert run.judge_pass(12) == 12  # a12..a15 still wait in rollouts
        run.train(2)
        run.checkpoint()  # a00..a07 durable and acked
        run.train(1)  # a08..a11 trained in an update no checkpoint holds yet
        cut = srv.aof_file().stat().st_size  # the AOF as it stood a second before the crash
        # the last second: new trajectories, the rest forwarded, one more update and its checkpoint
        run.produce([f"b{i}" for i in range(4)], acked_at)
        assert run.judge_pass(8) == 8
        run.train(1)
        run.checkpoint()  # on disk: a00..a15 trained; its acks go to Redis and are cut below
        crash_size = srv.aof_file().stat().st_size
        before_crash = dict(acked_at)
        srv.stop(kill=True)  # the host crash: Redis and every process of the run die
        run.close()
        keep = cut if fsync == "everysec" else crash_size  # always: every acknowledged write was on disk
        os.truncate(srv.aof_file(), keep)
        srv.start()

        run = Run(srv, codec, disk, "judge-2")  # every process restarts; the learner from its checkpoint
        run.produce([f"c{i}" for i in range(4)], acked_at)
        while run.judge_pass(64):
            pass
        while connect(srv.url).xlen(run.keys.scored) - len(run.learner._held) >= 4:
            run.train(1)
        run.checkpoint()
        trained = Counter(run.lineage)
        assert max(trained.values()) == 1, trained  # nothing trained twice in the surviving lineage
        lost = set(acked_at) - set(trained)
        promised = {t for t, size in before_crash.items() if size > keep}  # acknowledged after the cut
        assert lost == promised
        assert len(lost) == (4 if fsync == "everysec" else 0)  # b0..b3 under everysec, nothing under always
        assert set(trained) == {f"a{i:02d}" for i in range(16)} | {f"c{i}" for i in range(4)} | (
            set() if fsync == "everysec" else {f"b{i}" for i in range(4)})
        run.close()
    finally:
        srv.close()
