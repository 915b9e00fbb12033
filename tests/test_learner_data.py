"""Learner data path on a real redis-server: validation, staleness, dedup, dead letters, holding
entries pending until a checkpoint, recovery of a killed learner's pending entries, and micro-batch
slicing that keeps images with their sequence. No DeepSpeed here (fast)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import redis
import torch

from worldloop.common.contracts.config import ConfigError, config_from_dict
from worldloop.common.transport.control import read_stats
from worldloop.common.contracts.keys import Keys, SCORED_GROUP
from worldloop.common.contracts.modeling import ChatCodec, build_sequence, collate
from worldloop.common.contracts.schemas import Trajectory, decode_deadletter, encode_trajectory
from worldloop.common.transport.streams import StreamProducer, connect
from worldloop.learner.data import (
    DedupWindow,
    ScoredSource,
    Unusable,
    check_pending_fits,
    check_usable,
    decode_batch,
    encode_batch,
    whole_group_fraction,
)
from worldloop.learner.microbatch import micro_slices
from worldloop.testing.trajectories import synthetic_trajectory

NS = "ld"


@pytest.fixture(scope="module")
def model_dir(shared_tiny_model) -> Path:
    return shared_tiny_model(max_image_side=112)


@pytest.fixture(scope="module")
def codec(model_dir) -> ChatCodec:
    return ChatCodec(model_dir, max_image_side=112)


VOCAB = 2048


def _cfg(url: str, actor: dict | None = None, **trainer):
    return config_from_dict({"redis": {"url": url, "namespace": NS, "claim_idle_ms": 60_000},
                             "actor": actor or {},
                             "trainer": {"train_batch_size": 4, "ppo_mini_batch_size": 2, "micro_batch_size": 1,
                                         "max_staleness": 2, **trainer},
                             "model": {"max_model_len": 4096}})


class _Versions:
    def __init__(self, current: int = 0, checkpointed: int = 0):
        self.current = current
        self.checkpointed = checkpointed


def _source(cfg, codec, versions: _Versions, dedup: DedupWindow | None = None) -> ScoredSource:
    return ScoredSource(cfg, Keys(NS), vocab_size=VOCAB, codec=codec, version_fn=lambda: versions.current,
                        checkpoint_version_fn=lambda: versions.checkpointed,
                        dedup=dedup or DedupWindow(cfg.trainer.max_staleness))


def _pending(url: str) -> int:
    return int(connect(url).xpending(Keys(NS).scored, SCORED_GROUP)["pending"])


def _traj(codec, tid, **kw):
    return synthetic_trajectory(codec, trajectory_id=tid, seed=abs(hash(tid)) % 1000, turns=2, response_tokens=4, **kw)


# --------------------------------------------------------------------------- pure parts


def test_dedup_window_keeps_exactly_the_ids_staleness_does_not_drop():
    w = DedupWindow(max_staleness=2)
    w.add("a", 3)  # oldest turn generated at version 3
    w.add("b", 5)
    # at learner version 5: lag of a = 2 <= 2, a copy of a could still be trained -> keep it
    assert w.prune(5) == 0 and "a" in w
    # at version 6: lag of a = 3 > 2, staleness drops any copy of a -> forget it; b (lag 1) stays
    assert w.prune(6) == 1 and "a" not in w and "b" in w
    assert w.to_dict() == {"b": 5}
    assert not w.is_durable("b")
    w.mark_durable()
    assert w.is_durable("b")
    restored = DedupWindow(2, w.to_dict())  # from a checkpoint: durable at once
    assert restored.is_durable("b") and len(restored) == 1


def test_check_usable_gives_reasons(codec):
    ok = _traj(codec, "ok")
    layout = check_usable(ok, vocab_size=VOCAB, max_len=4096, codec=codec)
    assert len(layout) == sum(len(t.obs_ids) + len(t.response_ids) for t in ok.turns)

    bad_vocab = _traj(codec, "v")
    bad_vocab.turns[1].response_ids[0] = VOCAB + 7
    with pytest.raises(Unusable, match=r"token id\(s\) \[2055\] outside the vocabulary \[0, 2048\)"):
        check_usable(bad_vocab, vocab_size=VOCAB, max_len=4096, codec=codec)

    with pytest.raises(Unusable, match="longer than model.max_model_len=10"):
        check_usable(ok, vocab_size=VOCAB, max_len=10, codec=codec)

    bad_lp = _traj(codec, "lp")
    bad_lp.turns[0].logprobs[0] = 0.5
    with pytest.raises(Unusable, match="not a log-probability"):
        check_usable(bad_lp, vocab_size=VOCAB, max_len=4096, codec=codec)

    no_image = _traj(codec, "img")
    no_image.turns[0].images = []
    with pytest.raises(Unusable, match="image tokens but the 1 image"):
        check_usable(no_image, vocab_size=VOCAB, max_len=4096, codec=codec)

    corrupt = _traj(codec, "png")
    corrupt.turns[0].images = [b"\x89PNG not really"]
    with pytest.raises(Unusable, match="image"):
        check_usable(corrupt, vocab_size=VOCAB, max_len=4096, codec=codec)


def test_batch_round_trip_is_msgpack(codec):
    from worldloop.learner.data import Item

    items = [Item(f"1-{i}", _traj(codec, f"r{i}"), None, 0, 10) for i in range(2)]
    stop, trajs = decode_batch(encode_batch(items))
    assert not stop and [t.trajectory_id for t in trajs] == ["r0", "r1"]
    assert isinstance(trajs[0], Trajectory) and trajs == [it.traj for it in items]
    assert trajs[0].turns[0].images == items[0].traj.turns[0].images
    assert decode_batch(encode_batch([], stop=True)) == (True, [])


def test_micro_slices_keep_each_sequences_images(codec):
    trajs = [synthetic_trajectory(codec, trajectory_id=f"m{i}", seed=i, turns=1 + i % 2, response_tokens=3 + 5 * i,
                                  image_side=28 * (1 + i % 3)) for i in range(4)]
    layouts = [build_sequence(t) for t in trajs]
    full = collate(layouts, codec)
    full["extra"] = torch.arange(full["input_ids"].numel()).reshape(full["input_ids"].shape).float()
    counts = [len(x.images) for x in layouts]
    for rows in ([2], [3, 0], [1, 2]):
        got = micro_slices(full, rows, counts)
        want = collate([layouts[r] for r in rows], codec)
        length = want["input_ids"].shape[1]
        assert got["input_ids"].shape[1] == length
        for k in ("input_ids", "attention_mask", "response_mask", "mm_token_type_ids", "behaviour_logprobs"):
            assert torch.equal(got[k], want[k]), k
        assert torch.equal(got["pixel_values"], want["pixel_values"])
        assert torch.equal(got["image_grid_thw"], want["image_grid_thw"])
        assert torch.equal(got["extra"], full["extra"][rows, :length])


# --------------------------------------------------------------------------- stream


def test_staleness_dedup_and_dead_letter(redis_url, codec):
    cfg = _cfg(redis_url)
    keys = Keys(NS)
    prod = StreamProducer(redis_url, keys.scored, 100)
    v = _Versions(current=5, checkpointed=3)
    src = _source(cfg, codec, v)
    src.dedup.add("trained-before", 4)
    # lag 5 - 2 = 3 > 2, but 3 - 2 = 1 relative to the checkpoint: held (a restart at v3 would train it)
    prod.add(encode_trajectory(_traj(codec, "stale-held", policy_version=[2, 5])))
    # lag 5 - 0 = 5 > 2 and 3 - 0 = 3 > 2: stale in any surviving lineage -> acked at once
    prod.add(encode_trajectory(_traj(codec, "stale-final", policy_version=0)))
    prod.add(encode_trajectory(_traj(codec, "trained-before", policy_version=4)))  # duplicate, not durable: held
    bad = _traj(codec, "bad-vocab", policy_version=5)
    bad.turns[0].obs_ids[3] = 10**6
    prod.add(encode_trajectory(bad))
    for i in range(3):
        prod.add(encode_trajectory(_traj(codec, f"good{i}", policy_version=[4, 5])))
    prod.add(encode_trajectory(_traj(codec, "good0", policy_version=[4, 5])))  # a re-sent copy in the same batch
    prod.add(encode_trajectory(_traj(codec, "good3", policy_version=5)))

    items = src.collect(4, lambda: False)
    assert [it.trajectory_id for it in items] == ["good0", "good1", "good2", "good3"]
    # the unusable one is a dead letter, not a drop
    assert src.dropped == {"stale": 2, "duplicate": 2}
    # run-wide counts move with the acks: only stale-final and the dead letter are acked yet
    assert src.fates() == {"dropped": {"stale": 1}, "dead_lettered": {"unusable": 1}}
    dead = connect(redis_url).xrange(keys.deadletter)
    assert len(dead) == 1
    record = decode_deadletter(dead[0][1][b"data"])
    assert "bad-vocab" in record.reason and "outside the vocabulary" in record.reason
    # held: stale-held, the two duplicates; stale-final and the dead letter were acked at once;
    # the four items are still pending too (their update is not checkpointed yet)
    assert src.held_count == 3
    assert _pending(redis_url) == 3 + 4
    src.mark_trained(items)
    assert src.held_count == 7 and all(f"good{i}" in src.dedup for i in range(4))
    assert src.ack_held() == 7
    assert _pending(redis_url) == 0 and connect(redis_url).xlen(keys.scored) == 0
    assert src.fates() == {"dropped": {"stale": 2, "duplicate": 2}, "dead_lettered": {"unusable": 1}}
    stats = read_stats(connect(redis_url), keys)
    assert stats["learner_dropped_stale"] == 2 and stats["learner_dropped_duplicate"] == 2
    assert src.dedup.is_durable("good0")
    src.close()


def test_token_versions_set_staleness_and_a_wrong_length_is_a_dead_letter(redis_url, codec):
    """A turn's per-token versions: the trajectory is as stale as its oldest token (max_staleness 2
    at learner v6: a token of v3 is too old even when the turn's other tokens are v6), and a
    ``token_versions`` of the wrong length is refused at decoding and dead-lettered as such."""
    import msgpack

    cfg = _cfg(redis_url)
    keys = Keys(NS)
    prod = StreamProducer(redis_url, keys.scored, 100)
    src = _source(cfg, codec, _Versions(current=6, checkpointed=6))
    n = len(_traj(codec, "x").turns[1].response_ids)
    old = _traj(codec, "old-token", policy_version=[6, 3])
    old.turns[1].token_versions = [3] + [6] * (n - 1)  # the first response token sampled by v3
    prod.add(encode_trajectory(old))
    wire = msgpack.unpackb(encode_trajectory(_traj(codec, "bad-len", policy_version=6)), raw=False)
    wire["turns"][0]["token_versions"] = [6]
    prod.add(msgpack.packb(wire, use_bin_type=True))
    fresh = [_traj(codec, f"fresh{i}", policy_version=[6, 4]) for i in range(2)]
    for t in fresh:
        t.turns[1].token_versions = [4] + [6] * (n - 1)  # lag 2: trainable
        prod.add(encode_trajectory(t))
    items = src.collect(2, lambda: False)
    assert [it.trajectory_id for it in items] == ["fresh0", "fresh1"] and [it.oldest for it in items] == [4, 4]
    assert src.dropped == {"stale": 1}
    (dead,) = connect(redis_url).xrange(keys.deadletter)
    record = decode_deadletter(dead[1][b"data"])
    assert re.search(r"\$\.turns\[0\]\.token_versions: 1 values for \d+ response tokens", record.reason), record.reason
    assert src.fates()["dead_lettered"] == {"decode_error": 1}
    src.close()


def test_a_dead_lettered_trajectory_gives_its_admission_back_once(redis_url, codec):
    """The learner refunds the admission of a trajectory it dead-letters (it will never be trained),
    once, and retires (no refund) the ones it trains: the actors' budget stays exact."""
    cfg = _cfg(redis_url)
    keys = Keys(NS)
    prod = StreamProducer(redis_url, keys.scored, 100)
    src = _source(cfg, codec, _Versions())
    src.admission.reset()
    ids = ["bad", "ok0", "ok1", "ok2", "ok3"]
    for tid in ids:
        assert src.admission.admit([tid], actor_version=0).admitted
    bad = _traj(codec, "bad")
    bad.turns[0].response_ids[0] = VOCAB + 1  # outside the vocabulary: unusable
    # the second "bad": its actor retried the XADD, the same id is dead-lettered again
    for traj in [bad, bad] + [_traj(codec, tid) for tid in ids[1:]]:
        prod.add(encode_trajectory(traj))

    items = src.collect(4, lambda: False)
    assert [it.trajectory_id for it in items] == ids[1:]
    assert connect(redis_url).xlen(keys.deadletter) == 2
    # 5 admitted, "bad" refunded once (its copy finds it refunded already) and its lease gone: 4 count
    assert src.admission.state() == {"admitted": 4, "refunded": 1, "leases": 4}
    src.mark_trained(items)  # trained: retired, their budget stays spent
    assert src.admission.state() == {"admitted": 4, "refunded": 1, "leases": 0}
    src.close()


def test_recover_takes_back_a_killed_learners_pending_entries(redis_url, codec):
    cfg = _cfg(redis_url)
    keys = Keys(NS)
    prod = StreamProducer(redis_url, keys.scored, 100)
    for i in range(6):
        prod.add(encode_trajectory(_traj(codec, f"k{i}")))
    v = _Versions()
    first = _source(cfg, codec, v)
    items = first.collect(4, lambda: False)
    first.mark_trained(items[:2])  # k0, k1 trained in an update that a checkpoint holds ...
    checkpointed = first.dedup.to_dict()
    # ... and the process dies before acking anything (kill -9): no close, no ack
    assert _pending(redis_url) == 4

    second = _source(cfg, codec, v, DedupWindow(2, checkpointed))  # restart from that checkpoint
    assert second.recover() == 4
    got = second.collect(4, lambda: False)
    # k0, k1 are in the checkpoint's trained set: acked without training; k2, k3 (trained after
    # the checkpoint or never) come back first, then the two never-read entries
    assert [it.trajectory_id for it in got] == ["k2", "k3", "k4", "k5"]
    assert second.dropped == {"duplicate": 2}
    assert _pending(redis_url) == 4 and second.held_count == 0
    second.close()


def test_own_entries_handed_back_by_autoclaim_are_ignored(redis_url, codec):
    cfg = _cfg(redis_url)
    cfg.redis.claim_idle_ms = 1
    keys = Keys(NS)
    prod = StreamProducer(redis_url, keys.scored, 100)
    for i in range(3):
        prod.add(encode_trajectory(_traj(codec, f"a{i}")))
    src = _source(cfg, codec, _Versions())
    first = src.collect(2, lambda: False)
    src.mark_trained(first)  # held pending; XAUTOCLAIM (idle > 1 ms) will return them to us
    second = src.collect(1, lambda: False)
    assert [it.trajectory_id for it in second] == ["a2"]
    assert src.dropped == {}  # not mistaken for duplicates
    src.close()


def test_paused_reads_nothing_and_stop_returns_none(redis_url, codec):
    cfg = _cfg(redis_url)
    prod = StreamProducer(redis_url, Keys(NS).scored, 100)
    prod.add(encode_trajectory(_traj(codec, "p0")))
    src = _source(cfg, codec, _Versions())
    assert src.collect(1, lambda: False, paused=lambda: True, max_wait_s=0.3) == []
    assert _pending(redis_url) == 0  # nothing was read while paused
    assert src.collect(2, lambda: False, max_wait_s=0.3) == []  # one buffered, one missing: timeout
    assert src.collect(2, lambda: True) is None
    src.close()


def test_pending_bound_checked_against_redis_maxmemory(redis_url):
    r = connect(redis_url)
    r.config_set("maxmemory", str(100 * 2**20))
    try:
        with pytest.raises(ConfigError, match="trainer.max_pending_mb"):
            check_pending_fits(_cfg(redis_url, max_pending_mb=60), r)
        check_pending_fits(_cfg(redis_url, max_pending_mb=50), r)
    finally:
        r.config_set("maxmemory", "0")


def test_maxmemory_is_unknown_where_config_is_forbidden_but_an_outage_is_raised(redis_url):
    """A user whose ACL forbids CONFIG (managed Redis) skips the check; a Redis that cannot be
    reached raises, so that the learner's RedisLink waits it out instead of skipping the check."""
    from worldloop.common.metrics import free_port
    from worldloop.learner.data import redis_maxmemory

    admin = connect(redis_url)
    admin.acl_setuser("noconfig", enabled=True, passwords=["+pw"], commands=["+@all", "-config"], keys=["*"])
    try:
        host_port = redis_url.split("//", 1)[1]
        limited = connect(f"redis://noconfig:pw@{host_port}")
        assert limited.ping() and redis_maxmemory(limited) is None
        assert redis_maxmemory(admin) is not None
        with pytest.raises(redis.ConnectionError, match="Connection refused"):
            redis_maxmemory(connect(f"redis://127.0.0.1:{free_port()}/0", 1.0))
    finally:
        admin.acl_deluser("noconfig")


def test_learner_cli_without_redis_url_fails_fast_naming_the_key(capsys):
    from worldloop.cli import main

    assert main(["learner", "redis.url=null", "trainer.device=cpu"]) == 2
    assert "redis.url" in capsys.readouterr().err


def test_filter_groups_trains_mixed_groups_and_refunds_the_rest(redis_url, codec, caplog):
    """trainer.filter_groups (DAPO's dynamic sampling): whole groups of actor.n_samples_per_seed
    reach the batch only when their episodes differ in task success; all-solved, all-failed and
    groups left with one member are dropped as uninformative (acked at once, budget refunded); an
    incomplete group expires as stale once its oldest member passes the bound."""
    cfg = _cfg(redis_url, {"n_samples_per_seed": 2}, filter_groups=True, estimator="grpo", use_critic=False)
    prod = StreamProducer(redis_url, Keys(NS).scored, 100)
    v = _Versions(current=3, checkpointed=3)
    src = _source(cfg, codec, v)
    src.admission.reset()
    # (group, member, success, policy version); lost-2 is stale (lag 3 > 2): it will never be
    # trained, so lost-1 decides alone; alone-2 never comes
    plan = [("mixed-a", 1, True, 3), ("fail", 1, False, 3), ("mixed-a", 2, False, 3), ("fail", 2, False, 3),
            ("solved", 1, True, 3), ("solved", 2, True, 3), ("lost", 1, True, 3), ("lost", 2, False, 0),
            ("alone", 1, True, 2), ("mixed-b", 1, False, 3), ("mixed-b", 2, True, 3)]
    for g in dict.fromkeys(g for g, *_ in plan):
        assert src.admission.admit([f"{g}-1", f"{g}-2"], actor_version=3).admitted
    for g, i, ok, version in plan:
        prod.add(encode_trajectory(_traj(codec, f"{g}-{i}", group_id=g, success=ok, policy_version=version)))

    with caplog.at_level("INFO", logger="worldloop.learner.data"):
        items = src.collect(4, lambda: False)
    # every drop has its own log line, in the form bench/chaos.py accounts for drops by
    logged = re.findall(r"dropping uninformative trajectory (\S+) \(entry", caplog.text)
    assert sorted(logged) == ["fail-1", "fail-2", "lost-1", "solved-1", "solved-2"]
    # groups enter the batch whole, in the order they completed
    assert [it.trajectory_id for it in items] == ["mixed-a-1", "mixed-a-2", "mixed-b-1", "mixed-b-2"]
    assert (src.groups_decided, src.groups_kept) == (5, 2)  # mixed-a, fail, solved, lost, mixed-b
    assert src.dropped == {"uninformative": 5, "stale": 1}
    # uninformative drops are final: acked at once and counted run-wide; lost-2 is final-stale too
    assert src.fates()["dropped"] == {"uninformative": 5, "stale": 1}
    # refunded: 2 + 2 (fail, solved), lost-1 and lost-2
    assert src.admission.state()["refunded"] == 6
    # pending: the 4 items to train and the incomplete group "alone" (held, waiting for its partner)
    assert _pending(redis_url) == 5

    v.current = 5  # alone-1 (version 2) now lags 3 > 2: the incomplete group expires as stale
    assert src.collect(2, lambda: False, max_wait_s=0.3) == []
    assert src.dropped == {"uninformative": 5, "stale": 2}
    assert src.admission.state()["refunded"] == 7
    src.mark_trained(items)
    src.ack_held()
    assert _pending(redis_url) == 0
    src.close()


def test_filter_groups_needs_whole_groups_in_a_batch():
    with pytest.raises(ConfigError, match="trainer.filter_groups.*n_samples_per_seed >= 2"):
        config_from_dict({"trainer": {"filter_groups": True}})
    with pytest.raises(ConfigError, match=r"trainer.filter_groups.*train_batch_size \(12\).*multiple.*\(8\)"):
        config_from_dict({"actor": {"n_samples_per_seed": 8},
                          "trainer": {"filter_groups": True, "train_batch_size": 12, "ppo_mini_batch_size": 4,
                                      "micro_batch_size": 1}})


def test_whole_group_fraction_counts_rows_of_complete_groups():
    # groups of 3: a whole (3 rows), b split (2 of 3), c one of 3 -> 3 of 6 rows
    assert whole_group_fraction(["a", "b", "a", "c", "b", "a"], 3) == pytest.approx(3 / 6)
    assert whole_group_fraction(["a", "a", "b", "b"], 2) == 1.0
    assert whole_group_fraction(["a", "b", "c", "d"], 2) == 0.0
    assert whole_group_fraction([], 8) == 1.0


def test_whole_groups_batches_hold_whole_grpo_groups_in_completion_order(redis_url, codec):
    """trainer.whole_groups (grpo, on by default): members that arrive interleaved, as actors push
    each episode when it ends, are held until their group is complete; a batch then holds whole
    groups in the order they completed, and nothing is dropped for being uninformative. A group
    whose missing member went stale is released with the members it has."""
    cfg = _cfg(redis_url, {"n_samples_per_seed": 2}, estimator="grpo", use_critic=False)
    assert cfg.trainer.whole_groups and not cfg.trainer.filter_groups
    prod = StreamProducer(redis_url, Keys(NS).scored, 100)
    v = _Versions(current=3, checkpointed=3)
    src = _source(cfg, codec, v)
    src.admission.reset()
    # all-solved and all-failed groups are kept too (no filter); lost-2 is stale (lag 3 > 2)
    plan = [("a", 1, True, 3), ("b", 1, False, 3), ("c", 1, True, 3), ("a", 2, True, 3), ("lost", 1, True, 3),
            ("c", 2, False, 3), ("lost", 2, False, 0), ("b", 2, False, 3), ("open", 1, True, 3)]
    for g in dict.fromkeys(g for g, *_ in plan):
        assert src.admission.admit([f"{g}-1", f"{g}-2"], actor_version=3).admitted
    for g, i, ok, version in plan:
        prod.add(encode_trajectory(_traj(codec, f"{g}-{i}", group_id=g, success=ok, policy_version=version)))

    items = src.collect(4, lambda: False)
    assert [it.trajectory_id for it in items] == ["a-1", "a-2", "c-1", "c-2"]
    rest = src.collect(3, lambda: False)
    assert [it.trajectory_id for it in rest] == ["lost-1", "b-1", "b-2"]
    assert (src.groups_decided, src.groups_kept) == (4, 4)
    assert src.dropped == {"stale": 1}
    # "open" waits for its partner: nothing more to collect
    assert src.collect(1, lambda: False, max_wait_s=0.3) == []
    src.mark_trained(items + rest)
    src.ack_held()
    assert _pending(redis_url) == 1  # open-1, held
    src.close()


def test_whole_groups_needs_batches_of_whole_groups_only_for_grpo():
    with pytest.raises(ConfigError, match=r"trainer.whole_groups.*train_batch_size \(12\).*multiple.*\(8\)"):
        config_from_dict({"actor": {"n_samples_per_seed": 8},
                          "trainer": {"estimator": "grpo", "train_batch_size": 12, "ppo_mini_batch_size": 4,
                                      "micro_batch_size": 1}})
    # off, or another estimator (no group baselines): any batch size
    for trainer in ({"estimator": "grpo", "whole_groups": False}, {"estimator": "bilevel_gae"}):
        cfg = config_from_dict({"actor": {"n_samples_per_seed": 8},
                                "trainer": {**trainer, "train_batch_size": 12, "ppo_mini_batch_size": 4,
                                            "micro_batch_size": 1}})
        assert cfg.trainer.train_batch_size == 12


def test_an_entry_read_by_max_deliveries_learners_that_died_is_dead_lettered_and_refunded(redis_url, codec):
    """A poison entry for the learner: every learner process that reads it fails on it before a
    checkpoint (training raises: Learner.step blames the batch, then exits). The restarts re-read
    it; past redis.max_deliveries it is dead-lettered as poison with its admission budget given
    back, instead of failing the next learner too."""
    from worldloop.common.transport.admission import Admission

    cfg = _cfg(redis_url)
    cfg.redis.max_deliveries = 2
    keys = Keys(NS)
    adm = Admission(redis_url, keys, max_staleness=2, batch_size=4)
    assert adm.admit(["x0"], actor_version=0).admitted
    adm.settle("x0")
    StreamProducer(redis_url, keys.scored, 100).add(encode_trajectory(_traj(codec, "x0")))
    v = _Versions()
    first = _source(cfg, codec, v)
    assert [it.trajectory_id for it in first.collect(1, lambda: False)] == ["x0"]
    assert first.blame() == 1  # its update raised on x0: blamed, then the process dies
    second = _source(cfg, codec, v)
    second.recover()
    assert [it.trajectory_id for it in second.collect(1, lambda: False)] == ["x0"]  # delivery 2: fails too
    assert second.blame() == 1
    third = _source(cfg, codec, v)
    third.recover()
    assert third.collect(1, lambda: False, max_wait_s=0.5) == []
    r = connect(redis_url)
    (rec,) = [decode_deadletter(f[b"data"]) for _, f in r.xrange(keys.deadletter)]
    assert "read 3 times" in rec.reason and "max_deliveries=2" in rec.reason
    assert read_stats(r, keys)["deadletter_scored_poison"] == 1 and _pending(redis_url) == 0
    assert adm.state()["refunded"] == 1
    third.close()
    adm.close()
