"""The Navigation family (VAGEN App. A.4): reach an object in a furnished room from first-person views.

==============  =====================================================================
module          holds
==============  =====================================================================
``env``         :class:`NavigationEnv` (``worldloop/Navigation-v0``): prompts, rewards,
                the App. D.1 state; ``backend="ai2thor"`` runs it through
                :mod:`worldloop.envs.adapters.ai2thor`
``world``       :class:`World`: a procedurally furnished room, motion rules, planner,
                ground truth
``catalog``     the object types, what each room holds, and the boxes each object is
                built from
``raycast``     the numpy ray caster (:class:`Scene`), also used by PrimitiveSkill
==============  =====================================================================

Re-exported lazily: ``from worldloop.envs.navigation import NavigationEnv`` imports only what that
class needs, and importing ``worldloop.envs.navigation.raycast`` alone does not import the env.
"""

from __future__ import annotations

from worldloop.envs._lazy import lazy_exports

EXPORTS = {"NavigationEnv": "env", "World": "world", "Scene": "raycast"}
__all__ = sorted(EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
