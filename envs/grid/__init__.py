"""The grid family: Sokoban, FrozenLake, Maze and Taxi on one shared grid layer.

==================  =================================================================
module              holds
==================  =================================================================
``grid_env``        :class:`GridEnv` (direction actions, expert plan cache, snapshots,
                    prompt hints, ``relation_prompt``, ``progress_reward``) and
                    ``generate_level`` (draw until the level is hard enough)
``sokoban``         :class:`SokobanEnv` (``worldloop/Sokoban-v0``)
``frozenlake``      :class:`FrozenLakeEnv` (``worldloop/FrozenLake-v0``)
``maze``            :class:`MazeEnv` (``worldloop/Maze-v0``)
``taxi``            :class:`TaxiEnv` (``worldloop/Taxi-v0``)
``solvers``         breadth-first solvers (shortest plans for the expert and the levels)
``render``          Pillow sprites, cached per cell size; frames are numpy gathers
==================  =================================================================

The env classes are re-exported here lazily: ``from worldloop.envs.grid import SokobanEnv`` imports
only ``worldloop.envs.grid.sokoban`` (and what it needs).
"""

from __future__ import annotations

from worldloop.envs._lazy import lazy_exports

EXPORTS = {"GridEnv": "grid_env", "SokobanEnv": "sokoban", "FrozenLakeEnv": "frozenlake", "MazeEnv": "maze",
           "TaxiEnv": "taxi"}
__all__ = sorted(EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
