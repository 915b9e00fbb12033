"""Short env names for ``worldloop eval --envs ...``: ``PRESETS[name] = (env_id, kwargs)``.

Grid presets (this module's first block) follow VAGEN Tables 7/9 and WMAct App. A.1:

* ``sokoban``: 6x6, 1 box, min 5 actions, 3 actions per turn (VAGEN Table 7)
* ``sokoban-7x7-2box``: WMAct's standard Sokoban (optimal plan >= 8 actions)
* ``sokoban-hard-10x10``: WMAct Hard-1 (10x10, 2 boxes); ``sokoban-hard-7x7-3box``: Hard-2 (both >= 10
  actions; WMAct gives no minimum, 10 makes them clearly harder than the standard levels)
* ``frozenlake``: 4x4, not slippery (VAGEN Table 9); ``frozenlake-slippery``
* ``maze``: 11x11 (WMAct standard); ``maze-hard-15x15``: WMAct hard
* ``taxi``: gymnasium's 5x5 Taxi (WMAct)

Other env authors add their presets to ``PRESETS`` below their own block.
"""

from __future__ import annotations

PRESETS: dict[str, tuple[str, dict]] = {
    "sokoban": ("worldloop/Sokoban-v0", {"dim_room": [6, 6], "num_boxes": 1, "max_steps": 100,
                                        "min_actions_to_succeed": 5, "max_actions_per_step": 3}),
    "sokoban-7x7-2box": ("worldloop/Sokoban-v0", {"dim_room": [7, 7], "num_boxes": 2, "max_steps": 100,
                                                 "min_actions_to_succeed": 8}),
    "sokoban-hard-10x10": ("worldloop/Sokoban-v0", {"dim_room": [10, 10], "num_boxes": 2, "max_steps": 200,
                                                   "min_actions_to_succeed": 10}),
    "sokoban-hard-7x7-3box": ("worldloop/Sokoban-v0", {"dim_room": [7, 7], "num_boxes": 3, "max_steps": 200,
                                                      "min_actions_to_succeed": 10}),
    "frozenlake": ("worldloop/FrozenLake-v0", {"size": 4, "is_slippery": False, "min_actions_to_succeed": 5,
                                              "max_actions_per_step": 3}),
    "frozenlake-slippery": ("worldloop/FrozenLake-v0", {"size": 4, "is_slippery": True, "min_actions_to_succeed": 5}),
    "maze": ("worldloop/Maze-v0", {"size": 11}),
    "maze-hard-15x15": ("worldloop/Maze-v0", {"size": 15}),
    "taxi": ("worldloop/Taxi-v0", {}),
    # Navigation / PrimitiveSkill / SVG (VAGEN Tables 11, 13, 15; PrimitiveSkill uses the structured
    # state format as in the paper's main experiments)
    "navigation": ("worldloop/Navigation-v0", {"split": "base"}),
    "navigation-common-sense": ("worldloop/Navigation-v0", {"split": "common_sense"}),
    "primitive-place": ("worldloop/PrimitiveSkill-v0", {"task": "place", "state_format": "structured"}),
    "primitive-stack": ("worldloop/PrimitiveSkill-v0", {"task": "stack", "state_format": "structured"}),
    "primitive-drawer": ("worldloop/PrimitiveSkill-v0", {"task": "drawer", "state_format": "structured"}),
    "primitive-align": ("worldloop/PrimitiveSkill-v0", {"task": "align", "state_format": "structured"}),
    "svg": ("worldloop/SVG-v0", {}),
}


def resolve(name: str) -> tuple[str, dict]:
    """(env_id, kwargs copy) of a preset; a full ``worldloop/...`` id passes through with no kwargs."""
    if name in PRESETS:
        env_id, kwargs = PRESETS[name]
        return env_id, dict(kwargs)
    if name.startswith("worldloop/"):
        return name, {}
    raise ValueError(f"unknown env preset {name!r}; known: {', '.join(sorted(PRESETS))}")
