"""Image similarity for SVG reconstruction (VAGEN Table 20: reward = 5.0 x DreamSim similarity).

Metrics (``make_metric(name)``; each returns ``{metric name: value in [0, 1]}`` plus
``"similarity"``, the value used for the reward):

* ``"pixel"`` (default, no download, deterministic): ``pixel_ncc * (1 - pixel_mae)`` where
  ``pixel_ncc`` is the mean over the scales 64, 32 and 16 px (area-averaged RGB in [0, 1]) of the
  normalised cross-correlation of the two images, clipped at 0, and ``pixel_mae`` the mean absolute
  RGB difference at 32 px. An empty (all-white) answer scores 0 against any non-blank target; a
  shape in the right place but the wrong shade loses through the MAE factor; a small offset keeps
  most of the coarse-scale correlation. A blank target (no variance) is scored by 1 - MAE alone.
  This is NOT DreamSim or DINO: it is reported as ``pixel_similarity`` and eval tables should
  name it so.
* ``"dino"``: cosine similarity of DINOv2 CLS embeddings (``transformers``), loaded only from a local
  directory/cache (``dino_model``, no download): reported as ``dino``.
* ``"dreamsim"``: 1 - DreamSim distance (the ``dreamsim`` package) with weights already in
  ``dreamsim_cache_dir``: reported as ``dreamsim``. When ``dino_model`` is also given, ``dino`` is
  reported beside it (VAGEN's reward: 5.0 x DreamSim + 0.0001 x DINO, i.e. DreamSim only).
* ``"auto"``: ``dreamsim`` if possible, else ``dino`` if possible, else ``pixel``.

Unavailable learned metrics raise RuntimeError naming what is missing and how to install it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import numpy as np

Metric = Callable[[np.ndarray, np.ndarray], dict]
METRICS = ("pixel", "dino", "dreamsim", "auto")


def _area_resize(img: np.ndarray, side: int) -> np.ndarray:
    """Area-average an HxWx3 uint8/float image to side x side floats in [0, 1]."""
    from PIL import Image

    a = img if img.dtype == np.uint8 else np.clip(img * 255.0, 0, 255).astype(np.uint8)
    if a.shape[0] != side or a.shape[1] != side:
        a = np.asarray(Image.fromarray(a).resize((side, side), Image.BOX))
    return a.astype(np.float64) / 255.0


def pixel_similarity(gen: np.ndarray, target: np.ndarray) -> dict:
    """``{"similarity", "pixel_similarity", "pixel_ncc", "pixel_mae"}`` (see module docstring)."""
    nccs = []
    flat_target = False
    for side in (64, 32, 16):
        g, t = _area_resize(gen, side).ravel(), _area_resize(target, side).ravel()
        t0, g0 = t - t.mean(), g - g.mean()
        tv, gv = float(t0 @ t0), float(g0 @ g0)
        if tv < 1e-9:
            flat_target = True
            break
        nccs.append(0.0 if gv < 1e-9 else max(0.0, float(t0 @ g0) / np.sqrt(tv * gv)))
    mae = float(np.abs(_area_resize(gen, 32) - _area_resize(target, 32)).mean())
    ncc = 1.0 if flat_target else float(np.mean(nccs))
    sim = max(0.0, min(1.0, ncc * (1.0 - mae)))
    return {"similarity": sim, "pixel_similarity": sim, "pixel_ncc": ncc, "pixel_mae": mae}


class _Dino:
    def __init__(self, model: str):
        try:
            import torch
            from transformers import AutoImageProcessor, AutoModel
        except ImportError as e:  # pragma: no cover - both are dependencies
            raise RuntimeError(f"the dino metric needs torch and transformers: {e}") from None
        try:
            self.processor = AutoImageProcessor.from_pretrained(model, local_files_only=True)
            self.model = AutoModel.from_pretrained(model, local_files_only=True).eval()
        except Exception as e:
            raise RuntimeError(
                f"DINO weights {model!r} are not available locally ({type(e).__name__}); download them "
                "once, e.g. `huggingface-cli download facebook/dinov2-small`, and pass dino_model=<dir or id>"
            ) from None
        self.torch = torch

    def __call__(self, gen: np.ndarray, target: np.ndarray) -> float:
        with self.torch.no_grad():
            x = self.processor(images=[gen, target], return_tensors="pt")
            feats = self.model(**x).last_hidden_state[:, 0]
            feats = self.torch.nn.functional.normalize(feats, dim=-1)
            return float((feats[0] * feats[1]).sum().clamp(0, 1))


class _DreamSim:
    def __init__(self, cache_dir: str | None):
        try:
            from dreamsim import dreamsim
        except ImportError:
            raise RuntimeError("the dreamsim metric needs the dreamsim package (pip install dreamsim) "
                               "and its weights in dreamsim_cache_dir") from None
        if not cache_dir or not Path(cache_dir).is_dir() or not any(Path(cache_dir).iterdir()):
            raise RuntimeError("DreamSim weights are not available locally: pass dreamsim_cache_dir=<dir> "
                               "holding the downloaded checkpoint (no download is attempted)")
        import torch

        self.torch = torch
        self.model, self.preprocess = dreamsim(pretrained=True, cache_dir=str(cache_dir), device="cpu")

    def __call__(self, gen: np.ndarray, target: np.ndarray) -> float:
        from PIL import Image

        with self.torch.no_grad():
            a = self.preprocess(Image.fromarray(gen))
            b = self.preprocess(Image.fromarray(target))
            return float(max(0.0, min(1.0, 1.0 - float(self.model(a, b)))))


def make_metric(name: str = "pixel", *, dino_model: str | None = None,
                dreamsim_cache_dir: str | None = None) -> tuple[str, Metric]:
    """(resolved metric name, function(gen, target) -> dict with "similarity")."""
    if name not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {name!r}")
    if name == "auto":
        for cand in ("dreamsim", "dino"):
            try:
                return make_metric(cand, dino_model=dino_model, dreamsim_cache_dir=dreamsim_cache_dir)
            except (RuntimeError, ValueError):
                continue
        return make_metric("pixel")
    if name == "pixel":
        return "pixel", pixel_similarity
    if name == "dino":
        model = dino_model or os.environ.get("WORLDLOOP_DINO_MODEL")
        if not model:
            raise RuntimeError("the dino metric needs dino_model=<local dir or cached id> "
                               "(or WORLDLOOP_DINO_MODEL); no download is attempted")
        dino = _Dino(model)

        def dino_metric(gen, target):
            v = dino(gen, target)
            return {"similarity": v, "dino": v}

        return "dino", dino_metric
    ds = _DreamSim(dreamsim_cache_dir or os.environ.get("WORLDLOOP_DREAMSIM_DIR"))
    dino_extra = _Dino(dino_model) if dino_model else None

    def dreamsim_metric(gen, target):
        v = ds(gen, target)
        out = {"similarity": v, "dreamsim": v}
        if dino_extra is not None:
            out["dino"] = dino_extra(gen, target)
        return out

    return "dreamsim", dreamsim_metric
