"""Secrets stay out of everything a run writes or prints.

A run's secrets are the Redis password (a ``redis.url`` may carry one, ``redis://user:pw@host``)
and API keys. API keys never enter the config: the judge reads the variable ``judge.api_key_env``
names. The Redis password is taken out of the URL before anything is written or printed:

* :func:`redacted` is what every file, tracker and printout gets instead of the config: the
  password of every URL in it removed (the user name stays), and the value of any key whose name
  says secret (the words ``password``, ``token``, ``secret``, a name ending in ``api_key``; the
  ZeroMQ CURVE keys are paths to key files, not secrets, and stay) replaced by ``<redacted>`` when
  it is a string (``trainer.gamma_token`` is a number). So ``run_dir/config.yaml``,
  TensorBoard's and wandb's config and ``worldloop config show`` never hold it.
* :func:`password_to_env` moves the password of ``redis.url`` into ``$WORLDLOOP_REDIS_PASSWORD``
  for the child processes ``worldloop up`` starts, which read the redacted ``config.yaml``: every
  Redis client of worldloop takes the variable for a URL without a password
  (:func:`worldloop.common.transport.redis_link.connect`), so the password is in no file and on no command
  line.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

# the Redis password for a URL without one: from the environment, so that it is on no process's
# command line (``ps``, /proc/PID/cmdline) and in no config file a run writes
REDIS_PASSWORD_ENV = "WORLDLOOP_REDIS_PASSWORD"

REDACTED = "<redacted>"
_SECRET_WORDS = {"password", "passwd", "token", "apikey", "secret"}  # whole words of a key's name
_NOT_SECRET_PREFIXES = ("curve_",)  # weights.curve_*: paths of ZeroMQ key files


def url_password(url: str) -> str | None:
    """The password a URL carries (``scheme://[user]:password@host...``), or None."""
    try:
        return urlsplit(url).password
    except ValueError:
        return None


def strip_password(url: str) -> str:
    """``url`` without its password (the user name, host, port, path and query stay)."""
    try:
        u = urlsplit(url)
    except ValueError:
        return url
    if u.password is None:
        return url
    host = u.hostname or ""
    if ":" in host:  # IPv6
        host = f"[{host}]"
    netloc = (u.username or "") + ("@" if u.username else "") + host + (f":{u.port}" if u.port else "")
    return urlunsplit((u.scheme, netloc, u.path, u.query, u.fragment))


def _secret_key(name: str) -> bool:
    """A key named like a secret: ``password``, ``auth_token``, ``api_key``; not ``max_new_tokens``
    (a count), not ``api_key_env`` (the name of the variable that holds the key), not a CURVE path."""
    low = name.lower()
    if low.startswith(_NOT_SECRET_PREFIXES):
        return False
    return bool(_SECRET_WORDS & set(low.split("_"))) or low.endswith("api_key")


def redacted(data: Any) -> Any:
    """A copy of plain config data (``to_dict(cfg)``) fit to write or print: see the module docstring."""
    if isinstance(data, dict):
        return {k: (REDACTED if isinstance(v, str) and v and _secret_key(str(k)) else redacted(v))
                for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [redacted(v) for v in data]
    if isinstance(data, str) and "://" in data and "@" in data:
        return strip_password(data)
    return data


def redacted_override(text: str) -> str:
    """A ``key=value`` command-line override fit to print (its value redacted like the config)."""
    key, sep, value = text.partition("=")
    if not sep:
        return text
    return f"{key}={REDACTED}" if _secret_key(key.rsplit('.', 1)[-1]) and value else f"{key}={redacted(value)}"


def password_to_env(cfg: Any, env: dict[str, str]) -> bool:
    """Move ``cfg.redis.url``'s password into ``env[WORLDLOOP_REDIS_PASSWORD]`` and out of the URL
    (for child processes that read a written config); True when there was one."""
    password = url_password(cfg.redis.url) if cfg.redis.url else None
    if not password:
        return False
    env[REDIS_PASSWORD_ENV] = unquote(password)  # as redis-py reads a URL's password
    cfg.redis.url = strip_password(cfg.redis.url)
    return True
