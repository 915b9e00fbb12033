"""worldloop envs: ``import worldloop.envs`` registers the gymnasium ids (entry points load lazily).

==========================  ================================================  =========================
id                          entry point                                       source
==========================  ================================================  =========================
worldloop/Sokoban-v0        worldloop.envs.sokoban:SokobanEnv                 VAGEN App. A.4, WMAct A.1
worldloop/FrozenLake-v0     worldloop.envs.frozenlake:FrozenLakeEnv           VAGEN App. A.4
worldloop/Maze-v0           worldloop.envs.maze:MazeEnv                       WMAct A.1
worldloop/Taxi-v0           worldloop.envs.taxi:TaxiEnv                       WMAct A.1
worldloop/Navigation-v0     worldloop.envs.navigation:NavigationEnv           VAGEN App. A.4
worldloop/PrimitiveSkill-v0 worldloop.envs.primitive_skill:PrimitiveSkillEnv  VAGEN App. A.4
worldloop/SVG-v0            worldloop.envs.svg:SVGEnv                         VAGEN App. A.4
==========================  ================================================  =========================

All share :class:`worldloop.envs.base.VisualEnv` (see ``envs/base.py`` for the contract) and are built with
``gymnasium.make(id, **kwargs)``; short preset names live in :mod:`worldloop.envs.presets`. They are
registered with gymnasium's env checker on and pass ``gymnasium.utils.env_checker.check_env``
(tests/test_envs_gymnasium.py): standard render modes ``rgb_array`` / ``ansi`` (aliases ``vision`` /
``text``) and an ``observation_space`` that declares every key ``reset`` / ``step`` return.
"""

from __future__ import annotations

import gymnasium

ENV_IDS: dict[str, str] = {
    "worldloop/Sokoban-v0": "worldloop.envs.sokoban:SokobanEnv",
    "worldloop/FrozenLake-v0": "worldloop.envs.frozenlake:FrozenLakeEnv",
    "worldloop/Maze-v0": "worldloop.envs.maze:MazeEnv",
    "worldloop/Taxi-v0": "worldloop.envs.taxi:TaxiEnv",
    "worldloop/Navigation-v0": "worldloop.envs.navigation:NavigationEnv",
    "worldloop/PrimitiveSkill-v0": "worldloop.envs.primitive_skill:PrimitiveSkillEnv",
    "worldloop/SVG-v0": "worldloop.envs.svg:SVGEnv",
}


def register_all() -> None:
    """Register every id once (idempotent; importing the package calls it)."""
    for env_id, entry_point in ENV_IDS.items():
        if env_id not in gymnasium.registry:
            gymnasium.register(id=env_id, entry_point=entry_point)


register_all()
