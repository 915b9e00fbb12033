"""worldloop envs: ``import envs`` registers the gymnasium ids (entry points load lazily).

==========================  ======================================  =========================
id                          entry point                             source
==========================  ======================================  =========================
worldloop/Sokoban-v0        envs.sokoban:SokobanEnv                 VAGEN App. A.4, WMAct A.1
worldloop/FrozenLake-v0     envs.frozenlake:FrozenLakeEnv           VAGEN App. A.4
worldloop/Maze-v0           envs.maze:MazeEnv                       WMAct A.1
worldloop/Taxi-v0           envs.taxi:TaxiEnv                       WMAct A.1
worldloop/Navigation-v0     envs.navigation:NavigationEnv           VAGEN App. A.4
worldloop/PrimitiveSkill-v0 envs.primitive_skill:PrimitiveSkillEnv  VAGEN App. A.4
worldloop/SVG-v0            envs.svg:SVGEnv                         VAGEN App. A.4
==========================  ======================================  =========================

All share :class:`envs.base.VisualEnv` (see ``envs/base.py`` for the contract) and are built with
``gymnasium.make(id, **kwargs)``; short preset names live in :mod:`envs.presets`.
"""

from __future__ import annotations

import gymnasium

ENV_IDS: dict[str, str] = {
    "worldloop/Sokoban-v0": "envs.sokoban:SokobanEnv",
    "worldloop/FrozenLake-v0": "envs.frozenlake:FrozenLakeEnv",
    "worldloop/Maze-v0": "envs.maze:MazeEnv",
    "worldloop/Taxi-v0": "envs.taxi:TaxiEnv",
    "worldloop/Navigation-v0": "envs.navigation:NavigationEnv",
    "worldloop/PrimitiveSkill-v0": "envs.primitive_skill:PrimitiveSkillEnv",
    "worldloop/SVG-v0": "envs.svg:SVGEnv",
}


def register_all() -> None:
    """Register every id once (idempotent; ``import envs`` calls it)."""
    for env_id, entry_point in ENV_IDS.items():
        if env_id not in gymnasium.registry:
            gymnasium.register(id=env_id, entry_point=entry_point, disable_env_checker=True)


register_all()
