"""Deprecated import path: the config moved to ``worldloop.common.contracts.config``.

``import worldloop.common.config`` keeps working (it is the same module object) and warns once.
"""

import importlib
import sys
import warnings

warnings.warn(
    "worldloop.common.config moved to worldloop.common.contracts.config; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = importlib.import_module("worldloop.common.contracts.config")
