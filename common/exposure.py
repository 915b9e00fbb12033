"""What a run exposes to other machines, checked where it starts (issue 31, items 10-11).

* **A Redis that other hosts reach needs a password.** Whoever reaches Redis can XADD into
  ``scored`` with any rewards, rewrite the control record or delete the streams. So a redis-server
  that worldloop itself starts (``LocalRedis``, ``deploy/redis.sh``) refuses to bind a
  non-loopback address without one (:func:`check_redis_bind` raises). A client cannot see how
  the server it reaches is protected, so :func:`warn_open_redis` only warns, loudly and once per
  address, when it reaches a non-loopback Redis over TCP with no password and without TLS.
* **Inference servers.** ``worldloop serve`` on a non-loopback address without an API key serves
  the policy to anyone who reaches it: :func:`warn_open_server` warns (the key: ``serve.api_key_env``
  / ``serve.api_key_file``, :func:`worldloop.common.secrets.server_api_key`).
* **Weights in clear.** Without CURVE the ZeroMQ weight channel is plaintext and unauthenticated:
  anyone who reaches it reads the policy, and an actor that connects to a non-loopback learner
  without the server's public key accepts weights from whoever answers there (checksummed, never
  unpickled, but not authenticated). :func:`warn_plain_weights` warns loudly when the learner
  binds, or an actor connects to, a non-loopback address in plaintext; it does not refuse (a
  private network may be protected otherwise).
"""

from __future__ import annotations

import ipaddress
import logging
from urllib.parse import urlsplit

from worldloop.common.secrets import url_password

log = logging.getLogger(__name__)

_warned: set[str] = set()


def is_loopback(host: str | None) -> bool:
    """True for localhost and loopback addresses (127.0.0.0/8, ::1); False for anything else,
    wildcard binds (0.0.0.0, ::) and names included."""
    if not host or host == "localhost":
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_redis_bind(host: str, password: str | None) -> None:
    """Refuse to start a redis-server bound to a non-loopback ``host`` without a password."""
    if not is_loopback(host) and not password:
        raise ValueError(
            f"refusing to start redis-server on {host} without a password: any host that reaches it could write "
            "trajectories with any rewards into the run. Set a password (WORLDLOOP_REDIS_PASSWORD), or bind 127.0.0.1")


def warn_open_redis(url: str, env_password: bool) -> None:
    """Warn once per address when a client reaches a non-loopback Redis over TCP with no password
    (neither in the URL, as user info or ``?password=``, nor, ``env_password``, in the environment)
    and without TLS."""
    try:
        u = urlsplit(url)
        where = f"{u.hostname}:{u.port or 6379}"
    except ValueError:  # redis-py refuses it itself
        return
    if u.scheme != "redis" or env_password or url_password(url) or is_loopback(u.hostname or "localhost"):
        return
    if where not in _warned:
        _warned.add(where)
        log.warning("SECURITY: Redis at %s is reached over the network without a password and without TLS: anyone "
                    "who reaches it can inject trajectories with any rewards. Give it a password "
                    "(WORLDLOOP_REDIS_PASSWORD) and use rediss:// off a private network (docs/operations.md)", where)


def warn_open_server(host: str, has_key: bool) -> bool:
    """Warn (True) when an inference server binds a non-loopback ``host`` without an API key."""
    if has_key or is_loopback(host):
        return False
    log.warning("SECURITY: the inference server listens on %s without an API key: anyone who reaches it can generate "
                "with the policy (and read its /metrics). Put a key in $WORLDLOOP_SERVE_API_KEY (serve.api_key_env) or "
                "a file (serve.api_key_file) for the server and its actors, or bind 127.0.0.1 (docs/operations.md)",
                host)
    return True


def warn_plain_weights(role: str, host: str, curve_key: str | None) -> bool:
    """Warn (True) when the learner binds (``role`` "learner") or an actor or inference server (``role``
    "actor", "inference server") connects to a non-loopback weight channel without CURVE (``curve_key``:
    the learner's server secret / the subscriber's server key)."""
    if curve_key or is_loopback(host):
        return False
    what = "binds the weight channel on" if role == "learner" else "fetches weights from"
    log.warning("SECURITY: the %s %s %s in plaintext (no CURVE): anyone on the network can read the policy%s. "
                "Turn on CURVE: weights.curve_server_secret on the learner, weights.curve_server_public on the actors "
                "(docs/operations.md)", role, what, host,
                "" if role == "learner" else f", and whoever answers there can hand this {role} weights")
    return True
