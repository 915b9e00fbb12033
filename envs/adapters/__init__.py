"""Adapters that run worldloop's Navigation and PrimitiveSkill tasks on the original simulators.

* :mod:`worldloop.envs.adapters.ai2thor` — ``NavigationEnv(backend="ai2thor")``: AI2-THOR scenes.
* :mod:`worldloop.envs.adapters.maniskill` — ``PrimitiveSkillEnv(backend="maniskill")``: SAPIEN/ManiSkill
  rendering of the tabletop.

Neither simulator is a dependency: each adapter raises RuntimeError naming what is missing and how
to install it when its package does not import or cannot render.
"""
