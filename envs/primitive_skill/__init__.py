"""The PrimitiveSkill family (VAGEN App. A.4): pick, place and push on a tabletop, in millimetres.

===========  ========================================================================
module       holds
===========  ========================================================================
``env``      :class:`PrimitiveSkillEnv` (``worldloop/PrimitiveSkill-v0``): prompts,
             stage rewards, the App. C.2 state; ``backend="maniskill"`` renders
             through :mod:`worldloop.envs.adapters.maniskill`
``world``    :class:`Tabletop`: the geometric rules of reach, grasp, place, push and
             the drawer, the stages, the ground truth and the scripted expert
``tasks``    what is fixed per task: instructions, workspaces, sizes, tolerances,
             the cabinet, and the primitives' grammar (``parse_action``)
``scene``    the tabletop's drawable parts, the camera and the ray-cast view
===========  ========================================================================

Re-exported lazily: ``from worldloop.envs.primitive_skill import PrimitiveSkillEnv`` imports only
what that class needs.
"""

from __future__ import annotations

from worldloop.envs._lazy import lazy_exports

EXPORTS = {"PrimitiveSkillEnv": "env", "Tabletop": "world"}
__all__ = sorted(EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
