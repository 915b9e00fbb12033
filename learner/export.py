"""``worldloop model export RUN --merged [--out DIR]``: a run's newest checkpoint as a plain Hugging
Face model directory (a LoRA run's adapter folded into its base model, ``learner/lora.py``).

    export_command(cfg, args) -> int
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

from worldloop.learner import checkpoint
from worldloop.learner.lora import ADAPTER_DIR, export_merged


def _checkpoint_of(run: Path) -> Path:
    """A checkpoint folder itself, or the newest intact one of a run directory / checkpoints folder."""
    if (run / "state.json").is_file():
        return run
    for root in (run / "checkpoints", run):
        if root.is_dir():
            found = checkpoint.latest(root)
            if found is not None:
                return found
    raise FileNotFoundError(f"{str(run)!r} is neither a learner checkpoint (state.json) nor a run directory with an "
                            "intact checkpoint under checkpoints/")


def _base_dir(ckpt: Path, cfg: Any) -> Path:
    """The base model of a LoRA checkpoint: ``model.path`` of the run's ``config.yaml``, else of ``cfg``."""
    from worldloop.common.contracts.config import load_config

    tried = []
    run_cfg = ckpt.parent.parent / "config.yaml"
    paths = [load_config(run_cfg).model.path] if run_cfg.is_file() else []
    for p in [*paths, cfg.model.path]:
        if p:
            tried.append(str(p))
            if (Path(p) / "config.json").is_file():
                return Path(p)
    raise FileNotFoundError(f"checkpoint {ckpt} holds a LoRA adapter but its base model is not found (tried "
                            f"{', '.join(tried) or 'nothing'}: model.path of the run's config.yaml, then of the "
                            "config); pass model.path=<base model dir>")


def export_command(cfg: Any, args: Any) -> int:
    """``worldloop model export RUN --merged [--out DIR]``: the newest checkpoint of RUN (a run
    directory or one checkpoint folder) as a plain HF model directory: a LoRA run's adapter folded
    into its base model (``model.path`` of the run's ``config.yaml``, else of the config), a full-weight run's ``hf/`` export copied.
    ``DIR`` defaults to ``<checkpoint>/merged``."""
    if not args.merged:
        print("worldloop model export: give --merged (the one export there is: a plain HF model directory)",
              file=sys.stderr)
        return 2
    ckpt = _checkpoint_of(Path(args.config_file))
    out = Path(args.out) if args.out else ckpt / "merged"
    if (ckpt / ADAPTER_DIR / "adapter_config.json").is_file():
        export_merged(_base_dir(ckpt, cfg), ckpt / ADAPTER_DIR, out)
    elif (ckpt / "hf" / "config.json").is_file():
        shutil.copytree(ckpt / "hf", out, dirs_exist_ok=True)
    else:
        raise FileNotFoundError(f"checkpoint {ckpt} has neither adapter/ nor hf/")
    print(f"worldloop model export: {out} (from {ckpt})", flush=True)
    return 0
