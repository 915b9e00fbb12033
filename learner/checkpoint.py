"""Learner checkpoints: DeepSpeed state of policy and critic + a JSON sidecar, made atomic.

Public API::

    save(models, root, state, *, weights=None, model_dir=None, keep=3) -> Path
    latest(root) -> Path | None            # newest complete checkpoint
    load(models, path) -> dict              # restores the engines, returns the sidecar state
    read_state(path) -> dict

Layout of ``<run_dir>/checkpoints``::

    step_00000010/
        policy/ds/...        DeepSpeed save_checkpoint of the policy engine (model + optimizer, per rank)
        critic/ds/...        the same for the critic (absent without one)
        hf/                  the policy as a Hugging Face model directory (config, safetensors,
                             tokenizer and image-processor files): what ``worldloop eval --model`` loads
        state.json           sidecar: step, policy_version, max_turns, trained ids (dedup window),
                             anneal window, world_size, zero_stage, time, complete=true
    latest                   the name of the newest complete checkpoint

Atomicity: everything is written into ``.step_XXXXXXXX.tmp/``; rank 0 writes ``state.json`` last
(fsynced), renames the folder into place and then replaces ``latest`` through a temporary file
(``os.replace``). A process killed at any point leaves either the previous checkpoint as the
newest complete one or the new one; ``latest`` never names a partial folder, and a stale
``.tmp`` folder is removed by the next save. Only then does the learner ack the stream entries
the checkpoint covers (see ``learner/data.py``). Resuming needs the same number of ranks and the
same ZeRO stage (DeepSpeed shards optimizer state per rank); a mismatch is a ConfigError.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
from pathlib import Path

from worldloop.common.contracts.config import ConfigError
from worldloop.learner.engine import Models, barrier

log = logging.getLogger(__name__)

_TAG = "ds"
_LATEST = "latest"
_STATE = "state.json"
_FULL_BYTES = 16 << 20  # a write failing with less than this free is taken for a full disk
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def _name(step: int) -> str:
    return f"step_{int(step):08d}"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _export_hf(models: Models, weights: dict, model_dir: Path | None, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if model_dir is not None:
        for f in Path(model_dir).iterdir():
            if f.is_file() and f.name not in _WEIGHT_FILES and not f.name.endswith(".safetensors"):
                shutil.copy2(f, out / f.name)
    models.policy_hf.save_pretrained(str(out), state_dict=weights, safe_serialization=True)


def save(models: Models, root: str | Path, state: dict, *, weights: dict | None = None,
         model_dir: str | Path | None = None, keep: int = 3) -> Path:
    """Write a complete checkpoint of ``state["step"]`` (every rank calls this); return its path.

    ``weights``: the gathered policy tensors (rank 0), exported as ``hf/`` when given.
    """
    root = Path(root)
    name = _name(state["step"])
    final, tmp = root / name, root / f".{name}.tmp"
    try:
        if models.dist.is_main:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        barrier(models.dist)
        models.policy.save_checkpoint(str(tmp / "policy"), tag=_TAG, save_latest=False)
        if models.critic is not None:
            models.critic.save_checkpoint(str(tmp / "critic"), tag=_TAG, save_latest=False)
        barrier(models.dist)
        if models.dist.is_main:
            if weights:
                _export_hf(models, weights, Path(model_dir) if model_dir else None, tmp / "hf")
            sidecar = dict(state, world_size=models.dist.world_size, zero_stage=models.zero_stage,
                           has_critic=models.critic is not None, time=time.time(), complete=True)
            _write_atomic(tmp / _STATE, json.dumps(sidecar))
    except (OSError, RuntimeError) as e:
        # a full disk mid-write: the partial folder never had a state.json, so latest() cannot pick
        # it; remove it (it holds the space a retry needs) and say what happened and where
        shutil.rmtree(tmp, ignore_errors=True)
        raise _write_error(e, root, tmp, state["step"]) from e
    if models.dist.is_main:
        if final.exists():  # a checkpoint of the same step from an earlier life of the run
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
        _write_atomic(root / _LATEST, name)
        _prune(root, keep)
        log.info("checkpoint %s written (policy version %d)", final, state["policy_version"])
    barrier(models.dist)
    return final


def _write_error(err: BaseException, root: Path, tmp: Path, step: int) -> BaseException:
    """The error a failed checkpoint write raises: ENOSPC named as such with the path (DeepSpeed's
    torch.save reports a full disk as a bare "file write failed" RuntimeError), else ``err``."""
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        free = None
    full = getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or (
        isinstance(err, RuntimeError) and free is not None and free < _FULL_BYTES)
    if not full:
        return err
    prev = latest(root)
    return OSError(errno.ENOSPC, (
        f"no space left on device (ENOSPC) while writing the checkpoint of step {step} to {tmp} "
        f"({'?' if free is None else free} bytes free under {root}); the partial folder was removed and "
        f"the newest complete checkpoint is still {prev or 'none'}: free space, then restart with --resume "
        f"[{type(err).__name__}: {err}]"), str(tmp))


def _complete(path: Path) -> bool:
    try:
        return bool(json.loads((path / _STATE).read_text()).get("complete"))
    except (OSError, ValueError):
        return False


def _prune(root: Path, keep: int) -> None:
    done = sorted(p for p in root.glob("step_*") if p.is_dir() and _complete(p))
    for p in done[: max(0, len(done) - keep)]:
        shutil.rmtree(p, ignore_errors=True)
    for p in root.glob(".step_*.tmp"):
        shutil.rmtree(p, ignore_errors=True)


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root`` (``latest`` first, then a scan), or None."""
    root = Path(root)
    try:
        named = root / (root / _LATEST).read_text().strip()
        if _complete(named):
            return named
    except OSError:
        pass
    done = sorted(p for p in root.glob("step_*") if p.is_dir() and _complete(p))
    return done[-1] if done else None


def read_state(path: str | Path) -> dict:
    return json.loads((Path(path) / _STATE).read_text())


def load(models: Models, path: str | Path) -> dict:
    """Restore policy and critic engines (weights + optimizer) from ``path``; return the sidecar."""
    path = Path(path)
    state = read_state(path)
    if state.get("world_size") != models.dist.world_size:
        raise ConfigError("trainer.resume", f"checkpoint {path} was written by {state.get('world_size')} rank(s), this run has {models.dist.world_size}")
    if state.get("zero_stage") != models.zero_stage:
        raise ConfigError("trainer.zero_stage", f"checkpoint {path} was written with ZeRO stage {state.get('zero_stage')}, this run uses {models.zero_stage}")
    if bool(state.get("has_critic")) != (models.critic is not None):
        raise ConfigError("trainer.use_critic", f"checkpoint {path} {'has' if state.get('has_critic') else 'has no'} critic, this run differs")
    for engine, sub in ((models.policy, "policy"), (models.critic, "critic")):
        if engine is None:
            continue
        loaded, _ = engine.load_checkpoint(str(path / sub), tag=_TAG, load_optimizer_states=True, load_lr_scheduler_states=False)
        if loaded is None:
            raise RuntimeError(f"DeepSpeed could not load the {sub} checkpoint in {path}")
    log.info("resumed from %s: step %d, policy version %d", path, state["step"], state["policy_version"])
    return state
