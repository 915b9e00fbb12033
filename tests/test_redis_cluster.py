"""worldloop on a Redis Cluster, and the hash-tagged key names that make it possible (issue 38).

1. Every key of a namespace is ``{ns}:...``: one hash slot (hand-checked slots and a property test).
2. The old names (``ns:rollouts``) are renamed on a single Redis by the first process that starts,
   pending entries and TTLs included; a key under both names refuses with the commands to settle it.
3. A real 3-primary + 3-replica cluster made by the test (``LocalRedisCluster``): the admission,
   lease, fenced-ack and forward scripts run there through a ``redis+cluster://`` URL, and the old
   names' scripts fail with a cross-slot error.
4. A short run through that cluster, a real ``worldloop judge`` between an actor-like producer and a
   learner-like consumer (admission, the learner lease's fence, acks), with the primary that serves
   the run killed -9 mid-run: the run goes on on the promoted replica, every trajectory is trained
   once, and any trajectory lost is one acknowledged just before the kill (counted and bounded).
"""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import redis
import yaml
from redis.crc import key_slot

from worldloop.common.transport.admission import Admission
from worldloop.common.contracts.config import ConfigError, load_config
from worldloop.common.transport.key_migration import LegacyKeysClash, legacy_keys_left, migrate_legacy_keys
from worldloop.common.contracts.keys import KEY_NAMES, ROLLOUTS_GROUP, SCORED_GROUP, Keys
from worldloop.common.transport.lease import LearnerLease
from worldloop.common.metrics import ephemeral_range, free_port
from worldloop.common.transport.redis_cluster_local import LocalRedisCluster
from worldloop.common.transport.redis_link import REDIS_PASSWORD_ENV, RedisLink, RedisUnreachable, connect
from worldloop.common.contracts.schemas import decode_trajectory, encode_trajectory
from worldloop.common.transport.streams import FORWARDED, LOST_RACE, Forwarder, StreamConsumer, StreamProducer
from worldloop import status
from tests.procs import Child, wait_for
from tests.test_judge_rule import judge_trajectory, sokoban_state


def _trajectory(i: int):
    before = sokoban_state((3, 1 + i % 3), [(2, 2)], [(1, 3)])
    after = sokoban_state((3, 2 + i % 3), [(2, 2)], [(1, 3)])
    return judge_trajectory(f"traj-{i:03d}", [(". ".join(before["relations"]), ". ".join(after["relations"]),
                                               before, after)])


# ----------------------------------------------------------------------------- 1. one slot per namespace


def test_every_key_of_a_namespace_has_its_hash_tag_and_one_slot() -> None:
    keys = Keys("demo")
    assert keys.rollouts == "{demo}:rollouts" and keys.learner_owner == "{demo}:learner:owner"
    assert keys.legacy()["{demo}:judge:forwarded"] == "demo:judge:forwarded"
    # CRC16 of "demo" mod 16384 (what CLUSTER KEYSLOT answers for every {demo}:... key); the old
    # names hashed whole: demo:rollouts and demo:scored land in different slots
    slots = {key_slot(k.encode()) for k in keys.names().values()}
    assert slots == {key_slot(b"demo")}
    assert key_slot(b"demo:rollouts") != key_slot(b"demo:scored")
    assert len(keys.names()) == len(KEY_NAMES) == 15  # with {ns}:learner:inflight (issue 38, finding 3)
    with pytest.raises(ValueError, match="hold no braces"):
        Keys("a}b")


@pytest.mark.parametrize("ns", ["worldloop", "a", "x:y", "run-2026/11", "ümlaut ns", ":", "a:b:rollouts", "0" * 64])
def test_any_namespace_keeps_all_its_keys_in_one_slot_and_maps_back(ns: str) -> None:
    keys = Keys(ns)
    names = keys.names()
    assert {key_slot(k.encode()) for k in names.values()} == {key_slot(ns.encode())}
    legacy = keys.legacy()
    assert set(legacy) == set(names.values()) and len(set(legacy.values())) == len(names)
    assert all(old == ns + ":" + new.split("}:", 1)[1] for new, old in legacy.items())


def test_config_takes_a_cluster_url_and_refuses_a_namespace_with_braces() -> None:
    cfg = load_config(None, ["redis.url=redis+cluster://10.0.0.5:7000", "redis.namespace=run-1"])
    assert cfg.redis.url == "redis+cluster://10.0.0.5:7000"
    with pytest.raises(ConfigError, match=r"redis\.namespace.*no \{ or \}"):
        load_config(None, ["redis.namespace=a{b}"])
    with pytest.raises(ConfigError, match=r"redis\.url.*redis\+cluster://"):
        load_config(None, ["redis.url=cluster://10.0.0.5:7000"])


# ----------------------------------------------------------------------------- 2. old names on one Redis


def test_old_key_names_are_renamed_with_their_groups_pending_entries_and_ttl(redis_url: str) -> None:
    keys, r = Keys("old"), connect(redis_url)
    legacy = keys.legacy()
    # a run of the worldloop before issue 38: entries in rollouts, one delivered and pending, a lease
    old_rollouts, old_lease = legacy[keys.rollouts], legacy[keys.learner_lease]
    for i in range(3):
        r.xadd(old_rollouts, {b"data": encode_trajectory(_trajectory(i))})
    r.xgroup_create(old_rollouts, ROLLOUTS_GROUP, id="0")
    r.xreadgroup(ROLLOUTS_GROUP, "judge-1", {old_rollouts: ">"}, count=1)
    r.hset(old_lease, mapping={"token": "7-abc"})
    r.pexpire(old_lease, 60_000)
    r.hset(legacy[keys.control], mapping={"policy_version": "12"})
    assert legacy_keys_left(r, keys) == [old_rollouts, legacy[keys.control], old_lease]
    assert f"keys under their old names (before {{old}}:...; the next role or `worldloop up` to start renames " \
           f"them): {old_rollouts}, old:control, {old_lease}" in status.render(status.collect(r, keys))

    moved = migrate_legacy_keys(r, keys)
    assert moved == [old_rollouts, legacy[keys.control], old_lease]
    assert not r.exists(*legacy.values()) and legacy_keys_left(r, keys) == []
    assert r.xlen(keys.rollouts) == 3
    assert r.xpending(keys.rollouts, ROLLOUTS_GROUP)["pending"] == 1  # the group and its pending list moved along
    assert 0 < r.pttl(keys.learner_lease) <= 60_000 and r.hget(keys.control, "policy_version") == b"12"
    assert migrate_legacy_keys(r, keys) == []  # the second process to start finds nothing to move

    # an older worldloop still running writes an old name again: both exist, nothing is renamed
    r.hset(legacy[keys.control], mapping={"policy_version": "13"})
    r.xadd(legacy[keys.scored], {b"data": b"x"})
    with pytest.raises(LegacyKeysClash, match=r"old:control and \{old\}:control.*stop every process.*RENAME"):
        migrate_legacy_keys(r, keys)
    assert r.exists(legacy[keys.scored]) and not r.exists(keys.scored)  # all or none
    assert r.hget(keys.control, "policy_version") == b"12"


def test_a_role_start_renames_the_old_keys_before_it_uses_them(redis_url: str, tmp_path: Path) -> None:
    """``worldloop judge`` (any role: ProcessScaffold.start) moves an old run's rollouts and then judges them."""
    keys, r = Keys("upgrade"), connect(redis_url)
    old = keys.legacy()[keys.rollouts]
    for i in range(3):
        r.xadd(old, {b"data": encode_trajectory(_trajectory(i))})
    cfg = {"redis": {"url": redis_url, "namespace": keys.ns, "block_ms": 200},
           "judge": {"scorers": {"sokoban": ["rule"]}}, "metrics": {"enabled": False}}
    (tmp_path / "judge.yaml").write_text(yaml.safe_dump(cfg))
    judge = Child(["judge", "--config", str(tmp_path / "judge.yaml")], tmp_path / "judge.log")
    try:
        wait_for(lambda: r.xlen(keys.scored) == 3, "the judge to score the renamed rollouts", 90, [judge])
    finally:
        judge.proc.terminate()
        judge.wait(30)
    assert not r.exists(old) and r.xlen(keys.rollouts) == 0
    assert "renamed 1 keys from their old names" in judge.output(None)


# ----------------------------------------------------------------------------- 3. the scripts on a cluster


_PASSWORD = "cluster-pw-not-in-any-url"


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch):
    """3 primaries, a replica each, every node behind a password that the clients (and the judge
    processes, which inherit the environment) take from $WORLDLOOP_REDIS_PASSWORD."""
    c = LocalRedisCluster(primaries=3, replicas=1, node_timeout_ms=1000, password=_PASSWORD).start()
    monkeypatch.setenv(REDIS_PASSWORD_ENV, _PASSWORD)
    try:
        yield c
    finally:
        c.close()


def test_cluster_url_runs_every_multi_key_script_and_old_names_would_not(cluster: LocalRedisCluster) -> None:
    url, keys = cluster.url, Keys("c1")
    assert url.startswith("redis+cluster://127.0.0.1:")
    r = connect(url)
    assert isinstance(r, redis.RedisCluster)
    assert len({cluster.primary_of(k) for k in keys.names().values()}) == 1  # the whole run on one primary
    with pytest.raises(ValueError, match="only database 0"):
        connect(url + "/2")
    with pytest.raises(redis.ConnectionError, match="cannot reach the Redis Cluster at cluster 127.0.0.1.*invalid username-password"):
        connect(url.replace("://", "://:wrong@"))  # a password in the URL wins over the environment's

    adm = Admission(url, keys, max_staleness=0, batch_size=4)
    assert adm.admit(["t0", "t1"], actor_version=0).admitted
    adm.settle("t0")
    lease = LearnerLease(url, keys, 30.0, holder="test").acquire()
    lease.hset(keys.control, {"policy_version": 1})
    prod = StreamProducer(url, keys.rollouts, 10)
    prod.add(encode_trajectory(_trajectory(0)))
    judge = StreamConsumer(url, keys.rollouts, ROLLOUTS_GROUP, "j", decode=decode_trajectory)
    fw = Forwarder(url, keys.rollouts, ROLLOUTS_GROUP, keys.scored, keys.judge_forwarded, max_backlog=10,
                   dedup_window_s=60)
    (m,) = judge.read(1, block_ms=100)
    # a second judge reclaims it (XAUTOCLAIM, then a pipeline of XRANGE + XPENDING), counts an attempt
    # (XCLAIM RETRYCOUNT); the first no longer holds it (touch: XPENDING), leaves the group (XINFO, DELCONSUMER)
    thief = StreamConsumer(url, keys.rollouts, ROLLOUTS_GROUP, "j2", decode=decode_trajectory, claim_idle_ms=0,
                           max_deliveries=5)
    (m2,) = thief.read(1, block_ms=100)
    assert m2.id == m.id and m2.reclaimed and thief.attempt(m2) and m2.deliveries == 2
    assert judge.touch([m.id]) == 0 and judge.leave()
    assert fw.forward(m2.id, m2.payload, m2.value.trajectory_id) == FORWARDED
    assert fw.forward(m.id, m.payload, m.value.trajectory_id) == LOST_RACE  # the slow judge adds nothing
    learner = StreamConsumer(url, keys.scored, SCORED_GROUP, "learner-0", decode=decode_trajectory,
                             deadletter_stream=keys.deadletter, stats_key=keys.stats, fence=lease.fence)
    (s,) = learner.read(1, block_ms=100)
    assert learner.ack([s.id], counters={s.id: "trained"}) == 1
    assert adm.release(["t0"], refund=False) == 1 and adm.release(["t1"], refund=True) == 1
    assert adm.state() == {"admitted": 1, "refunded": 1, "leases": 0}  # 2 admitted - 1 refunded
    assert r.hget(keys.stats, "trained") == b"1" and r.xlen(keys.scored) == 0 and r.xlen(keys.rollouts) == 0
    assert r.hget(keys.control, "policy_version") == b"1"

    # the same forward with the names before the hash tag spans three slots: refused by the cluster client
    old = keys.legacy()
    fw_old = Forwarder(url, old[keys.rollouts], ROLLOUTS_GROUP, old[keys.scored], old[keys.judge_forwarded],
                       max_backlog=10, dedup_window_s=60)
    with pytest.raises(redis.RedisClusterException, match="same key slot"):
        fw_old.forward("1-0", b"x", "t9")
    assert migrate_legacy_keys(r, keys) == [] and legacy_keys_left(r, keys) == []  # nothing to move on a cluster
    info = status.collect(r, keys)  # `worldloop status` reads a run on a cluster too
    assert [(s["stream"], s["length"]) for s in info["streams"]] == [(keys.rollouts, 0), (keys.scored, 0),
                                                                    (keys.deadletter, 0)]
    assert [g["name"] for g in info["streams"][0]["groups"]] == [ROLLOUTS_GROUP] and info["legacy"] == []
    assert info["control"]["policy_version"] == 1 and info["stats"] == {"trained": 1}
    for c in (adm, lease, prod, judge, thief, fw, learner, fw_old):
        c.close()


def test_a_cluster_url_that_no_node_answers_fails_at_start_up_not_at_construction() -> None:
    url = f"redis+cluster://127.0.0.1:{free_port()}"
    link = RedisLink(url, "x", reconnect_max_s=0.1, socket_timeout_s=1.0, startup_timeout_s=0.5)  # builds nothing yet
    with pytest.raises(RedisUnreachable, match=r"cannot reach Redis at cluster 127\.0\.0\.1:\d+ for 0\.5s"):
        link.call(lambda r: r.ping())
    link.close()


def test_a_node_whose_port_was_taken_meanwhile_starts_again_on_another() -> None:
    """The suite once failed when another process bound a node's drawn port before the node did:
    the node exited at its bind and the cluster waited 30 s for it. Here a listening socket holds the
    first node's port from the draw on; the node starts again on a new pair, and the cluster forms."""
    c = LocalRedisCluster(primaries=3, replicas=0, node_timeout_ms=500)
    held = c.ports[0]
    blocker = socket.socket()
    try:
        blocker.bind(("127.0.0.1", held))
        blocker.listen()
        with c:
            assert held not in c.ports and len(set(c.ports)) == 3
            assert all(p < ephemeral_range()[0] and p + 10000 < ephemeral_range()[0] for p in c.ports)
            assert sorted(c.primary_ports()) == sorted(c.ports)
            r = redis.RedisCluster.from_url(c.url.replace("redis+cluster", "redis"))
            r.set("{t}:a", "1")
            assert r.get("{t}:a") == b"1"
            r.close()
            assert "Address already in use" in (c.data_dir / str(held) / "redis.log").read_text()
    finally:
        blocker.close()
        c.close()


def test_a_link_waits_out_clusterdown_until_the_cluster_is_whole_again() -> None:
    """A primary without a replica dies: the whole cluster answers CLUSTERDOWN (full coverage) for
    every key, also the run's on a live node. The link retries that like an outage (before issue 38
    redis-py's ClusterDownError, a ResponseError, was raised at once and a role exited), and its call
    completes once the node is back."""
    with LocalRedisCluster(primaries=3, replicas=0, node_timeout_ms=500) as c:
        keys = Keys("cd")
        victim = next(p for p in c.primary_ports() if p != c.primary_of(keys.control))
        link = RedisLink(c.url, keys.control, reconnect_max_s=0.2, socket_timeout_s=2.0)
        # the value, not HSET's count of new fields: a reply lost to the socket timeout on a loaded
        # machine makes the link send the HSET again, and the second one counts 0 new fields
        link.call(lambda r: r.hset(keys.control, "policy_version", 1))
        assert connect(c.url).hget(keys.control, "policy_version") == b"1"
        c.kill(victim)
        wait_for(lambda: _cluster_down(link), "the cluster to say it is down", 30)
        seen: list[str] = []
        failed = threading.Event()  # the call raised: nothing to restart for

        def restart_once_tried_again() -> None:
            # the node comes back only after the link was refused and called again: a fixed delay raced
            # redis-py's own retries inside one try, which outlast 5 s on a loaded machine (one try seen)
            deadline = time.monotonic() + 60
            while len(seen) < 2 and time.monotonic() < deadline and not failed.is_set():
                time.sleep(0.05)
            if not failed.is_set():
                c.restart(victim)

        restarter = threading.Thread(target=restart_once_tried_again, daemon=True)
        restarter.start()
        try:
            assert link.call(lambda r: seen.append("try") or r.hset(keys.control, "policy_version", 2)) == 0
        except BaseException:
            failed.set()
            raise
        finally:
            restarter.join()
            link.close()
        assert len(seen) >= 2  # at least one try refused, then the one that went through
        assert connect(c.url).hget(keys.control, "policy_version") == b"2"


def _cluster_down(link: RedisLink) -> bool:
    try:
        link.r.hget(Keys("cd").control, "policy_version")
    except redis.exceptions.ClusterDownError:
        return True
    return False


# ----------------------------------------------------------------------------- 4. a run through a failover


class _Run:
    """An actor-like producer (admit, XADD, settle) and a learner-like consumer (lease, fenced acks,
    retire, a trained set that drops second copies the way the learner's ledger does)."""

    def __init__(self, url: str, keys: Keys, n: int):
        self.url, self.keys, self.n = url, keys, n
        self.acked_at: dict[str, float] = {}  # trajectory id -> when its XADD returned
        self.deliveries: Counter[str] = Counter()
        self.trained: list[str] = []
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        links = dict(reconnect_max_s=0.5, socket_timeout_s=2.0)
        self.admission = Admission(url, keys, max_staleness=0, batch_size=n, **links)
        self.lease = LearnerLease(url, keys, 30.0, holder="test learner", **links).acquire()
        self.consumer = StreamConsumer(url, keys.scored, SCORED_GROUP, "learner-0", decode=decode_trajectory,
                                       deadletter_stream=keys.deadletter, block_ms=200, claim_idle_ms=1000,
                                       stats_key=keys.stats, fence=self.lease.fence, **links)
        self.producer = StreamProducer(url, keys.rollouts, 1000, **links)

    def produce(self, pace_s: float) -> None:
        try:
            for i in range(self.n):
                tid = f"traj-{i:03d}"
                assert self.admission.admit([tid], actor_version=0).admitted
                self.producer.add(encode_trajectory(_trajectory(i)))
                self.acked_at[tid] = time.monotonic()
                self.admission.settle(tid)
                time.sleep(pace_s)
        except BaseException as e:  # surfaced by the test
            self.errors.append(e)

    def learn(self) -> None:
        try:
            while not self.stop.is_set():
                msgs = self.consumer.read(16, block_ms=200)
                new = []
                for m in msgs:
                    tid = m.value.trajectory_id
                    self.deliveries[tid] += 1
                    if tid not in self.trained:
                        self.trained.append(tid)
                        new.append(tid)
                if msgs:
                    self.consumer.ack([m.id for m in msgs], counters={m.id: "test_trained" for m in msgs})
                    self.admission.release(new, refund=False)
        except BaseException as e:
            self.errors.append(e)

    def close(self) -> None:
        for c in (self.producer, self.consumer, self.admission):
            c.close()
        self.lease.close()


def test_a_run_through_a_cluster_primary_killed_and_failed_over(cluster: LocalRedisCluster, tmp_path: Path) -> None:
    url, keys, n = cluster.url, Keys("fo"), 64
    r = connect(url)
    cfg = {"redis": {"url": url, "namespace": keys.ns, "block_ms": 200, "claim_idle_ms": 1000,
                     "reconnect_max_s": 0.5, "socket_timeout_s": 2.0},
           "judge": {"scorers": {"sokoban": ["rule"]}}, "trainer": {"max_staleness": 0, "train_batch_size": n},
           "metrics": {"enabled": False}}
    (tmp_path / "judge.yaml").write_text(yaml.safe_dump(cfg))
    judge = Child(["judge", "--config", str(tmp_path / "judge.yaml")], tmp_path / "judge.log")
    run = _Run(url, keys, n)
    threads = [threading.Thread(target=run.produce, args=(0.05,)), threading.Thread(target=run.learn)]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: len(run.trained) >= n // 3 or run.errors, "a third of the run trained", 90, [judge])
        killed = cluster.kill_primary_of(keys.rollouts)  # every key of the run is served there
        killed_at = time.monotonic()
        promoted = cluster.wait_failover(killed, keys.rollouts, timeout=30)
        failed_over_at = time.monotonic()
        threads[0].join(60)
        assert not threads[0].is_alive() and not run.errors, run.errors

        def drained() -> bool:  # an entry leaves its stream only when acked: forwarded, or trained (ack = XDEL)
            return r.xlen(keys.rollouts) == 0 and r.xlen(keys.scored) == 0

        wait_for(lambda: drained() or run.errors, "the streams to drain after the failover", 60, [judge])
        assert judge.returncode is None  # the judge rode out the failover
        judge.proc.terminate()
        assert judge.wait(30) == 0, judge.describe()
    finally:
        run.stop.set()
        threads[1].join(10)
        judge.kill()
        run.close()
    assert not run.errors, run.errors
    assert promoted != killed
    produced = set(run.acked_at)
    assert len(produced) == n  # every XADD returned, before, during and after the failover
    assert len(run.trained) == len(set(run.trained))  # nothing trained twice
    lost = produced - set(run.trained)
    # the promise on a cluster: a replica holds a prefix of its primary's writes (asynchronous
    # replication, in order), so only the last writes the old primary acknowledged before it died can
    # be lost: the lost trajectories are consecutive ones (the producer is sequential), all acknowledged
    # before the failover ended; nothing written to the promoted replica is lost
    lost_idx = sorted(int(t.split("-")[1]) for t in lost)
    assert lost_idx == list(range(lost_idx[0], lost_idx[0] + len(lost))) if lost else True, lost_idx
    assert all(run.acked_at[t] < failed_over_at for t in lost), (lost, killed_at, failed_over_at)
    redelivered = sum(c - 1 for c in run.deliveries.values())  # second copies the trained set dropped
    adm = {k.decode(): int(v) for k, v in r.hgetall(keys.admission).items()}
    ids = {x.decode() for x in r.smembers(keys.admission_ids)}
    print(f"cluster failover {killed} -> {promoted}: produced {n}, trained {len(run.trained)}, lost {len(lost)}, "
          f"second copies dropped {redelivered}, admission {adm}, ids still admitted {len(ids)}")
    # admission: each trajectory admitted once (an admission in that lost suffix is lost with it:
    # at most one per lost trajectory, plus the one whose XADD was in flight and went to the new
    # primary); a retired one leaves the id set, a lost one stays (unless its admission was lost too)
    assert n - len(lost) - 1 <= adm["admitted"] <= n and adm.get("refunded", 0) == 0
    assert ids <= produced and len(ids - lost) <= 16  # + a learner's release of one read in that suffix
    # the ack script counts an entry only when its XACK acks it: once per trained trajectory, also
    # when an ack was lost with the old primary (the entry came back, its second copy was acked and
    # counted in its place, the XACK and the count having been lost together)
    assert int(r.hget(keys.stats, "test_trained")) == len(run.trained)
    assert not run.lease.lost.is_set()  # the learner kept its lease (and its fence) through the failover
