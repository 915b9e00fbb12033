"""The ZeroMQ weight channel: the learner publishes policy versions, actors fetch the newest.

Modules: :mod:`.codec` (the safetensors-style encoding, CRC-32C per chunk, the whole-set hash,
the manifest, the errors), :mod:`.publisher` (the learner's hand-over and server),
:mod:`.subscriber` (the actors' verified fetch), :mod:`.keys` (CURVE key files and the
config-key errors).

Wire protocol (``worldloop.weights/2``)
---------------------------------------
The publisher binds two sockets:

* **PUB** (``pub_port``) announces ``[b"worldloop.weights", JSON {"format", "version", "hash",
  "digest", "size"}]`` when a version is served and again every ``announce_interval_s``, so a
  subscriber that connects late learns the current version from ``latest_announced()``.
* **ROUTER** (``fetch_port``) serves the bytes of the newest version only. Requests from a
  subscriber's DEALER are ``[b"", command, JSON]`` (the standard ZeroMQ envelope, so the
  channel also works through ``zmq.proxy`` or any ROUTER/DEALER hop) and every request
  carries a request id ``rid`` that the reply echoes:

  - ``INFO {rid}`` -> ``MANIFEST {rid, format, version, size, chunk_bytes, hash, digest}`` plus
    one frame with the CRC-32C of every chunk (big-endian uint32 each), or ``NONE {rid}`` while
    nothing is published. While a newer hand-over is being prepared the answer waits for it.
  - ``GET {rid, digest, index}`` -> ``CHUNK {rid, digest, index}`` plus the raw bytes of that
    chunk, when ``digest`` names the version being served; otherwise the MANIFEST of the
    version now served (the subscriber restarts on it).
  - anything malformed -> ``ERROR {rid, error}`` (or nothing when not even the envelope parses).

``hash`` names the whole-set hash (``xxh3_128`` by default, or ``sha256``); ``digest`` is its
hex digest of the whole encoding and the version's identity in every chunk request. Never
pickle: the header is JSON, the payload raw little-endian tensor bytes.
"""

from worldloop.common.transport.weights.codec import (
    DEFAULT_HASH,
    DTYPES,
    FORMAT,
    HASHES,
    KeyFileError,
    Manifest,
    WeightsArgumentError,
    WeightsError,
    WeightsTimeout,
    checksums,
    decode_tensors,
    encode_tensors,
)
from worldloop.common.transport.weights.publisher import WeightPublisher, publisher_from_config
from worldloop.common.transport.weights.subscriber import WeightSubscriber, default_max_bytes, subscriber_from_config

__all__ = [
    "DEFAULT_HASH", "DTYPES", "FORMAT", "HASHES", "KeyFileError", "Manifest", "WeightPublisher", "WeightSubscriber",
    "WeightsArgumentError", "WeightsError", "WeightsTimeout", "checksums", "decode_tensors", "default_max_bytes",
    "encode_tensors", "publisher_from_config", "subscriber_from_config",
]
