"""Learner checkpoints: DeepSpeed state of policy and critic + a JSON sidecar, made atomic and durable.

Public API::

    save(models, root, state, *, weights=None, model_dir=None, keep=3) -> Path   # state needs step, run_id
    find(root) -> (Path | None, [(Path, why)])   # newest intact checkpoint of the folder's run, and the damaged ones skipped
    latest(root) -> Path | None                   # find(root)[0]
    start_run(root, run_id, fresh) -> Path | None # claim the folder for a run (a fresh one moves old checkpoints aside)
    verify(path) -> str | None                    # why a checkpoint is damaged, or None
    set_aside(path) -> Path                       # rename a damaged checkpoint out of the way
    load(models, path) -> dict                    # restores the engines, returns the sidecar state
    read_state(path) -> dict

Layout of ``<run_dir>/checkpoints``::

    run.json             {"run_id", "started"}: the run that owns this folder
    step_00000010/
        policy/ds/...        DeepSpeed save_checkpoint of the policy engine (model + optimizer, per rank)
        critic/ds/...        the same for the critic (absent without one)
        hf/                  the policy as a Hugging Face model directory (config, safetensors,
                             tokenizer and image-processor files): what ``worldloop eval --model`` loads
                             (LoRA: the adapters merged in)
        adapter/             LoRA only: the policy's adapter in peft's format (``learner/lora.py``);
                             policy/ and critic/ then hold no frozen base weight
        state.json           sidecar: run_id, step, policy_version, max_turns, trained ids (dedup window),
                             anneal window, world_size, zero_stage, time, files (size and xxh3-64 of
                             every other file), complete=true
    latest                   the name of the newest checkpoint written (for people; never trusted alone)

Run identity. A fresh learner (no ``--resume``, or nothing intact to resume from) gets a new run
id. If the folder already holds checkpoints (an earlier run in the same ``run_dir``), they are
moved aside, whole, into ``<run_dir>/checkpoints.old-<UTC time>/`` and the folder starts empty
with a new ``run.json``; a resumed learner keeps its checkpoint's run id. Checkpoints are ordered
by the step recorded in their state.json, only among those of the folder's run id, never by
folder name: an older run's ``step_00000100`` can neither shadow nor prune a new run's
``step_00000010``.

Atomicity and durability: everything is written into ``.step_XXXXXXXX.tmp/``. After every rank's
DeepSpeed files and the ``hf/`` export are written, rank 0 fsyncs every file and directory in it
and records each file's size and xxh3-64 checksum; it writes ``state.json`` last (fsynced),
renames the folder into place (the parent fsynced) and replaces ``latest``. Only then does
``save`` return and the learner ack the stream entries the checkpoint covers (see
``learner/data.py``). A process killed at any point leaves either the previous checkpoint as the
newest complete one or the new one; a stale ``.tmp`` folder is removed by the next save.

On resume ``find`` checks the newest checkpoint's files against its state.json and falls back to
the newest intact one, logging each one skipped and why (the learner then sets skipped ones aside
as ``damaged-step_XXXXXXXX``). Resuming needs the same number of ranks and the same ZeRO stage
(DeepSpeed shards optimizer state per rank); a mismatch is a ConfigError. A run folder must be
trusted: DeepSpeed reads its files with ``torch.load``.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path

from worldloop.common.contracts.config import ConfigError
from worldloop.learner.engine import Models, barrier

log = logging.getLogger(__name__)

_TAG = "ds"
_LATEST = "latest"
_STATE = "state.json"
_RUN = "run.json"
_ASIDE = "damaged-"  # prefix of a checkpoint set aside after it failed its check (never matched by step_*)
_FULL_BYTES = 16 << 20  # a write failing with less than this free is taken for a full disk
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
_CHUNK = 8 << 20


def _name(step: int) -> str:
    return f"step_{int(step):08d}"


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


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


def _digest(path: Path, fsync: bool = False) -> tuple[int, str]:
    """(size, xxh3-64 hex) of a file; ``fsync`` also forces it to the disk (any fd flushes the inode)."""
    import xxhash

    h, size = xxhash.xxh3_64(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
        if fsync:
            os.fsync(f.fileno())
    return size, h.hexdigest()


def _seal(folder: Path) -> dict[str, dict]:
    """fsync every file under ``folder`` (DeepSpeed's shards of every rank, ``hf/``) and every
    directory, deepest first; return the manifest {relative path: {size, xxh3_64}} for state.json."""
    files: dict[str, dict] = {}
    for dirpath, _dirs, names in os.walk(folder, topdown=False):
        d = Path(dirpath)
        for n in sorted(names):
            size, digest = _digest(d / n, fsync=True)
            files[(d / n).relative_to(folder).as_posix()] = {"size": size, "xxh3_64": digest}
        _fsync_dir(d)
    return files


def verify(path: str | Path, state: dict | None = None) -> str | None:
    """Why the checkpoint at ``path`` is damaged (a file missing, of another size or checksum than
    state.json records), or None when it is intact. A checkpoint written before the manifest
    existed (no ``files``) cannot be checked and passes."""
    path = Path(path)
    state = read_state(path) if state is None else state
    for rel, want in (state.get("files") or {}).items():
        f = path / rel
        try:
            if f.stat().st_size != want["size"]:
                return f"{rel} holds {f.stat().st_size} bytes, state.json recorded {want['size']}"
            if _digest(f)[1] != want["xxh3_64"]:
                return f"{rel} has another checksum (xxh3-64) than state.json recorded"
        except OSError as e:
            return f"{rel} cannot be read: {e}"
    return None


def _export_hf(models: Models, weights: dict, model_dir: Path | None, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if model_dir is not None:
        for f in Path(model_dir).iterdir():
            if f.is_file() and f.name not in _WEIGHT_FILES and not f.name.endswith(".safetensors"):
                shutil.copy2(f, out / f.name)
    models.policy_hf.save_pretrained(str(out), state_dict=weights, safe_serialization=True)


def _lora_rank(models: Models) -> int:
    return int(models.lora.peft_config["default"].r) if models.lora is not None else 0


def _write_errors() -> tuple[type[BaseException], ...]:
    """What a failed write raises: OSError, DeepSpeed's RuntimeError, safetensors' SafetensorError."""
    try:
        from safetensors import SafetensorError
    except ImportError:  # pragma: no cover - safetensors comes with transformers
        return (OSError, RuntimeError)
    return (OSError, RuntimeError, SafetensorError)


def save(models: Models, root: str | Path, state: dict, *, weights: dict | None = None,
         model_dir: str | Path | None = None, keep: int = 3) -> Path:
    """Write a complete, fsynced checkpoint of ``state["step"]`` (every rank calls this); return its path.

    ``state`` carries ``run_id`` (the run the checkpoint belongs to). ``weights``: the gathered
    policy tensors (rank 0), exported as ``hf/`` when given.
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
        lora = models.lora is not None  # LoRA: the frozen base weights are model.path's, not saved again
        models.policy.save_checkpoint(str(tmp / "policy"), tag=_TAG, save_latest=False, exclude_frozen_parameters=lora)
        if models.critic is not None:
            models.critic.save_checkpoint(str(tmp / "critic"), tag=_TAG, save_latest=False, exclude_frozen_parameters=lora)
        barrier(models.dist)
        if models.dist.is_main:
            if lora:
                from worldloop.learner.lora import ADAPTER_DIR, merged_weights, save_adapter

                save_adapter(models, tmp / ADAPTER_DIR)
                if weights:
                    weights = merged_weights(models)
            if weights:
                _export_hf(models, weights, Path(model_dir) if model_dir else None, tmp / "hf")
            files = _seal(tmp)  # every file and folder on the disk before state.json says "complete"
            sidecar = dict(state, run_id=str(state.get("run_id", "")), world_size=models.dist.world_size,
                           zero_stage=models.zero_stage, has_critic=models.critic is not None, lora_rank=_lora_rank(models),
                           time=time.time(),
                           files=files, complete=True)
            _write_atomic(tmp / _STATE, json.dumps(sidecar))
    except _write_errors() as e:
        # a full disk mid-write: the partial folder never had a state.json, so find() cannot pick
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
    torch.save reports a full disk as a bare "file write failed" RuntimeError, safetensors as a
    SafetensorError "... (os error 28)"), else ``err``."""
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        free = None
    text = str(err)
    full = getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "os error 28" in text or (
        "No space left on device" in text) or (
        not isinstance(err, OSError) and free is not None and free < _FULL_BYTES)
    if not full:
        return err
    prev = latest(root, verify_files=False)
    return OSError(errno.ENOSPC, (
        f"no space left on device (ENOSPC) while writing the checkpoint of step {step} to {tmp} "
        f"({'?' if free is None else free} bytes free under {root}); the partial folder was removed and "
        f"the newest complete checkpoint is still {prev or 'none'}: free space, then restart with --resume "
        f"[{type(err).__name__}: {err}]"), str(tmp))


# ---------------------------------------------------------------------------- the run that owns the folder


def run_id_of(root: str | Path) -> str | None:
    """The run id recorded in ``root/run.json``; None when there is none (a folder of an older layout)."""
    try:
        return str(json.loads((Path(root) / _RUN).read_text())["run_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def start_run(root: str | Path, run_id: str, fresh: bool) -> Path | None:
    """Claim ``root`` for run ``run_id`` (rank 0, before any checkpoint of the run is written).

    ``fresh``: a new run. Checkpoints of an earlier run in the folder (``step_*``, partial ones,
    ``latest``) are moved aside, the folder whole, into ``<root>.old-<UTC time>/``, whose path is
    returned (None when there was nothing to move). A resumed run only records its id when the
    folder has none (a folder of an older layout)."""
    root = Path(root)
    moved = None
    if fresh and root.is_dir() and any(p.name != _RUN for p in root.iterdir()):
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        moved = root.with_name(f"{root.name}.old-{stamp}")
        n = 1
        while moved.exists():
            moved, n = root.with_name(f"{root.name}.old-{stamp}-{n}"), n + 1
        os.rename(root, moved)
        _fsync_dir(root.parent)
    if fresh or run_id_of(root) is None:
        root.mkdir(parents=True, exist_ok=True)
        _write_atomic(root / _RUN, json.dumps({"run_id": run_id, "started": time.time()}))
    return moved


def _candidates(root: Path) -> list[tuple[Path, dict]]:
    """Complete checkpoints of the folder's run, newest first by recorded step (then time)."""
    run_id = run_id_of(root)
    found = []
    for p in root.glob("step_*"):
        try:
            st = read_state(p)
        except (OSError, ValueError):
            continue
        if not isinstance(st, dict) or not st.get("complete"):
            continue
        if run_id is not None and str(st.get("run_id", "")) != run_id:
            log.debug("checkpoint %s belongs to run %r, the folder to %r: ignored", p, st.get("run_id"), run_id)
            continue
        found.append((p, st))
    found.sort(key=lambda x: (int(x[1].get("step", -1)), float(x[1].get("time", 0.0))), reverse=True)
    return found


def find(root: str | Path, *, verify_files: bool = True) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest intact checkpoint of the folder's run (None if none), and the newer ones skipped
    because their files do not match their state.json, each with why (logged)."""
    root = Path(root)
    skipped: list[tuple[Path, str]] = []
    for p, st in _candidates(root):
        why = verify(p, st) if verify_files else None
        if why is None:
            return p, skipped
        log.warning("checkpoint %s is damaged and skipped: %s", p, why)
        skipped.append((p, why))
    return None, skipped


def latest(root: str | Path, *, verify_files: bool = True) -> Path | None:
    """The newest intact checkpoint under ``root`` (see :func:`find`), or None."""
    return find(root, verify_files=verify_files)[0]


def set_aside(path: str | Path) -> Path:
    """Rename a damaged checkpoint to ``damaged-step_XXXXXXXX`` (kept for inspection, out of every scan)."""
    path = Path(path)
    dest = path.with_name(_ASIDE + path.name)
    shutil.rmtree(dest, ignore_errors=True)
    os.rename(path, dest)
    _fsync_dir(path.parent)
    return dest


def _prune(root: Path, keep: int) -> None:
    """Keep the ``keep`` newest (by recorded step) checkpoints of the folder's run; remove stale .tmp folders."""
    for p, _st in _candidates(root)[keep:]:
        shutil.rmtree(p, ignore_errors=True)
    for p in root.glob(".step_*.tmp"):
        shutil.rmtree(p, ignore_errors=True)


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
    if int(state.get("lora_rank", 0)) != _lora_rank(models):
        raise ConfigError("model.lora.rank", f"checkpoint {path} was written with LoRA rank {state.get('lora_rank', 0)}, "
                                             f"this run uses {_lora_rank(models)}")
    for engine, sub in ((models.policy, "policy"), (models.critic, "critic")):
        if engine is None:
            continue
        # LoRA: the checkpoint holds the trainable tensors only; the frozen base stays as built
        loaded, _ = engine.load_checkpoint(str(path / sub), tag=_TAG, load_optimizer_states=True, load_lr_scheduler_states=False,
                                           load_module_strict=models.lora is None)
        if loaded is None:
            raise RuntimeError(f"DeepSpeed could not load the {sub} checkpoint in {path}")
    log.info("resumed from %s: step %d, policy version %d", path, state["step"], state["policy_version"])
    return state
