"""worldloop: asynchronous actor-learner multi-turn RL for vision-language agents with explicit
world-model reasoning.

One import root, four layers; imports only run downwards (``python tools/check_layers.py``):

==============  ==========================================================================
applications    ``worldloop.cli``, ``worldloop.up``, ``worldloop.status``, ``worldloop.bootstrap``
                (the model a run starts from), ``worldloop.eval``: what a user runs
roles           ``worldloop.actor``, ``worldloop.judge``, ``worldloop.learner``: the three
                processes; they never import each other
envs            ``worldloop.envs``: gymnasium environments and each family's truth, used by actors
                and applications; the judge imports only the families' registry ``worldloop.envs.family``
machinery       ``worldloop.common.{redis_link, streams, weights, process, control, metrics, redis_local,
                openai_retry}``: Redis links, streams, the ZeroMQ weight channel, the process scaffold
contracts       ``worldloop.common.{config, schemas, keys, modeling, logprobs}`` (``config`` with its
                ``config_fields``, ``config_checks``, ``config_load``): what crosses a process
                boundary (config, message types, Redis key names, token layout and the log-prob
                convention); no machinery
==============  ==========================================================================

In the source tree each subpackage is a top-level folder of the repository (``actor/``,
``common/``, ...) mapped under ``worldloop`` by ``pyproject.toml``; this folder holds the
applications. Presets ship as ``worldloop.configs``, their ready warm starts (weights, tokenizer,
``recipe.json``) as data in ``worldloop/warmstarts/<preset>/``, deployment files as ``worldloop.deploy``.
"""

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("worldloop")
except _metadata.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
    __version__ = "0+unknown"
