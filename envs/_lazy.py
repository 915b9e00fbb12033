"""Lazy re-exports for the env family packages (PEP 562 module ``__getattr__``).

``from worldloop.envs.grid import SokobanEnv`` imports ``worldloop.envs.grid.sokoban`` only at that
moment, so importing a family package, or one of its light modules such as
``worldloop.envs.navigation.raycast``, does not pull in the family's other modules.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``exports`` maps a public name to the submodule
    (relative to ``package``) that defines it."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    def __dir__() -> list[str]:
        return sorted(set(exports) | set(importlib.import_module(package).__dict__))

    return __getattr__, __dir__
