"""What a process does when Redis is wrong or gone (issue: chaos soak, bugs 1, 2 and 5).

* A wrong but well-formed ``redis.url`` (a closed port) fails after ``redis.startup_timeout_s``
  with "cannot reach Redis at host:port ..., check redis.url" and exit code 2, never endless
  warnings; the password is never printed.
* A process asked to stop while Redis is unreachable stops: every stream primitive honours the
  stop, including the producer's backlog check and the consumer's set-up and reads.
* A judge that stops cleanly leaves its consumer group; dead judges' names are pruned once they
  hold nothing.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest
import yaml
from redis.exceptions import ConnectionError as RedisConnectionError

from lossy_proxy import LossyProxy
from procs import Child, returns_within, wait_for
from worldloop.common.contracts.keys import ROLLOUTS_GROUP, Keys
from worldloop.common.metrics import free_port
from worldloop.common.transport.redis_local import LocalRedis
from worldloop.common.transport.streams import (AddOutcomeUnknown, RedisUnreachable, StopRequested, StreamConsumer,
                                                 StreamProducer, connect)


def _judge_config(tmp_path: Path, name: str, url: str, **redis) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"redis": {"url": url, "namespace": name, **redis},
                                    "metrics": {"enabled": False}, "judge": {"scorers": {"default": ["rule"]}}}))
    return path


def test_a_wrong_redis_url_fails_at_start_up_with_the_address(tmp_path: Path) -> None:
    port = free_port()
    conf = _judge_config(tmp_path, "wrong", f"redis://:s3cret@127.0.0.1:{port}/0", startup_timeout_s=2)
    child = Child(["judge", "--config", str(conf)], tmp_path / "wrong.log")
    try:
        rc = child.proc.wait(timeout=60)
    finally:
        child.kill()
    out = child.output(None)
    assert rc == 2, out[-3000:]
    assert f"cannot reach Redis at 127.0.0.1:{port}/0" in out and "check redis.url" in out
    assert "s3cret" not in out


def test_the_startup_wait_is_bounded_but_reconnects_after_start_are_patient() -> None:
    port = free_port()
    with pytest.raises(RedisUnreachable, match="check redis.url"):  # gives up by itself, does not retry for ever
        returns_within(lambda: StreamProducer(f"redis://127.0.0.1:{port}/0", "s", 10, startup_timeout_s=1.0).backlog(),
                       "a first call to an unreachable Redis with startup_timeout_s=1", 60)
    srv = LocalRedis().start()
    try:
        prod = StreamProducer(srv.url, "s", 10, startup_timeout_s=0.5, reconnect_max_s=0.2)
        prod.add(b"x")  # reached once: from now on a restart is waited out
        srv.stop(kill=True)
        threading.Timer(2.0, srv.restart).start()  # longer than startup_timeout_s
        prod.add(b"y")
        assert connect(srv.url).xlen("s") >= 1
        prod.close()
    finally:
        srv.close()


def test_stream_calls_honour_a_stop_while_redis_is_down() -> None:
    srv = LocalRedis().start()
    stop = threading.Event()
    try:
        prod = StreamProducer(srv.url, "s", 10, should_stop=stop.is_set, reconnect_max_s=0.2)
        cons = StreamConsumer(srv.url, "s", "g", "c", should_stop=stop.is_set, reconnect_max_s=0.2, block_ms=100)
        prod.add(b"x")
        assert len(cons.read(1)) == 1
        srv.stop(kill=True)
        threading.Timer(1.0, stop.set).start()
        # the backlog check used to retry for ever here; now the connection error ends the call once
        # the stop is set (and only then: until it, a reconnect after start-up is patient)
        with pytest.raises((StopRequested, RedisConnectionError), match="(?i)stop|connection refused|connect"):
            returns_within(lambda: prod.add(b"y"), "prod.add with Redis down after the stop", 60)
        assert stop.is_set()
        with pytest.raises(RedisConnectionError, match="(?i)connect"):  # and so did reads
            returns_within(lambda: cons.read(1), "cons.read with Redis down after the stop", 60)
    finally:
        srv.close()


def test_a_judge_stops_on_sigterm_while_redis_is_gone(tmp_path: Path) -> None:
    srv = LocalRedis().start()
    conf = _judge_config(tmp_path, "gone", srv.url, reconnect_max_s=0.5)
    child = Child(["judge", "--config", str(conf)], tmp_path / "gone.log")
    try:
        r = connect(srv.url)
        keys = Keys("gone")
        wait_for(lambda: r.hlen(keys.procs) > 0 or None, "the judge's heartbeat", 120, [child])
        srv.stop(kill=True)
        wait_for(lambda: "reconnecting in" in child.output(None), "the judge to retry its Redis calls", 60, [child])
        child.proc.send_signal(signal.SIGTERM)
        rc = child.wait(timeout=60)  # a liveness bound: it used to retry for ever
        assert rc == 0, child.output(None)[-3000:]
    finally:
        child.kill()
        srv.close()


def test_judges_leave_the_group_and_dead_names_are_pruned(redis_url: str) -> None:
    keys = Keys("leave")
    prod = StreamProducer(redis_url, keys.rollouts, 10)
    prod.add(b"x")
    dead = StreamConsumer(redis_url, keys.rollouts, ROLLOUTS_GROUP, "dead-judge", block_ms=10)
    live = StreamConsumer(redis_url, keys.rollouts, ROLLOUTS_GROUP, "live-judge", block_ms=10)
    (m,) = dead.read(1)  # the dead judge holds an entry: it must stay listed until it is reclaimed
    r = connect(redis_url)
    for name in ("idle-judge", "live-judge"):  # judges that read once and hold nothing
        r.xgroup_createconsumer(keys.rollouts, ROLLOUTS_GROUP, name)
    names = lambda: sorted(c["name"].decode() for c in r.xinfo_consumers(keys.rollouts, ROLLOUTS_GROUP))  # noqa: E731
    assert names() == ["dead-judge", "idle-judge", "live-judge"]
    time.sleep(0.05)
    assert live.prune_consumers(idle_ms=10) == ["idle-judge"]
    assert names() == ["dead-judge", "live-judge"]
    assert not dead.leave()  # still holds m: stays
    dead.ack([m.id])
    assert dead.leave()
    assert names() == ["live-judge"]


@pytest.mark.slow
def test_a_learner_step_rides_out_a_redis_restart_at_its_control_write(tmp_path: Path, shared_tiny_model) -> None:
    """Redis dies after an update's compute and before the learner writes the new version to the
    control record and reads the run-wide counters (the chaos soak's ``redis_kill`` landing there
    ended the learner with a ConnectionError): the step waits Redis out and completes."""
    from worldloop.common.transport.control import read_control
    from worldloop.common.contracts.keys import Keys
    from worldloop.common.contracts.modeling import ChatCodec
    from worldloop.common.contracts.schemas import encode_trajectory
    from worldloop.learner.engine import init_distributed
    from worldloop.learner.process import Learner
    from worldloop.testing.trajectories import synthetic_trajectory
    from worldloop.testing.learner import tiny_learner_config

    model = shared_tiny_model(max_image_side=56)
    srv = LocalRedis(data_dir=str(tmp_path / "redis"), persist=True).start()
    learner = None
    try:
        cfg = tiny_learner_config(model, srv.url, tmp_path / "run", namespace="outage", max_image_side=56,
                                  total_steps=1, checkpoint_every=100)
        cfg.redis.reconnect_max_s = 0.5
        keys = Keys("outage")
        codec = ChatCodec(model, max_image_side=56)
        prod = StreamProducer(srv.url, keys.scored, 100)
        for i in range(4):
            prod.add(encode_trajectory(synthetic_trajectory(codec, trajectory_id=f"o{i}", seed=i, response_tokens=4,
                                                            success=i % 2 == 1, env_reward=float(i % 2))))
        prod.close()
        learner = Learner(cfg, init_distributed(cfg))
        mark_trained = learner.source.mark_trained
        outage: dict = {}

        def trained_then_redis_dies(items):  # the last Redis call of a step before its control write
            mark_trained(items)
            srv.stop(kill=True)
            # longer than redis-py's own retries of a command (10 tries, backoff capped at 1 s)
            outage["timer"] = threading.Timer(6.0, srv.restart)
            outage["timer"].start()

        learner.source.mark_trained = trained_then_redis_dies
        rec = learner.step()
        outage["timer"].join()
        assert rec is not None and rec["step"] == 1 and rec["policy_version"] == 1
        assert rec["trajectories"] == 4 and "dropped" in rec
        assert read_control(connect(srv.url), keys)["policy_version"] == 1
    finally:
        if learner is not None:
            learner.close()
        srv.close()


def test_an_xadd_left_unanswered_by_a_stop_says_the_entry_may_be_in() -> None:
    """Over a lossy link an XADD's reply can be lost after Redis ran it. A producer asked to stop
    while its XADD is unanswered cannot say "not pushed": it raises AddOutcomeUnknown (the actor
    then logs the id as uncertain, ``ProducedLog.record_uncertain``). Here a relay loses the XADD's
    reply: the entry is in the stream."""
    srv = LocalRedis().start()
    proxy = LossyProxy(srv.port)
    try:
        r = connect(srv.url)
        prod = StreamProducer(proxy.url(), "s", 10, reconnect_max_s=0.2, should_stop=lambda: True)
        assert prod.backlog() == 0  # the stop is consulted only once a call fails
        proxy.lose_reply_to(b"XADD")
        with pytest.raises(AddOutcomeUnknown, match="XADD to s went unanswered .*may be in the stream"):
            prod.add(b"x")
        assert proxy.lost == 1 and r.xlen("s") == 1  # Redis ran it: "not pushed" would have been wrong
        with pytest.raises(StopRequested, match="stopped while waiting for room in s"):  # before any XADD: a sure no
            StreamProducer(srv.url, "s", 1, should_stop=lambda: True).add(b"y")
        assert r.xlen("s") == 1
        prod.close()
    finally:
        proxy.close()
        srv.close()
