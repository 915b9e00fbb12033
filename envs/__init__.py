"""worldloop envs: ``import worldloop.envs`` registers the gymnasium ids (entry points load lazily).

===========================  ====================================================  =========================
id                           entry point                                           source
===========================  ====================================================  =========================
worldloop/Sokoban-v0         worldloop.envs.grid.sokoban:SokobanEnv                VAGEN App. A.4, WMAct A.1
worldloop/FrozenLake-v0      worldloop.envs.grid.frozenlake:FrozenLakeEnv          VAGEN App. A.4
worldloop/Maze-v0            worldloop.envs.grid.maze:MazeEnv                      WMAct A.1
worldloop/Taxi-v0            worldloop.envs.grid.taxi:TaxiEnv                      WMAct A.1
worldloop/Navigation-v0      worldloop.envs.navigation.env:NavigationEnv           VAGEN App. A.4
worldloop/PrimitiveSkill-v0  worldloop.envs.primitive_skill.env:PrimitiveSkillEnv  VAGEN App. A.4
worldloop/SVG-v0             worldloop.envs.svg.env:SVGEnv                         VAGEN App. A.4
===========================  ====================================================  =========================

Each family is a subpackage (``grid/``, ``navigation/``, ``primitive_skill/``, ``svg/``) whose
``__init__`` lists its modules and re-exports its env classes lazily; ``adapters/`` runs Navigation
and PrimitiveSkill on the original simulators. Importing this package imports none of them but each
family's ``truth`` module (light: no env code), which defines the family's
:class:`~worldloop.envs.family.EnvFamily`: its env ids (the table above is their union), its ground
truth and its scoring knowledge. ``FAMILIES`` below registers them; adding a family is its package and
one line there (see docs/environments.md).

All share :class:`worldloop.envs.base.VisualEnv` (see ``envs/base.py`` for the contract; the response
parser and action words are ``envs/parsing.py``, the prompt builders ``envs/prompts.py``) and are built with
``gymnasium.make(id, **kwargs)``; short preset names live in :mod:`worldloop.envs.presets`. They are
registered with gymnasium's env checker on and pass ``gymnasium.utils.env_checker.check_env``
(tests/test_envs_gymnasium.py): standard render modes ``rgb_array`` / ``ansi`` (aliases ``vision`` /
``text``) and an ``observation_space`` that declares every key ``reset`` / ``step`` return.
"""

from __future__ import annotations

import importlib

import gymnasium

from worldloop.envs.family import all_env_ids, register_family

# the registration lines: each package's truth.py defines its FAMILY
FAMILIES = (
    "grid",
    "navigation",
    "primitive_skill",
    "svg",
)
for _name in FAMILIES:
    register_family(importlib.import_module(f"{__name__}.{_name}.truth").FAMILY, replace=True)

ENV_IDS: dict[str, str] = all_env_ids()  # the built-in families' ids (a family registered later: all_env_ids())


def register_all() -> None:
    """Register every family's ids with gymnasium once (idempotent; importing the package calls it)."""
    for env_id, entry_point in all_env_ids().items():
        if env_id not in gymnasium.registry:
            gymnasium.register(id=env_id, entry_point=entry_point)


register_all()
