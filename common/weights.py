"""The ZeroMQ weight channel: the learner publishes policy versions, actors fetch the newest.

Wire protocol (``worldloop.weights/1``)
---------------------------------------
The publisher binds two sockets:

* **PUB** (``pub_port``) announces ``[b"worldloop.weights", JSON {"format", "version",
  "sha256", "size"}]`` on every publish and again every ``announce_interval_s``, so a
  subscriber that connects late learns the current version from ``latest_announced()``.
* **ROUTER** (``fetch_port``) serves the bytes of the newest version only. Requests
  from a subscriber's DEALER are ``[b"", command, JSON]`` (the standard ZeroMQ
  envelope, so the channel also works through ``zmq.proxy`` or any ROUTER/DEALER
  hop) and every request carries a request id ``rid`` that the reply echoes:

  - ``INFO {rid}`` -> ``MANIFEST {rid, format, version, size, chunk_bytes, sha256}``
    plus one frame with the CRC-32 of every chunk (big-endian uint32 each), or ``NONE {rid}``
    while nothing is published.
  - ``GET {rid, sha256, index}`` -> ``CHUNK {rid, sha256, index}`` plus the raw bytes
    of that chunk, when ``sha256`` names the version being served; otherwise the
    MANIFEST of the version now served (the subscriber restarts on it).
  - anything malformed -> ``ERROR {rid, error}`` (or nothing when not even the
    envelope parses).

A version is the safetensors-style encoding of its tensors (:func:`encode_tensors`)
cut into ``chunk_bytes`` chunks. Its identity is the sha256 of the whole encoding;
the manifest also holds a CRC-32 of each chunk.

Design decisions
----------------
* **Verified, complete, single-version hand-over.** The subscriber checks every
  chunk against its CRC-32 in the manifest before it copies it into place; a
  chunk that fails (wrong bytes, wrong length, wrong index, bad frame) is counted
  in ``worldloop_weights_rejected_chunks`` and requested again, up to
  ``max_chunk_retries`` times per chunk. The whole encoding is hashed with sha256
  (in a helper thread, in order, while later chunks still arrive) and must match
  the manifest before the header is decoded and the tensors handed over; a
  mismatch there (corruption CRC-32 cannot see, or tampering) fails the fetch and
  hands over nothing. Per-chunk CRC-32 rather than per-chunk sha256: the chunk
  check only has to find transport damage so that one chunk is fetched again,
  the sha256 of the whole is the integrity guarantee, and CRC-32 costs about a
  third of a second sha256 pass over the data (measured: 2.7-3.3 GB/s against
  1.2-1.7 GB/s here), which matters when several subscribers share a machine.
  Every GET names the version's sha256, so a chunk of another version can never
  be mixed in: when the publisher has moved on it answers with the new manifest
  and the subscriber starts over on the newest version (at most ``max_restarts``
  times per ``fetch``).
* **Late joiners** ask the ROUTER (``INFO``) instead of relying on PUB, so
  ``fetch`` works for a subscriber that connected after the announcement or
  missed versions; PUB is only the cheap "is there something new" signal.
* **Memory.** ``publish`` copies each tensor once, straight from its device into
  one preallocated buffer (no intermediate CPU copy, no ``bytes`` join). The
  previous encoding is served until the new one is complete, so the publisher
  holds at most two; with ``reuse_buffer`` (default) it keeps the previous one as a
  spare that the next publish of the same size overwrites (no fresh 1 GB
  allocation and page faults per version; a lock makes sure no request reads it
  any more). Each chunk is copied into its ZeroMQ message when sent (pyzmq's
  zero-copy send hands buffers back through a GC thread that needs the GIL, and
  it deadlocked under load here), so the memory on top is the chunks in flight,
  bounded by the subscribers' windows. The subscriber copies each verified chunk
  into one preallocated buffer and returns tensors that are views into it (no
  second copy); a restart drops the partial download before allocating the next,
  so a subscriber holds at most the set its caller kept plus the one being fetched.
* **Flow control and concurrency.** A subscriber keeps at most ``window_bytes``
  (16 MiB: 4 chunks) of chunk requests in flight, so the publisher never queues
  more than that per subscriber (its transient memory beyond the encodings is at
  most subscribers x window; 16 MiB is as fast as 32 MiB on loopback, 8 MiB is
  not) and one thread serves any number of subscribers (a send never blocks:
  ROUTER drops what cannot be routed, and the subscriber re-requests whatever
  got no reply within ``resend_s``, e.g. after a publisher restart).
* **Timeouts.** ``fetch`` raises :class:`WeightsTimeout` when the publisher gives
  no answer for ``fetch_timeout_s`` (a progress timeout: a 1 GB set on a slow link
  may take longer than that in total, as long as chunks keep coming). The message
  says whether the TCP connection was never made, the handshake failed (CURVE key
  mismatch / unauthorized client / CURVE on one side only) or the publisher is
  connected but silent, from the socket's monitor events.
* **CURVE.** With ``curve_secret_key_file`` (a ``.key_secret`` file made by
  ``zmq.auth.create_certificates``) both PUB and ROUTER are CURVE servers: all
  traffic is encrypted and only clients that know the server public key can
  connect. ``curve_authorized_clients`` (a public key file or a folder of them)
  additionally restricts access to those client keys through a ZAP
  authenticator. In the config: ``weights.curve_server_secret`` (learner),
  ``weights.curve_server_public`` + ``weights.curve_client_secret`` (actors),
  ``weights.curve_client_public`` (learner: the authorized client key file or folder).
* **Never pickle.** The header is JSON, the payload raw little-endian tensor bytes.

Not thread-safe per object except ``WeightPublisher.publish`` (any thread may call
it; calls are serialized). One subscriber belongs to one thread.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import struct
import threading
import time
import zlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from common.metrics import metric

log = logging.getLogger(__name__)

FORMAT = "worldloop.weights/1"
TOPIC = b"worldloop.weights"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the limit safetensors uses too

# safetensors dtype names (C128 and F8_E8M0 where torch has them; C128 is our extension)
_DTYPE_NAMES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "F16": "float16",
    "BF16": "bfloat16", "I32": "int32", "U32": "uint32", "F32": "float32", "F64": "float64",
    "I64": "int64", "U64": "uint64", "C64": "complex64", "C128": "complex128",
    "F8_E4M3": "float8_e4m3fn", "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2": "float8_e5m2",
    "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu",
}
DTYPES: dict[str, torch.dtype] = {
    code: getattr(torch, name) for code, name in _DTYPE_NAMES.items() if isinstance(getattr(torch, name, None), torch.dtype)
}
_CODES: dict[torch.dtype, str] = {dt: code for code, dt in DTYPES.items()}
_ITEMSIZE: dict[torch.dtype, int] = {dt: torch.empty((), dtype=dt).element_size() for dt in DTYPES.values()}


class WeightsError(RuntimeError):
    """The weight channel could not deliver a verified version."""


class WeightsTimeout(WeightsError, TimeoutError):
    """The publisher did not answer within ``fetch_timeout_s``."""


class WeightsArgumentError(ValueError):
    """The constructor argument ``arg`` is invalid (the config helpers name its config key instead)."""

    def __init__(self, arg: str, reason: str):
        self.arg = arg
        self.reason = reason
        super().__init__(f"{arg}: {reason}")


class KeyFileError(WeightsArgumentError):
    """A CURVE key file (named by the constructor argument ``arg``) is missing or unusable."""


# --------------------------------------------------------------------------- encoding


def _check_version(version: Any) -> int:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version must be an integer >= 0, got {version!r}")
    return version


def _layout(tensors: Mapping[str, torch.Tensor], version: int) -> tuple[bytes, list[tuple[torch.Tensor, int, int]]]:
    """Header bytes (padded) and (tensor, begin, end) in data order, safetensors style.

    Tensors are ordered by element size (largest first), then name, so every
    tensor's offset is a multiple of its element size; the header is padded with
    spaces so that the data starts at a multiple of 16 bytes.
    """
    _check_version(version)
    if not isinstance(tensors, Mapping):
        raise ValueError(f"tensors must be a mapping name -> torch.Tensor, got {type(tensors).__name__}")
    items = []
    for name, t in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ValueError(f"tensor name {name!r} is not allowed (a non-empty string other than '__metadata__')")
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"tensor {name!r}: expected a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided or t.is_meta:
            raise ValueError(f"tensor {name!r}: only dense tensors with data can be sent "
                             f"(layout {t.layout}, device {t.device})")
        if t.dtype not in _CODES:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} is not supported (supported: {', '.join(map(str, _CODES))})")
        items.append((name, t))
    items.sort(key=lambda it: (-it[1].element_size(), it[0]))
    header: dict[str, Any] = {"__metadata__": {"format": FORMAT, "version": str(version)}}
    placed, off = [], 0
    for name, t in items:
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _CODES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + n]}
        placed.append((t, off, off + n))
        off += n
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-(8 + len(hb)) % 16)
    return hb, placed


def _encode_array(tensors: Mapping[str, torch.Tensor], version: int, reuse: np.ndarray | None = None) -> np.ndarray:
    """The encoding in one uint8 array (``reuse`` when it has the right size), each tensor copied once."""
    hb, placed = _layout(tensors, version)
    start = 8 + len(hb)
    size = start + (placed[-1][2] if placed else 0)
    arr = reuse if reuse is not None and reuse.nbytes == size else np.empty(size, dtype=np.uint8)
    arr[:8] = np.frombuffer(struct.pack("<Q", len(hb)), dtype=np.uint8)
    arr[8:start] = np.frombuffer(hb, dtype=np.uint8)
    buf = torch.from_numpy(arr)
    with torch.no_grad():
        for t, b, e in placed:
            if e > b:
                buf[start + b:start + e].view(t.dtype).view(t.shape).copy_(t)
    return arr


def encode_tensors(tensors: Mapping[str, torch.Tensor], version: int) -> bytes:
    """Named tensors -> safetensors-compatible bytes with ``__metadata__ = {format, version}``.

    Any dtype in :data:`DTYPES` (bf16 and fp8 included), any device, contiguous
    or not. ``safetensors.torch.load`` reads the result too.
    """
    return _encode_array(tensors, version).tobytes()


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_header(mv: memoryview) -> tuple[int, list[tuple[str, torch.dtype, list[int], int, int]], int]:
    """Validate the header; return (version, [(name, dtype, shape, begin, end)], data start)."""
    if len(mv) < 8:
        raise ValueError(f"data too short for a header length ({len(mv)} bytes)")
    (hlen,) = struct.unpack_from("<Q", mv, 0)
    if hlen > MAX_HEADER_BYTES:
        raise ValueError(f"header length {hlen} exceeds the limit of {MAX_HEADER_BYTES} bytes")
    if 8 + hlen > len(mv):
        raise ValueError(f"header length {hlen} runs past the end of the data ({len(mv)} bytes)")
    try:
        header = json.loads(bytes(mv[8:8 + hlen]).decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"header must be a JSON object, got {type(header).__name__}")
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("header needs '__metadata__': an object of strings with the version")
    raw_version = meta.get("version")
    if raw_version is None or not (raw_version.isascii() and raw_version.isdigit()):
        raise ValueError(f"__metadata__.version must be a decimal integer string, got {raw_version!r}")
    data_len = len(mv) - 8 - hlen
    entries = []
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise ValueError(f"tensor {name!r}: entry must have exactly dtype, shape and data_offsets, got {info!r}")
        dtype = DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
        if dtype is None:
            raise ValueError(f"tensor {name!r}: unknown dtype {info['dtype']!r}")
        shape, offs = info["shape"], info["data_offsets"]
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise ValueError(f"tensor {name!r}: shape must be a list of integers >= 0, got {shape!r}")
        if not isinstance(offs, list) or len(offs) != 2 or not all(_is_int(o) for o in offs):
            raise ValueError(f"tensor {name!r}: data_offsets must be [begin, end] integers, got {offs!r}")
        b, e = offs
        if not 0 <= b <= e <= data_len:
            raise ValueError(f"tensor {name!r}: data_offsets {offs} out of range (data section is {data_len} bytes)")
        want = math.prod(shape) * _ITEMSIZE[dtype]
        if e - b != want:
            raise ValueError(f"tensor {name!r}: {e - b} bytes for {info['dtype']} {shape} which needs {want}")
        entries.append((name, dtype, shape, b, e))
    pos = 0
    for name, _, _, b, e in sorted(entries, key=lambda x: (x[3], x[4])):
        if b < pos:
            raise ValueError(f"tensor {name!r}: data_offsets [{b}, {e}] overlap another tensor (which ends at {pos})")
        if b > pos:
            raise ValueError(f"bytes [{pos}, {b}) of the data section belong to no tensor")
        pos = e
    if pos != data_len:
        raise ValueError(f"{data_len - pos} trailing bytes after the last tensor")
    return int(raw_version), entries, 8 + hlen


def decode_tensors(data: Any) -> tuple[int, dict[str, torch.Tensor]]:
    """bytes-like -> (version, tensors); every field is validated, ValueError says what is wrong.

    From a writable buffer (bytearray, numpy array, writable memoryview) the
    tensors are zero-copy views into it (aligned ones; keep the buffer unchanged);
    from read-only ``bytes`` they are copies.
    """
    mv = memoryview(data).cast("B")
    version, entries, start = _parse_header(mv)
    base = torch.from_numpy(np.frombuffer(mv, dtype=np.uint8)) if not mv.readonly else None
    out: dict[str, torch.Tensor] = {}
    for name, dtype, shape, b, e in entries:
        if e == b:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        if base is None:
            raw = torch.from_numpy(np.frombuffer(mv, dtype=np.uint8, count=e - b, offset=start + b).copy())
        else:
            raw = base[start + b:start + e]
            if (start + b) % _ITEMSIZE[dtype]:
                raw = raw.clone()  # unaligned (a foreign writer): a view would be refused
        out[name] = raw.view(dtype).view(shape)
    return version, out


# --------------------------------------------------------------------------- keys


def _load_key(path: str | os.PathLike | None, arg: str, *, secret: bool) -> tuple[bytes, bytes | None]:
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


def _load_public_keys(path: str | os.PathLike, arg: str) -> set[bytes]:
    p = os.fspath(path)
    if os.path.isdir(p):
        try:
            keys = set(zmq.auth.load_certificates(p))
        except (OSError, ValueError) as e:
            raise KeyFileError(arg, f"cannot read the key files in {p!r}: {e}") from None
        if not keys:
            raise KeyFileError(arg, f"folder {p!r} holds no public key files (*.key)")
        return keys
    return {_load_key(p, arg, secret=False)[0]}


class _AllowList:
    """ZAP credentials provider: allow exactly these client public keys (z85)."""

    def __init__(self, keys: set[bytes]):
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key in self.keys
        if not ok:
            log.warning("weights: refused a CURVE client with unknown public key %s", key.decode(errors="replace"))
        return ok


# --------------------------------------------------------------------------- manifest


@dataclass(frozen=True)
class _Manifest:
    version: int
    size: int
    chunk_bytes: int
    sha256: str
    crcs: tuple[int, ...]  # CRC-32 per chunk

    @property
    def n_chunks(self) -> int:
        return max(1, -(-self.size // self.chunk_bytes))

    def span(self, i: int) -> tuple[int, int]:
        return i * self.chunk_bytes, min(self.size, (i + 1) * self.chunk_bytes)

    def crc_frame(self) -> bytes:
        return struct.pack(f">{len(self.crcs)}I", *self.crcs)

    def meta(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": self.version, "size": self.size, "chunk_bytes": self.chunk_bytes,
                "sha256": self.sha256}

    @classmethod
    def parse(cls, hdr: dict, crc_frame: memoryview) -> _Manifest:
        if hdr.get("format") != FORMAT:
            raise ValueError(f"publisher speaks {hdr.get('format')!r}, this subscriber {FORMAT!r}")
        try:
            crcs = struct.unpack(f">{len(crc_frame) // 4}I", crc_frame)
            m = cls(int(hdr["version"]), int(hdr["size"]), int(hdr["chunk_bytes"]), str(hdr["sha256"]), crcs)
        except (KeyError, TypeError, ValueError, struct.error) as e:
            raise ValueError(f"bad manifest {hdr!r}: {e}") from None
        if m.size < 8 or m.chunk_bytes < 1 or len(crc_frame) != 4 * m.n_chunks or len(m.sha256) != 64:
            raise ValueError(f"inconsistent manifest {hdr!r} with {len(crc_frame)} bytes of chunk CRCs")
        return m


@dataclass(frozen=True)
class _Served:
    manifest: _Manifest
    arr: np.ndarray  # the whole encoding

    def chunk(self, i: int) -> memoryview:
        b, e = self.manifest.span(i)
        return memoryview(self.arr)[b:e]


def _checksums(arr: np.ndarray, chunk_bytes: int) -> tuple[str, tuple[int, ...]]:
    """(sha256 hex of the whole encoding, CRC-32 of each chunk); the two passes run in parallel."""
    mv = memoryview(arr)
    n = max(1, -(-len(mv) // chunk_bytes))
    with ThreadPoolExecutor(1) as pool:
        whole = pool.submit(lambda: hashlib.sha256(mv).hexdigest())
        crcs = tuple(zlib.crc32(mv[i * chunk_bytes:(i + 1) * chunk_bytes]) for i in range(n))
        return whole.result(), crcs


def _check_port(port: Any, arg: str, *, allow_zero: bool) -> None:
    if _is_int(port) and (0 if allow_zero else 1) <= port < 65536:
        return
    if port == 0:
        raise WeightsArgumentError(arg, "0 (an ephemeral port) only works where the socket is bound: "
                                        "give the publisher's actual port")
    raise WeightsArgumentError(arg, f"must be a TCP port{' (0 = ephemeral)' if allow_zero else ''}, got {port!r}")


def _endpoint(host: str, port: int | str) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _dumps(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


# --------------------------------------------------------------------------- publisher


class WeightPublisher:
    """Announces versions on PUB and serves the newest one in chunks from a ROUTER thread."""

    def __init__(self, bind: str = "127.0.0.1", pub_port: int = 0, fetch_port: int = 0, *,
                 chunk_bytes: int = 4 << 20, curve_secret_key_file: str | os.PathLike | None = None,
                 curve_authorized_clients: str | os.PathLike | None = None,
                 announce_interval_s: float = 1.0, io_threads: int = 1, reuse_buffer: bool = True):
        if not _is_int(chunk_bytes) or chunk_bytes < 1024:
            raise ValueError(f"chunk_bytes must be an integer >= 1024, got {chunk_bytes!r}")
        if announce_interval_s <= 0:
            raise ValueError(f"announce_interval_s must be > 0, got {announce_interval_s!r}")
        _check_port(pub_port, "pub_port", allow_zero=True)
        _check_port(fetch_port, "fetch_port", allow_zero=True)
        self.chunk_bytes = chunk_bytes
        self.announce_interval_s = announce_interval_s
        self.reuse_buffer = reuse_buffer
        self._current: _Served | None = None
        self._spare: np.ndarray | None = None  # the previous encoding, overwritten by the next publish
        self._publish_lock = threading.Lock()
        self._serve_lock = threading.Lock()  # held while a request reads the current encoding
        self._closed = False
        self._auth = None
        self._ctx = zmq.Context(io_threads)
        self._sockets: list[zmq.Socket] = []
        try:
            keys = None
            if curve_secret_key_file is not None:
                if not zmq.has("curve"):
                    raise WeightsError("this libzmq has no CURVE support")
                keys = _load_key(curve_secret_key_file, "curve_secret_key_file", secret=True)
            if curve_authorized_clients is not None:
                if keys is None:
                    raise KeyFileError("curve_authorized_clients", "is set but CURVE is off (no server secret key file)")
                allowed = _load_public_keys(curve_authorized_clients, "curve_authorized_clients")
                self._auth = ThreadAuthenticator(self._ctx)
                self._auth.start()
                self._auth.configure_curve_callback("*", _AllowList(allowed))
            self._pub = self._socket(zmq.PUB, keys)
            self._router = self._socket(zmq.ROUTER, keys)
            self.pub_port = self._bind(self._pub, bind, pub_port, "pub_port")
            self.fetch_port = self._bind(self._router, bind, fetch_port, "fetch_port")
            wake_addr = f"inproc://worldloop-weights-{id(self)}"
            self._wake_in = self._socket(zmq.PAIR, None)
            self._wake_in.bind(wake_addr)
            self._wake = self._socket(zmq.PAIR, None)
            self._wake.connect(wake_addr)
        except BaseException:
            self._teardown()
            raise
        self.curve = keys is not None
        self._m_versions = metric("worldloop_weights_published_versions")
        self._m_bytes = metric("worldloop_weights_published_bytes")
        self._m_served = metric("worldloop_weights_served_chunks")
        self._m_version = metric("worldloop_weights_version")
        self._thread = threading.Thread(target=self._serve, name="weights-router", daemon=True)
        self._thread.start()
        log.info("weights publisher: PUB %s, ROUTER %s%s", _endpoint(bind, self.pub_port),
                 _endpoint(bind, self.fetch_port), " (CURVE)" if self.curve else "")

    def _socket(self, kind: int, keys: tuple[bytes, bytes | None] | None) -> zmq.Socket:
        s = self._ctx.socket(kind)
        self._sockets.append(s)
        s.linger = 0
        if keys is not None:
            s.curve_publickey, s.curve_secretkey = keys
            s.curve_server = True
        return s

    @staticmethod
    def _bind(sock: zmq.Socket, host: str, port: int, arg: str) -> int:
        addr = _endpoint(host, port if port else "*")
        try:
            sock.bind(addr)
        except zmq.ZMQError as e:
            raise WeightsError(f"cannot bind the weights {arg} socket on {addr}: {e}") from None
        return int(sock.last_endpoint.decode().rsplit(":", 1)[1])

    @property
    def version(self) -> int | None:
        """The version being served (None before the first publish)."""
        cur = self._current
        return cur.manifest.version if cur else None

    @property
    def nbytes(self) -> int | None:
        """Size of the encoding being served (None before the first publish)."""
        cur = self._current
        return cur.manifest.size if cur else None

    def publish(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy ``tensors`` (any device/dtype) into a new encoding and serve it as ``version``.

        ``version`` must be newer than the last one published here. Returns once
        the copy is taken: the caller may change its tensors right after.
        """
        _check_version(version)
        with self._publish_lock:
            if self._closed:
                raise WeightsError("the publisher is closed")
            last = self.version
            if last is not None and version <= last:
                raise ValueError(f"version {version} is not newer than the published version {last}")
            t0 = time.perf_counter()
            arr = _encode_array(tensors, version, reuse=self._spare)
            sha, crcs = _checksums(arr, self.chunk_bytes)
            manifest = _Manifest(version, arr.nbytes, self.chunk_bytes, sha, crcs)
            with self._serve_lock:  # after this no request reads the old encoding: it becomes the spare
                old, self._current = self._current, _Served(manifest, arr)
            self._spare = old.arr if old is not None and self.reuse_buffer else None
            try:
                self._wake.send(b"announce", zmq.NOBLOCK)
            except zmq.Again:  # the router thread has announcements queued already
                pass
            self._m_versions.inc()
            self._m_bytes.inc(arr.nbytes)
            self._m_version.set(version)
            log.info("published weights v%d: %d tensors, %.1f MB, %d chunks, %.2f s", version, len(tensors),
                     arr.nbytes / 1e6, manifest.n_chunks, time.perf_counter() - t0)

    # ---- the ROUTER thread (owns PUB, ROUTER and the wake socket)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
        next_announce = time.monotonic() + self.announce_interval_s
        try:
            while True:
                wait_ms = max(0, int((next_announce - time.monotonic()) * 1000))
                events = dict(poller.poll(wait_ms))
                if self._wake_in in events:
                    if self._wake_in.recv() == b"stop":
                        return
                    next_announce = 0.0
                if self._router in events:
                    for _ in range(256):  # a burst, then look at the wake socket again
                        try:
                            frames = self._router.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        try:
                            with self._serve_lock:
                                self._handle(frames)
                        except Exception:  # never let one request kill the server thread
                            log.exception("weights: failed to answer a request")
                if time.monotonic() >= next_announce:
                    self._announce()
                    next_announce = time.monotonic() + self.announce_interval_s
        except zmq.ContextTerminated:
            return

    def _announce(self) -> None:
        cur = self._current
        if cur is not None:
            m = cur.manifest
            msg = {"format": FORMAT, "version": m.version, "sha256": m.sha256, "size": m.size}
            self._pub.send_multipart([TOPIC, _dumps(msg)], zmq.NOBLOCK)

    def _handle(self, frames: list[bytes]) -> None:
        try:
            split = frames.index(b"")
        except ValueError:
            log.debug("weights: dropped a request without an envelope delimiter")
            return
        envelope, body = frames[:split + 1], frames[split + 1:]
        rid = None
        try:
            if len(body) != 2:
                raise ValueError(f"expected [command, JSON], got {len(body)} frames")
            req = json.loads(body[1])
            if not isinstance(req, dict):
                raise ValueError("request must be a JSON object")
            rid = req.get("rid")
            cmd = body[0]
            if cmd not in (b"INFO", b"GET"):
                raise ValueError(f"unknown command {cmd[:32]!r}")
        except ValueError as e:
            self._router.send_multipart(envelope + [b"ERROR", _dumps({"rid": rid, "error": str(e)})])
            return
        cur = self._current
        if cur is None:
            self._router.send_multipart(envelope + [b"NONE", _dumps({"rid": rid})])
            return
        m = cur.manifest
        if cmd == b"GET" and req.get("sha256") == m.sha256:
            idx = req.get("index")
            if not _is_int(idx) or not 0 <= idx < m.n_chunks:
                self._router.send_multipart(envelope + [b"ERROR", _dumps({"rid": rid, "error": f"bad chunk index {idx!r}"})])
                return
            head = _dumps({"rid": rid, "sha256": m.sha256, "index": idx})
            # copy=True on purpose: pyzmq's zero-copy sends hand buffers back through a GC thread that
            # needs the GIL, which deadlocked under load; one memcpy of the chunk is cheap and bounded
            self._router.send_multipart(envelope + [b"CHUNK", head, cur.chunk(idx)])
            self._m_served.inc()
            return
        # INFO, or a GET for a version no longer served: the current manifest
        self._router.send_multipart(envelope + [b"MANIFEST", _dumps({"rid": rid, **m.meta()}), m.crc_frame()])

    # ---- lifecycle

    def close(self) -> None:
        with self._publish_lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._wake.send(b"stop")
            except zmq.ZMQError:
                pass
        self._thread.join(timeout=10)
        self._teardown()

    def _teardown(self) -> None:
        for s in self._sockets:
            s.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()
        self._current = self._spare = None

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# --------------------------------------------------------------------------- subscriber

_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_MONITOR_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | _HANDSHAKE_FAILED


class _Moved:
    """The publisher serves another version now (``manifest``; None: nothing)."""

    def __init__(self, manifest: _Manifest | None):
        self.manifest = manifest


class WeightSubscriber:
    """Fetches the newest complete, verified version from a :class:`WeightPublisher`."""

    def __init__(self, host: str, pub_port: int, fetch_port: int, *, fetch_timeout_s: float = 30,
                 curve_server_public_key_file: str | os.PathLike | None = None,
                 curve_client_key_file: str | os.PathLike | None = None,
                 window_bytes: int = 16 << 20, max_chunk_retries: int = 5, max_restarts: int = 20,
                 resend_s: float | None = None, max_bytes: int | None = None):
        if not fetch_timeout_s > 0:
            raise ValueError(f"fetch_timeout_s must be > 0, got {fetch_timeout_s!r}")
        if max_bytes is not None and max_bytes < 8:
            raise WeightsArgumentError("max_bytes", f"must be >= 8 bytes or None, got {max_bytes!r}")
        self.max_bytes = max_bytes
        _check_port(pub_port, "pub_port", allow_zero=False)
        _check_port(fetch_port, "fetch_port", allow_zero=False)
        self.fetch_timeout_s = float(fetch_timeout_s)
        self.resend_s = resend_s if resend_s is not None else max(0.5, min(10.0, self.fetch_timeout_s / 3))
        self.window_bytes = window_bytes
        self.max_chunk_retries = max_chunk_retries
        self.max_restarts = max_restarts
        self.endpoint = _endpoint(host, fetch_port)
        self.stats = {"fetches": 0, "restarts": 0, "rejected_chunks": 0, "resent_requests": 0}
        server_key = client = None
        if curve_server_public_key_file is not None:
            server_key = _load_key(curve_server_public_key_file, "curve_server_public_key_file", secret=False)[0]
            client = (_load_key(curve_client_key_file, "curve_client_key_file", secret=True)
                      if curve_client_key_file is not None else zmq.curve_keypair())
        elif curve_client_key_file is not None:
            raise KeyFileError("curve_client_key_file", "is set but CURVE is off (no server public key file)")
        self.curve = server_key is not None
        self._ctx = zmq.Context()
        try:
            self._sub = self._socket(zmq.SUB, server_key, client)
            self._sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
            self._dealer = self._socket(zmq.DEALER, server_key, client)
            self._monitor = self._dealer.get_monitor_socket(_MONITOR_EVENTS)
            for sock, endpoint in ((self._sub, _endpoint(host, pub_port)), (self._dealer, self.endpoint)):
                try:
                    sock.connect(endpoint)
                except zmq.ZMQError as e:
                    raise ValueError(f"cannot connect to the weight publisher at {endpoint}: {e}") from None
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        self._poller = zmq.Poller()
        self._poller.register(self._dealer, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._link = "no TCP connection was made (is the learner up, are host and fetch_port right?)"
        self._announced: int | None = None
        self._rid = 0
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="weights-sha256")
        self._m_version = metric("worldloop_weights_version")
        self._m_seconds = metric("worldloop_weights_fetch_seconds")
        self._m_rejected = metric("worldloop_weights_rejected_chunks")

    def _socket(self, kind: int, server_key: bytes | None, client: tuple[bytes, bytes | None] | None) -> zmq.Socket:
        s = self._ctx.socket(kind)
        s.linger = 0
        if server_key is not None and client is not None:
            s.curve_serverkey = server_key
            s.curve_publickey, s.curve_secretkey = client
        return s

    # ---- announcements

    def latest_announced(self) -> int | None:
        """The version of the newest announcement received so far (non-blocking), None if none."""
        while True:
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return self._announced
            try:
                msg = json.loads(frames[1])
                if msg.get("format") == FORMAT and _is_int(msg.get("version")):
                    self._announced = msg["version"]
            except (IndexError, ValueError, AttributeError):
                log.debug("weights: ignored a malformed announcement")

    # ---- fetching

    def fetch(self, min_version: int = 0) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest complete, sha256-verified version newer than ``min_version``, or None.

        Raises :class:`WeightsTimeout` when the publisher does not answer for
        ``fetch_timeout_s`` and :class:`WeightsError` when a chunk keeps failing
        verification or the publisher keeps moving to new versions mid-fetch.
        """
        t0 = time.perf_counter()
        self.stats["fetches"] += 1
        manifest = self._ask_manifest()
        restarts = 0
        while True:
            if manifest is None or manifest.version <= min_version:
                return None
            got = self._download(manifest)
            if not isinstance(got, _Moved):
                break
            restarts += 1
            self.stats["restarts"] += 1
            if restarts > self.max_restarts:
                raise WeightsError(f"the publisher moved to a new version {restarts} times during one fetch; try again")
            log.info("weights: publisher moved from v%d to %s mid-fetch; starting over", manifest.version,
                     f"v{got.manifest.version}" if got.manifest else "nothing")
            manifest = got.manifest
        version, tensors = got
        elapsed = time.perf_counter() - t0
        self._m_version.set(version)
        self._m_seconds.observe(elapsed)
        log.info("fetched weights v%d: %.1f MB in %.2f s", version, manifest.size / 1e6, elapsed)
        return version, tensors

    def _send(self, cmd: bytes, req: dict) -> int:
        """Send a request without ever blocking; one that cannot go out now counts as lost (resent later)."""
        self._rid += 1
        try:
            # a DEALER without a live connection (e.g. refused by the publisher's ZAP) would block forever
            self._dealer.send_multipart([b"", cmd, _dumps({"rid": self._rid, **req})], zmq.NOBLOCK)
        except zmq.Again:
            pass
        return self._rid

    def _reply(self, timeout_s: float) -> tuple[int, bytes, dict, list[zmq.Frame]] | None:
        """One well-formed reply (rid, kind, header, payload frames) or None when none came in time."""
        events = dict(self._poller.poll(max(1, int(timeout_s * 1000))))
        if self._monitor in events:
            self._drain_monitor()
        if self._dealer not in events:
            return None
        frames = self._dealer.recv_multipart(copy=False)
        try:
            if len(frames) < 3 or frames[0].bytes != b"":
                raise ValueError(f"{len(frames)} frames")
            hdr = json.loads(frames[2].bytes)
            if not isinstance(hdr, dict) or not _is_int(hdr.get("rid")):
                raise ValueError("no request id")
        except ValueError as e:
            self._reject(f"malformed reply ({e})")
            return None
        return hdr["rid"], frames[1].bytes, hdr, frames[3:]

    def _drain_monitor(self) -> None:
        while self._monitor.poll(0):
            ev = recv_monitor_message(self._monitor)["event"]
            if ev == zmq.EVENT_CONNECTED:
                if not self._link.startswith("the handshake failed"):  # a reconnect keeps the failure's reason
                    self._link = "TCP connected, but the security handshake did not finish"
            elif ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._link = "connected and handshake done, but the publisher did not reply"
            elif ev & _HANDSHAKE_FAILED:
                if ev == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                    hint = ("the publisher refused this client key: it is not among the learner's authorized keys "
                            "(weights.curve_client_public)")
                elif self.curve:
                    hint = ("check that weights.curve_server_public is the learner's server public key "
                            "(or the learner runs without CURVE)")
                else:
                    hint = "this side uses no CURVE, the publisher probably does (set weights.curve_server_public)"
                self._link = f"the handshake failed ({zmq.Event(ev).name}): {hint}"

    def _timeout(self, what: str) -> WeightsTimeout:
        self._drain_monitor()
        return WeightsTimeout(f"no answer from the weight publisher at {self.endpoint} for "
                              f"{self.fetch_timeout_s:g} s while {what}: {self._link}")

    def _reject(self, reason: str) -> None:
        self.stats["rejected_chunks"] += 1
        self._m_rejected.inc()
        log.warning("weights: rejected a reply: %s", reason)

    def _ask_manifest(self) -> _Manifest | None:
        rid = self._send(b"INFO", {})
        last_progress = last_send = time.monotonic()
        while True:
            reply = self._reply(0.1)
            now = time.monotonic()
            if reply is None:
                if now - last_progress > self.fetch_timeout_s:
                    raise self._timeout("asking for the current version")
                if now - last_send > self.resend_s:
                    rid, last_send = self._send(b"INFO", {}), now
                    self.stats["resent_requests"] += 1
                continue
            got_rid, kind, hdr, payload = reply
            if got_rid != rid:
                continue  # a late reply to an earlier request
            return self._manifest_from(kind, hdr, payload)

    def _manifest_from(self, kind: bytes, hdr: dict, payload: list[zmq.Frame]) -> _Manifest | None:
        if kind == b"NONE":
            return None
        if kind == b"ERROR":
            raise WeightsError(f"the publisher refused the request: {hdr.get('error')}")
        if kind != b"MANIFEST" or len(payload) != 1:
            raise WeightsError(f"unexpected {kind[:32]!r} reply to a version request")
        try:
            m = _Manifest.parse(hdr, payload[0].buffer)
        except ValueError as e:
            raise WeightsError(str(e)) from None
        if self.max_bytes is not None and m.size > self.max_bytes:
            raise WeightsError(f"the publisher offers v{m.version} of {m.size:,} bytes, more than this subscriber's "
                               f"max_bytes {self.max_bytes:,} (weights.max_bytes); nothing was allocated")
        return m

    def _download(self, m: _Manifest) -> tuple[int, dict[str, torch.Tensor]] | _Moved:
        """Fetch, verify and decode version ``m``; _Moved when the publisher serves another one now."""
        arr = np.empty(m.size, dtype=np.uint8)
        whole = hashlib.sha256()
        live = [True]  # False once this download ends: hashing still queued for it is skipped

        def feed(part: memoryview) -> None:
            if live[0]:
                whole.update(part)

        try:
            moved = self._receive_chunks(m, arr, feed)
        finally:
            live[0] = False
        if moved is not None:
            return moved
        if whole.hexdigest() != m.sha256:
            self._reject(f"v{m.version}: every chunk passed its CRC-32 but the whole encoding fails its sha256")
            raise WeightsError(f"v{m.version}: every chunk passed its CRC-32 but the whole encoding does not match the "
                               f"manifest sha256 (corrupted in a way CRC-32 misses, or tampered with); nothing was "
                               f"handed over, fetch again")
        try:
            version, tensors = decode_tensors(arr)
        except ValueError as e:
            raise WeightsError(f"v{m.version} passed its checksums but does not decode: {e}") from None
        if version != m.version:
            raise WeightsError(f"the manifest says v{m.version} but the encoding says v{version}")
        return version, tensors

    def _receive_chunks(self, m: _Manifest, arr: np.ndarray, feed: Any) -> _Moved | None:
        """Fill ``arr`` with verified chunks, ``feed`` them in order to the hasher thread; wait for it."""
        view = memoryview(arr)
        n = m.n_chunks
        done = bytearray(n)
        failures = [0] * n
        todo = deque(range(n))
        inflight: dict[int, int] = {}  # rid -> chunk index
        window = max(2, self.window_bytes // m.chunk_bytes)
        hashed = 0  # chunks handed to the hasher, in order
        last_hash: Future | None = None
        remaining = n
        last_progress = last_send = time.monotonic()
        while remaining:
            while todo and len(inflight) < window:
                idx = todo.popleft()
                inflight[self._send(b"GET", {"sha256": m.sha256, "index": idx})] = idx
                last_send = time.monotonic()
            reply = self._reply(0.1)
            now = time.monotonic()
            if reply is None:
                if now - last_progress > self.fetch_timeout_s:
                    raise self._timeout(f"fetching v{m.version} ({n - remaining}/{n} chunks done)")
                if inflight and now - last_send > self.resend_s:  # lost requests/replies: ask again
                    self.stats["resent_requests"] += len(inflight)
                    todo.extendleft(sorted(inflight.values(), reverse=True))
                    inflight.clear()
                continue
            rid, kind, hdr, payload = reply
            idx = inflight.pop(rid, None)
            if idx is None:
                continue  # a late reply to an earlier request or fetch
            last_progress = now
            if kind != b"CHUNK":
                return _Moved(self._manifest_from(kind, hdr, payload))
            b, e = m.span(idx)
            data = payload[0].buffer if len(payload) == 1 else None
            if data is None or hdr.get("index") != idx or hdr.get("sha256") != m.sha256:
                reason = f"bad CHUNK frame for chunk {idx} of v{m.version}"
            elif len(data) != e - b:
                reason = f"chunk {idx} of v{m.version} has {len(data)} bytes, expected {e - b}"
            elif zlib.crc32(data) != m.crcs[idx]:
                reason = f"chunk {idx} of v{m.version} failed its CRC-32 check"
            else:
                arr[b:e] = np.frombuffer(data, dtype=np.uint8)
                done[idx] = 1
                remaining -= 1
                while hashed < n and done[hashed]:
                    hb, he = m.span(hashed)
                    last_hash = self._hasher.submit(feed, view[hb:he])
                    hashed += 1
                continue
            self._reject(reason)
            failures[idx] += 1
            if failures[idx] > self.max_chunk_retries:
                raise WeightsError(f"{reason} {failures[idx]} times; giving up on this fetch")
            todo.appendleft(idx)
        if last_hash is not None:
            last_hash.result()
        return None

    # ---- lifecycle

    def close(self) -> None:
        if self._ctx.closed:
            return
        self._hasher.shutdown(wait=True, cancel_futures=True)
        self._dealer.disable_monitor()
        for s in (self._monitor, self._dealer, self._sub):
            s.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> WeightSubscriber:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# --------------------------------------------------------------------------- from the config

# constructor argument -> the config key it comes from (for errors that name the key)
_CONFIG_KEYS = {
    "pub_port": "weights.pub_port",
    "fetch_port": "weights.fetch_port",
    "curve_secret_key_file": "weights.curve_server_secret",
    "curve_authorized_clients": "weights.curve_client_public",
    "curve_server_public_key_file": "weights.curve_server_public",
    "curve_client_key_file": "weights.curve_client_secret",
    "max_bytes": "weights.max_bytes",
}


def _from_config(make: Any, **kwargs: Any) -> Any:
    from common.config import ConfigError

    try:
        return make(**kwargs)
    except WeightsArgumentError as e:
        raise ConfigError(_CONFIG_KEYS.get(e.arg, e.arg), e.reason) from None


def publisher_from_config(cfg: Any) -> WeightPublisher:
    """The learner's publisher from ``cfg.weights`` (bind, ports, chunk size, CURVE server + allowed clients)."""
    w = cfg.weights
    return _from_config(WeightPublisher, bind=w.bind, pub_port=w.pub_port, fetch_port=w.fetch_port,
                        chunk_bytes=w.chunk_bytes, curve_secret_key_file=w.curve_server_secret,
                        curve_authorized_clients=w.curve_client_public)


def default_max_bytes(model_dir: str | os.PathLike) -> int:
    """The largest weight set an actor of ``model_dir`` accepts by default: 4x the bytes of its weight
    files (``*.safetensors``, ``*.bin``; a float32 set for a bfloat16 checkpoint, with room to spare)
    + 64 MiB."""
    on_disk = sum(p.stat().st_size for pattern in ("*.safetensors", "*.bin") for p in Path(model_dir).glob(pattern))
    return 4 * on_disk + (64 << 20)


def subscriber_from_config(cfg: Any) -> WeightSubscriber:
    """An actor's subscriber from ``cfg.weights`` (host, ports, timeout, CURVE server public + client
    secret, size cap: ``weights.max_bytes`` or :func:`default_max_bytes` of ``model.path``)."""
    w = cfg.weights
    max_bytes = w.max_bytes or default_max_bytes(cfg.model.path)
    return _from_config(WeightSubscriber, host=w.host, pub_port=w.pub_port, fetch_port=w.fetch_port,
                        fetch_timeout_s=w.fetch_timeout_s, curve_server_public_key_file=w.curve_server_public,
                        curve_client_key_file=w.curve_client_secret, max_bytes=max_bytes)


__all__ = [
    "DTYPES", "FORMAT", "KeyFileError", "WeightPublisher", "WeightSubscriber", "WeightsArgumentError", "WeightsError",
    "WeightsTimeout", "decode_tensors", "default_max_bytes", "encode_tensors", "publisher_from_config",
    "subscriber_from_config",
]
