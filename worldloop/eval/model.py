"""What ``worldloop eval --model X`` names: a remote model, an HF model directory, a learner
checkpoint, a checkpoints folder or a run directory.

Public API::

    ModelRef(kind, name, path, policy_version, source)     # kind: "remote" | "local"
    resolve_model(model, *, base_url, cfg, scratch) -> ModelRef
    consolidate_deepspeed(ckpt_dir, base_model_dir, out_dir) -> Path
    ModelNotFound(ValueError)

Local resolution, in order:

1. a learner checkpoint (``state.json`` inside, ``learner/checkpoint.py`` layout): its ``hf/`` export
   when present; otherwise the policy's DeepSpeed state (``policy/ds``) is consolidated into the base
   model's architecture (``model.path`` of the run's ``config.yaml`` two folders up, written by
   ``worldloop up``, else ``model.path`` of the eval config, or for a null one the shipped or cached
   warm start of its recipe) and saved once under ``scratch``;
2. a checkpoints folder (``latest`` or ``step_*`` inside) or a run directory (``checkpoints/``
   inside): its newest complete checkpoint, then as 1;
3. a Hugging Face model directory (``config.json`` inside); no ``--model`` and a null ``model.path``:
   the shipped or cached warm start of the config's recipe (:func:`worldloop.bootstrap.store.resolve_model`).

The model's ``name`` (what records are keyed by) is the absolute path of the loaded directory, plus
``@v<policy version>`` for checkpoints.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from worldloop.common.contracts.config import Config

log = logging.getLogger(__name__)


class ModelNotFound(ValueError):
    """--model names nothing that can be loaded."""


@dataclass
class ModelRef:
    kind: str  # "remote" | "local"
    name: str  # model id in records and keys
    path: Path | None = None  # HF directory to load (local)
    policy_version: int | None = None
    source: str = ""  # one line for the log and the table title


def _is_checkpoint(p: Path) -> bool:
    return (p / "state.json").is_file()


def _checkpoints_root(p: Path) -> Path | None:
    if (p / "latest").is_file() or any(q.is_dir() for q in p.glob("step_*")):
        return p
    if (p / "checkpoints").is_dir():
        return p / "checkpoints"
    return None


def resolve_model(model: str | None, *, base_url: str | None, cfg: Config, scratch: Path) -> ModelRef:
    if base_url:
        if not model:
            raise ModelNotFound("--base-url needs --model NAME (the model id the endpoint serves)")
        return ModelRef("remote", model, source=f"{model} at {base_url}")
    p = Path(model or cfg.model.path or _recipe_model(cfg))
    if not p.exists():
        raise ModelNotFound(f"model directory {str(p)!r} does not exist (give a local model directory, a learner "
                            "checkpoint or run directory, or a model name with --base-url)")
    if not _is_checkpoint(p):
        root = _checkpoints_root(p)
        if root is not None:
            from worldloop.learner import checkpoint

            newest = checkpoint.latest(root)
            if newest is None:
                raise ModelNotFound(f"{str(root)!r} holds no complete learner checkpoint")
            p = newest
    if _is_checkpoint(p):
        return _from_checkpoint(p.resolve(), cfg, scratch)
    if not (p / "config.json").is_file():
        raise ModelNotFound(f"{str(p)!r} is neither a model directory (no config.json), a learner checkpoint "
                            "(no state.json) nor a run directory (no checkpoints/)")
    path = p.resolve()
    return ModelRef("local", str(path), path, None, source=str(path))


def _recipe_model(cfg: Config) -> Path:
    """No model named and ``model.path`` null: the warm start of the config's recipe, shipped or
    cached (never built here)."""
    from worldloop.bootstrap.store import resolve_model as resolve_warm_start

    try:
        return resolve_warm_start(cfg, build=False).path
    except FileNotFoundError as e:
        raise ModelNotFound(f"no --model and model.path is null: {e}") from None


def _from_checkpoint(ckpt: Path, cfg: Config, scratch: Path) -> ModelRef:
    state = json.loads((ckpt / "state.json").read_text())
    version = int(state.get("policy_version", state.get("step", 0)))
    name = f"{ckpt}@v{version}"
    hf = ckpt / "hf"
    if (hf / "config.json").is_file():
        return ModelRef("local", name, hf, version, source=f"learner checkpoint {ckpt} (policy version {version}, hf export)")
    base = _base_model_dir(ckpt, cfg)
    out = scratch / f"consolidated-{ckpt.parent.name}-{ckpt.name}"
    if not (out / "config.json").is_file():
        consolidate_deepspeed(ckpt, base, out)
    return ModelRef("local", name, out, version,
                    source=f"learner checkpoint {ckpt} (policy version {version}, DeepSpeed state consolidated into {base})")


def _base_model_dir(ckpt: Path, cfg: Config) -> Path:
    candidates: list[Path] = []
    run_cfg = ckpt.parent.parent / "config.yaml"
    if run_cfg.is_file():
        from worldloop.common.contracts.config import load_config

        try:
            run_model = load_config(run_cfg).model.path
            if run_model:
                candidates.append(Path(run_model))
        except ValueError as e:
            log.warning("cannot read %s: %s", run_cfg, e)
    if cfg.model.path:
        candidates.append(Path(cfg.model.path))
    for c in candidates:
        if (c / "config.json").is_file():
            return c
    if not cfg.model.path:
        return _recipe_model(cfg)
    raise ModelNotFound(f"checkpoint {ckpt} has no hf/ export, and the base model to rebuild it from is not found "
                        f"(tried {', '.join(map(str, candidates))}: model.path of the run's config.yaml, then of "
                        "the eval config); pass model.path=<base model dir>")


def consolidate_deepspeed(ckpt: Path, base_model_dir: Path, out: Path) -> Path:
    """Rebuild an HF model directory from ``ckpt/policy/ds`` on top of ``base_model_dir``."""
    import shutil

    import torch

    from worldloop.common.contracts.modeling import load_policy

    ds_dir = ckpt / "policy"
    model = load_policy(base_model_dir, dtype="float32", device="cpu")
    sd = _deepspeed_state_dict(ds_dir)
    prefix = "hf."  # worldloop.learner.engine.PolicyModule wraps the HF model as .hf
    sd = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in sd.items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight")} if getattr(model.config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise ModelNotFound(f"DeepSpeed state in {ds_dir} does not fit the base model {base_model_dir}: "
                            f"missing {sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in base_model_dir.iterdir():
        if f.is_file() and not (f.name.endswith(".safetensors") or f.name in ("model.safetensors.index.json", "pytorch_model.bin")):
            shutil.copy2(f, tmp / f.name)
    with torch.no_grad():
        model.save_pretrained(str(tmp), safe_serialization=True)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log.info("consolidated %s into %s", ds_dir, out)
    return out


def _deepspeed_state_dict(ds_dir: Path) -> dict:
    """fp32 weights of a DeepSpeed checkpoint (ZeRO 1-3 via zero_to_fp32; stage 0 from the model states)."""
    import torch

    tag_dir = ds_dir / "ds"
    if not tag_dir.is_dir():
        raise ModelNotFound(f"no DeepSpeed checkpoint in {ds_dir} (expected the tag folder 'ds')")
    if any(tag_dir.glob("*optim_states.pt")) and any(tag_dir.glob("zero_pp_rank_*")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return dict(get_fp32_state_dict_from_zero_checkpoint(str(ds_dir), tag="ds"))
    files = sorted(tag_dir.glob("mp_rank_*_model_states.pt"))
    if not files:
        raise ModelNotFound(f"no model states in {tag_dir}")
    # DeepSpeed's own format is a torch pickle: read with weights_only (tensors and plain containers
    # only), so a checkpoint folder from elsewhere cannot run code when it is evaluated
    blob = torch.load(str(files[0]), map_location="cpu", weights_only=True)
    return {k: v.float() if v.is_floating_point() else v for k, v in blob["module"].items()}
