"""Secrets stay out of everything a run writes or prints.

A run's secrets are the Redis password and API keys. API keys never enter the config: the judge
reads the variable ``judge.api_key_env`` names, a server's key the variable or file
``server.api_key_env``/``server.api_key_file`` names. A ``redis.url`` may carry the password in
every form redis-py reads (``redis.connection.parse_url``): in the user info,
``redis://user:pw@host``, or in the query string, ``redis://host/0?password=pw`` (the user info
wins when both are given); ``rediss://`` URLs may also carry ``?ssl_password=`` (the pass phrase of
the client's key file). The password is taken out of the URL before anything is written or printed:

* :func:`redacted` is what every file, tracker and printout gets instead of the config: every
  URL in it without its user-info password and without any query parameter named like a secret
  (``password``, ``ssl_password``, ``token``, ``api_key``...; the user name, in the user info or
  in ``?username=``, stays: it is not a secret and says which ACL user a run logs in as), and
  the value of any key whose name says secret (the words ``password``, ``token``, ``secret``, a
  name ending in ``api_key``; the ZeroMQ CURVE keys are paths to key files, not secrets, and stay)
  replaced by ``<redacted>`` when it is a string (``trainer.gamma_token`` is a number). So
  ``run_dir/config.yaml``, TensorBoard's and wandb's config, ``worldloop config show`` and the
  overrides it echoes never hold it.
* :func:`password_to_env` moves the password of ``redis.url`` (either form) into
  ``$WORLDLOOP_REDIS_PASSWORD`` for the child processes ``worldloop up`` starts, which read the
  redacted ``config.yaml``: every Redis client of worldloop takes the variable for a URL without
  a password (:func:`worldloop.common.transport.redis_link.connect`), so the password is in no file and on
  no command line. An ``ssl_password`` has no such variable: it is redacted like the rest, so
  ``up``'s children do not get it (use a client key file without a pass phrase).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, unquote_plus, urlsplit

from worldloop.common.contracts.config_fields import ConfigError

# the Redis password for a URL without one: from the environment, so that it is on no process's
# command line (``ps``, /proc/PID/cmdline) and in no config file a run writes
# (worldloop.common.transport.redis_link re-exports it; it lives here so that exposure.py can read URLs'
# credentials without an import cycle)
REDIS_PASSWORD_ENV = "WORLDLOOP_REDIS_PASSWORD"

REDACTED = "<redacted>"
_SECRET_WORDS = {"password", "passwd", "token", "apikey", "secret"}  # whole words of a key's name
_NOT_SECRET_PREFIXES = ("curve_",)  # weights.curve_*: paths of ZeroMQ key files
# for text urlsplit cannot read (an unbalanced IPv6 bracket): a user info's password, "//user:pw@",
# and a query parameter named like a secret, "?password=pw" / "&ssl_password=pw"
_USERINFO_PASSWORD = re.compile(r"(//[^/@:?#]*):[^/@?#]*@")
_SECRET_PARAM = re.compile(r"([?&][^=&#]*(?:password|passwd|token|secret|api_?key)[^=&#]*=)[^&#]*", re.IGNORECASE)


def url_password(url: str) -> str | None:
    """The password redis-py reads from a URL (percent-decoded, as it reads it): the user info's
    (``scheme://[user]:password@host``) or else the query string's (``?password=``); None for none."""
    try:
        u = urlsplit(url)
        if u.password:
            return unquote(u.password)
        values = parse_qs(u.query).get("password")
    except ValueError:
        return None
    return values[0] if values else None


def _secret_param(piece: str) -> bool:
    """A query string's ``name=value`` piece whose name says secret (``password``, ``ssl_password``)."""
    return _secret_key(unquote_plus(piece.partition("=")[0]))


def strip_password(url: str) -> str:
    """``url`` without its credentials: the user info's password and every query parameter named
    like a secret go; the user name, host, port, path, the other parameters and their order stay.
    A URL with none comes back as it was."""
    try:
        u = urlsplit(url)
    except ValueError:  # not a URL urlsplit reads: still no password in what comes back
        return _SECRET_PARAM.sub(r"\1" + REDACTED, _USERINFO_PASSWORD.sub(r"\1@", url))
    netloc = u.netloc
    userinfo, at, host = netloc.rpartition("@")
    if at and ":" in userinfo:
        netloc = userinfo.partition(":")[0] + ("@" if userinfo.partition(":")[0] else "") + host
    query = "&".join(p for p in u.query.split("&") if p and not _secret_param(p)) if u.query else u.query
    if (netloc, query) == (u.netloc, u.query):
        return url
    # not urlunsplit: it writes "unix:/path" for "unix://:pw@/path", which redis-py no longer reads
    authority = url[len(u.scheme) + 1:] if u.scheme else url
    return ((f"{u.scheme}:" if u.scheme else "") + ("//" + netloc if authority.startswith("//") else "") + u.path
            + (f"?{query}" if query else "") + (f"#{u.fragment}" if u.fragment else ""))


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
    if isinstance(data, str) and "://" in data:
        return strip_password(data)
    return data


def redacted_override(text: str) -> str:
    """A ``key=value`` command-line override fit to print (its value redacted like the config)."""
    key, sep, value = text.partition("=")
    if not sep:
        return text
    return f"{key}={REDACTED}" if _secret_key(key.rsplit('.', 1)[-1]) and value else f"{key}={redacted(value)}"


def server_api_key(cfg: Any) -> str | None:
    """The inference servers' API key: the first line of ``serve.api_key_file`` when that is set,
    else the variable ``serve.api_key_env`` names; None for none. The server (vLLM's
    ``VLLM_API_KEY``) and the actors' client (``Authorization: Bearer``) both take it from here."""
    s = cfg.serve
    if s.api_key_file:
        try:
            lines = Path(s.api_key_file).read_text().strip().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError("serve.api_key_file", f"cannot read the API key file {s.api_key_file!r}: "
                                                    f"{getattr(e, 'strerror', None) or e}") from None
        if not lines or not lines[0].strip():
            raise ConfigError("serve.api_key_file", f"the API key file {s.api_key_file!r} is empty")
        return lines[0].strip()
    return os.environ.get(s.api_key_env, "").strip() or None


def bearer_ok(authorization: str, key: str) -> bool:
    """Whether an ``Authorization`` header's value is ``Bearer <key>`` (compared in constant time,
    as vLLM compares it)."""
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(hashlib.sha256(token.encode()).digest(),
                                                              hashlib.sha256(key.encode()).digest())


def password_to_env(cfg: Any, env: dict[str, str]) -> bool:
    """Move ``cfg.redis.url``'s password (user info or ``?password=``) into
    ``env[WORLDLOOP_REDIS_PASSWORD]`` and out of the URL (for child processes that read a written
    config); True when there was one."""
    password = url_password(cfg.redis.url) if cfg.redis.url else None
    if not password:
        return False
    env[REDIS_PASSWORD_ENV] = password
    cfg.redis.url = strip_password(cfg.redis.url)
    return True
