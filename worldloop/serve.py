"""``worldloop serve``: one vLLM inference server for ``actor.backend: server``.

    worldloop serve --config C [--host H] [--port P] [key.sub=value ...]

Runs ``vllm serve`` for ``model.path`` with worldloop's worker extension and middleware
(:mod:`worldloop.actor.server.launch`, which maps ``model.*``, ``actor.vllm_*`` and ``serve.*`` onto
vLLM's flags). The server loads every weight version from the learner's ZeroMQ channel
(``weights.*``, CURVE keys included; with ``model.lora`` each adapter-only version becomes the
server's LoRA adapter) between requests, tags each response with the version that
produced it, answers ``GET /worldloop/info`` (readiness, version, model fingerprint), requires the
API key of ``serve.api_key_env``/``serve.api_key_file`` when one is set (and warns when it listens
on a non-loopback address without one) and, with
``redis.url``, heartbeats as role ``server`` so that ``worldloop sd`` hands its ``/metrics`` (vLLM's
and ``worldloop_server_*``) to Prometheus. The command becomes the server (exec): a supervisor's
signals reach vLLM directly, and stopping its process group stops vLLM's engine and workers too.

For ``worldloop up`` with ``actor.backend=server`` and no ``actor.servers``:

    plan_local_servers(cfg, config_path) -> [(name, argv)]  # picks a port, sets actor.servers
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from worldloop.common.contracts.config import Config, ConfigError

log = logging.getLogger("worldloop.serve")


def run(cfg: Config, args: argparse.Namespace | None = None) -> int:
    """Exec into the inference server for ``cfg`` (returns only when the exec fails)."""
    from worldloop.actor.server.launch import server_command
    from worldloop.common.exposure import warn_open_server
    from worldloop.common.secrets import server_api_key

    host = getattr(args, "host", None) or cfg.serve.host
    port = int(getattr(args, "port", None) or cfg.serve.port)
    warn_open_server(host, server_api_key(cfg) is not None)
    if not (Path(cfg.model.path) / "config.json").exists():
        raise ConfigError("model.path", f"no model directory at {cfg.model.path!r} (no config.json)")
    argv, env = server_command(cfg, host=host, port=port)
    log.info("starting the inference server for %s on http://%s:%d: vllm serve %s", cfg.model.path, host, port,
             " ".join(argv[3:]))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], argv, env)
    return 1  # pragma: no cover - execve does not return


def plan_local_servers(cfg: Config, config_path: Path) -> list[tuple[str, list[str]]]:
    """``worldloop up``: with ``actor.backend=server`` and no ``actor.servers``, one server of this
    run on a free loopback port, whose URL becomes ``actor.servers`` (call before writing the config
    the children read); its name and command line (``worldloop serve`` on that config)."""
    if cfg.actor.backend != "server" or cfg.actor.servers:
        return []
    from worldloop.common.metrics import free_port

    cfg.serve.host, cfg.serve.port = "127.0.0.1", free_port()
    cfg.actor.servers = [f"http://127.0.0.1:{cfg.serve.port}"]
    return [("server-0", [sys.executable, "-m", "worldloop", "serve", "--config", str(config_path)])]
