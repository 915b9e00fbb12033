"""The SVG family (VAGEN App. A.4): reconstruct a target image as SVG code.

============  ========================================================================
module        holds
============  ========================================================================
``env``       :class:`SVGEnv` (``worldloop/SVG-v0``): prompts, similarity rewards,
              the element-list state
``icons``     the procedural icon generator and the local dataset loader
``metrics``   image similarity (pixel, DINOv2, DreamSim)
``render``    untrusted SVG: extraction, validation, bounded rendering
``describe``  what a validated drawing shows, in words (elements, colours, places)
``worker``    the cairosvg render worker, run by ``render`` as a subprocess (by file
              path, never imported), so that a slow or hostile render can be killed
============  ========================================================================

Re-exported lazily: ``from worldloop.envs.svg import SVGEnv`` imports only what that class needs;
cairosvg is imported by the worker process alone.
"""

from __future__ import annotations

from worldloop.envs._lazy import lazy_exports

EXPORTS = {"SVGEnv": "env"}
__all__ = sorted(EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
