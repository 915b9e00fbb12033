"""Learner checkpoints that never resume into the wrong run and are on the disk before their acks
(issue 38, findings 1, 2, 11, 12), on the real learner: DeepSpeed on CPU, the tiny Qwen2.5-VL, a real
redis-server, real files (and a real full tmpfs for the export).

* a fresh learner in a used run folder moves the earlier run's checkpoints aside (it used to delete
  its own new checkpoint, ordered by folder name, and a later --resume loaded the other run);
  checkpoints are ordered by the step and run id in state.json, and ``keep_checkpoints`` prunes by
  them;
* every file and folder of a checkpoint is fsynced before the first ack (os.fsync recorded on a
  real learner), with sizes and checksums in state.json; a torn newest checkpoint is skipped on
  resume, naming why, and the learner resumes from the newest intact one;
* the early checkpoint when the held entries pass ``trainer.max_pending_mb``;
* a learner whose lease was taken publishes nothing more;
* a full disk during the ``hf/`` export fails naming ENOSPC and the path, leaving no ``.tmp``.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from pathlib import Path

import pytest

from worldloop.common.contracts.keys import SCORED_GROUP, Keys
from worldloop.common.transport.lease import LeaseLost
from worldloop.common.contracts.schemas import encode_trajectory
from worldloop.common.transport.streams import StreamProducer, connect
from worldloop.learner import checkpoint
from worldloop.learner.engine import init_distributed
from worldloop.learner.process import Learner
from worldloop.testing.trajectories import synthetic_trajectory
from worldloop.testing.learner import tiny_learner_config

from test_learner_data import codec, model_dir  # noqa: F401 - the tiny model and its codec (module fixtures)

pytestmark = pytest.mark.slow


def _produce(codec, url: str, ns: str, ids: list[str], turns: int = 1, image_side: int = 28) -> None:
    prod = StreamProducer(url, Keys(ns).scored, 1000)
    for i, tid in enumerate(ids):
        prod.add(encode_trajectory(synthetic_trajectory(codec, trajectory_id=tid, seed=i, turns=turns,
                                                        response_tokens=4, image_side=image_side)))
    prod.close()


def _learner(model_dir, url, run_dir, ns, resume=False, **trainer) -> Learner:
    args = dict(total_steps=100, checkpoint_every=1, keep_checkpoints=2, max_staleness=100)
    args.update(trainer)
    cfg = tiny_learner_config(model_dir, url, run_dir, namespace=ns, resume=resume, **args)
    return Learner(cfg, init_distributed(cfg))


def _steps(root: Path) -> list[int]:
    return sorted(checkpoint.read_state(p)["step"] for p in root.glob("step_*"))


def test_a_fresh_learner_moves_an_earlier_run_aside_and_resume_never_loads_another_run(model_dir, codec, redis_url,
                                                                                      tmp_path) -> None:
    ns, run_dir = "runid", tmp_path / "run"
    root = run_dir / "checkpoints"
    _produce(codec, redis_url, ns, [f"a{i}" for i in range(12)])
    first = _learner(model_dir, redis_url, run_dir, ns)
    try:
        for _ in range(3):
            first.step()  # a checkpoint after each update
        # keep_checkpoints 2: steps 2 and 3 stay, by their recorded steps
        assert _steps(root) == [2, 3] and checkpoint.latest(root).name == "step_00000003"
    finally:
        first.close()

    _produce(codec, redis_url, ns, [f"b{i}" for i in range(4)])
    second = _learner(model_dir, redis_url, run_dir, ns)  # fresh (no --resume) in the used folder
    try:
        second.step()
        # before the fix, its step_00000001 sorted first by name and was pruned right after it was
        # written, and latest() named the earlier run's step_00000003
        assert checkpoint.latest(root).name == "step_00000001"
        aside = list(run_dir.glob("checkpoints.old-*"))
        assert len(aside) == 1 and sorted(p.name for p in aside[0].glob("step_*")) == ["step_00000002", "step_00000003"]
        old_run = checkpoint.read_state(aside[0] / "step_00000003")["run_id"]
        assert old_run != second.run_id and checkpoint.run_id_of(aside[0]) == old_run
        assert checkpoint.read_state(root / "step_00000001")["run_id"] == second.run_id == checkpoint.run_id_of(root)
    finally:
        second.close()

    # an older run's checkpoint back in the folder (copied by hand) is neither loaded nor counted
    shutil.copytree(aside[0] / "step_00000003", root / "step_00000003")
    assert checkpoint.latest(root).name == "step_00000001"
    checkpoint._prune(root, 1)
    assert (root / "step_00000001").is_dir() and (root / "step_00000003").is_dir()

    third = _learner(model_dir, redis_url, run_dir, ns, resume=True)
    try:  # before the fix: resumed from the other run's step 3
        assert (third.step_no, third.version, third.run_id) == (1, 1, second.run_id)
    finally:
        third.close()


def test_every_file_is_fsynced_before_the_acks_and_a_torn_checkpoint_is_skipped_on_resume(
        model_dir, codec, redis_url, tmp_path, monkeypatch, caplog) -> None:
    ns, run_dir = "fsync", tmp_path / "run"
    root = run_dir / "checkpoints"
    _produce(codec, redis_url, ns, [f"t{i}" for i in range(8)])
    learner = _learner(model_dir, redis_url, run_dir, ns, keep_checkpoints=3)
    events: list[tuple[str, str]] = []
    real_fsync, real_ack = os.fsync, learner.source.ack_held

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def ack_held():
        events.append(("ack", ""))
        return real_ack()

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(learner.source, "ack_held", ack_held)
    try:
        learner.step()
        monkeypatch.setattr(os, "fsync", real_fsync)
        ck = root / "step_00000001"
        acks = [i for i, e in enumerate(events) if e[0] == "ack"]
        assert len(acks) == 1
        # (paths as they were when fsynced: the folder and state.json are written under temporary names)
        synced = {p.replace("/.step_00000001.tmp", "/step_00000001").replace("/.state.json.tmp", "/state.json")
                  for kind, p in events[:acks[0]] if kind == "fsync"}
        files = sorted(p for p in ck.rglob("*") if p.is_file())
        dirs = [ck, *sorted(p for p in ck.rglob("*") if p.is_dir())]
        assert any("/policy/ds/" in str(p) for p in files) and any("/hf/" in str(p) for p in files)
        # before the fix only state.json and the folders were fsynced
        assert [str(p) for p in files + dirs if str(p) not in synced] == []
        assert str(root) in synced  # the rename into place, on the disk before the ack
        # state.json records every other file with its size
        recorded = checkpoint.read_state(ck)["files"]
        assert sorted(recorded) == sorted(p.relative_to(ck).as_posix() for p in files if p.name != "state.json")
        assert all(recorded[p.relative_to(ck).as_posix()]["size"] == p.stat().st_size for p in files
                   if p.name != "state.json")
        learner.step()
    finally:
        learner.close()

    # step 2's weights torn (as a power loss without the fsync could leave them): half a file
    newest = root / "step_00000002"
    torn = max(newest.glob("policy/ds/*model_states*"), key=lambda p: p.stat().st_size)
    size = torn.stat().st_size
    os.truncate(torn, size // 2)
    path, skipped = checkpoint.find(root)
    rel = torn.relative_to(newest).as_posix()
    assert path == root / "step_00000001"
    assert skipped == [(newest, f"{rel} holds {size // 2} bytes, state.json recorded {size}")]
    # a flipped byte of the same size is caught by the checksum
    flipped = tmp_path / "flipped"
    shutil.copytree(root / "step_00000001", flipped)
    blob = flipped / "hf" / "model.safetensors"
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    assert checkpoint.verify(flipped) == "hf/model.safetensors has another checksum (xxh3-64) than state.json recorded"

    caplog.set_level(logging.WARNING)
    resumed = _learner(model_dir, redis_url, run_dir, ns, resume=True, keep_checkpoints=3)
    try:  # before the fix: DeepSpeed failed on the torn file and the learner crash-looped
        assert (resumed.step_no, resumed.version) == (1, 1)
        assert (root / "damaged-step_00000002").is_dir() and not newest.exists()
        assert f"checkpoint {newest} is damaged and skipped: {rel} holds" in caplog.text
        # step 2's entries were acked with the torn checkpoint: what a damaged checkpoint loses
        assert connect(redis_url).xpending(Keys(ns).scored, SCORED_GROUP)["pending"] == 0
    finally:
        resumed.close()


def test_early_checkpoint_on_max_pending_mb_and_no_publish_after_the_lease_is_lost(model_dir, codec, redis_url,
                                                                                  tmp_path) -> None:
    ns, run_dir = "pending", tmp_path / "run"
    root, keys, r = run_dir / "checkpoints", Keys(ns), connect(redis_url)
    # 4 trajectories of 8 turns with 112-px images: about 300 KB each (4 * 8 * ~38 KB), so after the
    # first update more than trainer.max_pending_mb = 1 MiB is held pending
    _produce(codec, redis_url, ns, [f"big{i}" for i in range(4)], turns=8, image_side=112)
    learner = _learner(model_dir, redis_url, run_dir, ns, checkpoint_every=50, max_pending_mb=1)
    try:
        assert learner.publisher.version == 0
        learner.step()
        assert _steps(root) == [1]  # checkpoint_every 50: only the pending bytes made this checkpoint
        assert r.xpending(keys.scored, SCORED_GROUP)["pending"] == 0  # and its entries were acked
        assert learner.publisher.version == 1

        _produce(codec, redis_url, ns, [f"small{i}" for i in range(4)])
        r.set(keys.learner_owner, "99-another-learner")  # another learner took the namespace
        with pytest.raises(LeaseLost, match="another learner took namespace 'pending'"):
            learner.step()
        # before the fix the update was published as version 2 before the lease was checked
        assert learner.publisher.version == 1
        assert _steps(root) == [1] and r.xpending(keys.scored, SCORED_GROUP)["pending"] == 4
    finally:
        learner.close()


def test_a_full_disk_during_the_hf_export_fails_naming_enospc_and_leaves_no_tmp(model_dir, tmp_path,
                                                                                 monkeypatch) -> None:
    from test_resource_faults import _fill, _mount_tmpfs, _umount
    from worldloop.learner.engine import build_models, gather_policy_weights

    fs = tmp_path / "fs"
    _mount_tmpfs(fs, "64m")
    try:
        cfg = tiny_learner_config(model_dir, "redis://127.0.0.1:1/0", fs / "run", use_critic=False)
        models = build_models(cfg, init_distributed(cfg))
        weights = gather_policy_weights(models)
        root = fs / "run" / "checkpoints"
        state = {"run_id": "r1", "step": 1, "policy_version": 1, "max_turns": 3}
        checkpoint.save(models, root, state, weights=weights, model_dir=model_dir)
        real = models.policy_hf.save_pretrained

        def save_pretrained_on_a_full_disk(*args, **kwargs):
            _fill(fs, 64 << 10)  # the disk fills while the export runs: 64 KiB left, the weights are ~1.8 MB
            return real(*args, **kwargs)

        monkeypatch.setattr(models.policy_hf, "save_pretrained", save_pretrained_on_a_full_disk)
        tmp = root / ".step_00000002.tmp"
        # before the fix safetensors' SafetensorError escaped, and the .tmp folder stayed
        with pytest.raises(OSError, match=r"no space left on device \(ENOSPC\)") as err:
            checkpoint.save(models, root, dict(state, step=2, policy_version=2), weights=weights, model_dir=model_dir)
        assert err.value.errno == errno.ENOSPC and str(tmp) in str(err.value)
        assert "the newest complete checkpoint is still " + str(root / "step_00000001") in str(err.value)
        assert not tmp.exists() and checkpoint.latest(root) == root / "step_00000001"
    finally:
        _umount(fs)
