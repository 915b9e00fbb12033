"""The one place the suite decides between "skip" and "fail" for something this machine lacks.

Locally a missing system tool, a refused privilege or an optional package that does not import is a
skip with the reason. On CI it is a failure: the CI machine (``.ci/run``) installs everything the
suite needs, so a missing piece there is a broken set-up that must not hide behind a skip.

    on_ci() -> bool                     # CI is "1", "true" or "yes" (any case, spaces ignored)
    unavailable(why, *, required=False) # skip locally; fail on CI or when ``required``
    require_tool(*names, install=...) -> str        # the path of the first of ``names`` on PATH
    require_import(module, *, required=False) -> module

``CI`` is what GitHub Actions, GitLab CI and most others set (``true``); ``1`` and ``yes`` are
accepted too because people export those by hand. Anything else (unset, ``0``, ``false``) is a
local run. ``required=True`` turns one check into a failure outside CI as well (the vLLM tests pass
``WORLDLOOP_REQUIRE_VLLM=1`` there).
"""

from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType
from typing import NoReturn

import pytest

CI_VALUES = ("1", "true", "yes")


def on_ci() -> bool:
    """True when the environment variable ``CI`` says this is a CI run (see the module docstring)."""
    return os.environ.get("CI", "").strip().lower() in CI_VALUES


def unavailable(why: str, *, required: bool = False) -> NoReturn:
    """Skip the test with ``why``; fail it instead on CI or when ``required``."""
    if required or on_ci():
        pytest.fail(f"{why} (CI={os.environ.get('CI', '')!r}: on CI this is a failure, not a skip)", pytrace=False)
    pytest.skip(why)


def require_tool(*names: str, install: str = "") -> str:
    """The path of the first of ``names`` found on PATH; else :func:`unavailable`."""
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    hint = f" ({install})" if install else ""
    unavailable(f"{' / '.join(names)} is not installed{hint}")


def require_import(module: str, *, required: bool = False) -> ModuleType:
    """``importlib.import_module(module)``; any error (a missing package, or a broken install
    raising something else) is :func:`unavailable` with the error's type and text."""
    try:
        return importlib.import_module(module)
    except Exception as e:  # ImportError, or a broken install raising anything at import
        unavailable(f"{module} does not import: {type(e).__name__}: {e}", required=required)
