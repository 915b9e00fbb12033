"""CURVE key handling for the weight channel: key files, allowed client keys, socket set-up.

With ``curve_secret_key_file`` (a ``.key_secret`` file made by ``zmq.auth.create_certificates``)
the publisher's PUB and ROUTER are CURVE servers: all traffic is encrypted and only clients that
know the server public key can connect. ``curve_authorized_clients`` (a public key file or a
folder of them) additionally restricts access to those client keys through a ZAP authenticator.
In the config: ``weights.curve_server_secret`` (learner), ``weights.curve_server_public`` +
``weights.curve_client_secret`` (actors), ``weights.curve_client_public`` (learner: the authorized
client key file or folder). Errors name the constructor argument (:class:`KeyFileError`), which
:func:`from_config` turns into a :class:`ConfigError` naming the config key.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from worldloop.common.transport.weights.codec import KeyFileError, WeightsArgumentError, WeightsError

log = logging.getLogger(__name__)


def load_key(path: str | os.PathLike, arg: str, *, secret: bool) -> tuple[bytes, bytes | None]:
    """(public, secret) z85 keys from a certificate file; ``secret``: the secret key must be there."""
    p = os.fspath(path)
    if not os.path.isfile(p):
        raise KeyFileError(arg, f"key file {p!r} does not exist or is not a file")
    try:
        public, sec = zmq.auth.load_certificate(p)
    except (OSError, ValueError) as e:
        raise KeyFileError(arg, f"cannot read key file {p!r}: {e}") from None
    if not public or len(public) != 40:
        raise KeyFileError(arg, f"{p!r} holds no valid CURVE public key")
    if secret and (not sec or len(sec) != 40):
        raise KeyFileError(arg, f"{p!r} holds no secret key (use the .key_secret file of zmq.auth.create_certificates)")
    return public, sec


def load_public_keys(path: str | os.PathLike, arg: str) -> set[bytes]:
    """The public keys in a key file, or in every ``*.key`` of a folder."""
    p = os.fspath(path)
    if os.path.isdir(p):
        try:
            keys = set(zmq.auth.load_certificates(p))
        except (OSError, ValueError) as e:
            raise KeyFileError(arg, f"cannot read the key files in {p!r}: {e}") from None
        if not keys:
            raise KeyFileError(arg, f"folder {p!r} holds no public key files (*.key)")
        return keys
    return {load_key(p, arg, secret=False)[0]}


class _AllowList:
    """ZAP credentials provider: allow exactly these client public keys (z85)."""

    def __init__(self, keys: set[bytes]):
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key in self.keys
        if not ok:
            log.warning("weights: refused a CURVE client with unknown public key %s", key.decode(errors="replace"))
        return ok


def server_keys(ctx: zmq.Context, secret_key_file: str | os.PathLike | None,
                authorized_clients: str | os.PathLike | None) -> tuple[tuple[bytes, bytes | None] | None,
                                                                        ThreadAuthenticator | None]:
    """The publisher's CURVE server key pair (None: no CURVE) and its started ZAP authenticator (or None)."""
    keys = None
    if secret_key_file is not None:
        if not zmq.has("curve"):
            raise WeightsError("this libzmq has no CURVE support")
        keys = load_key(secret_key_file, "curve_secret_key_file", secret=True)
    if authorized_clients is None:
        return keys, None
    if keys is None:
        raise KeyFileError("curve_authorized_clients", "is set but CURVE is off (no server secret key file)")
    allowed = load_public_keys(authorized_clients, "curve_authorized_clients")
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback("*", _AllowList(allowed))
    return keys, auth


def client_keys(server_public_key_file: str | os.PathLike | None,
                client_key_file: str | os.PathLike | None) -> tuple[bytes | None, tuple[bytes, bytes | None] | None]:
    """A subscriber's (server public key, client key pair); (None, None) without CURVE. Without a
    client key file a fresh key pair is made (fine unless the learner restricts client keys)."""
    if server_public_key_file is not None:
        server_key = load_key(server_public_key_file, "curve_server_public_key_file", secret=False)[0]
        client = (load_key(client_key_file, "curve_client_key_file", secret=True)
                  if client_key_file is not None else zmq.curve_keypair())
        return server_key, client
    if client_key_file is not None:
        raise KeyFileError("curve_client_key_file", "is set but CURVE is off (no server public key file)")
    return None, None


# constructor argument -> the config key it comes from (for errors that name the key)
CONFIG_KEYS = {
    "pub_port": "weights.pub_port",
    "fetch_port": "weights.fetch_port",
    "curve_secret_key_file": "weights.curve_server_secret",
    "curve_authorized_clients": "weights.curve_client_public",
    "curve_server_public_key_file": "weights.curve_server_public",
    "curve_client_key_file": "weights.curve_client_secret",
    "max_bytes": "weights.max_bytes",
}


def from_config(make: Any, **kwargs: Any) -> Any:
    """``make(**kwargs)``, with an argument error turned into a ConfigError that names the config key."""
    from worldloop.common.contracts.config import ConfigError

    try:
        return make(**kwargs)
    except WeightsArgumentError as e:
        raise ConfigError(CONFIG_KEYS.get(e.arg, e.arg), e.reason) from None
