"""The weight channel's data: the safetensors-style encoding, its checksums, the manifest, the errors.

Encoding
--------
A version is the safetensors-compatible encoding of its tensors: an 8-byte little-endian
header length, a JSON header (``__metadata__ = {format, version}`` and per tensor its
dtype, shape and data offsets, padded with spaces so the data starts at a multiple of 16)
and the raw little-endian tensor bytes, ordered by element size (largest first), then
name, so every tensor's offset is a multiple of its element size. ``safetensors.torch.load``
reads it; :func:`decode_tensors` reads safetensors files too. The header is JSON and the
payload raw bytes: nothing is ever unpickled.

Checksums
---------
The encoding is cut into ``chunk_bytes`` chunks. The manifest carries

* a **CRC-32C** (Castagnoli, the ``crc32c`` package: SSE4.2/ARMv8 instructions, 10-25 GB/s
  here against 1.6 GB/s for zlib's CRC-32) of every chunk, so that a chunk damaged in
  transit is found and fetched again on its own, and
* a **whole-set hash** named in the manifest (``hash``: ``xxh3_128`` by default, 20 GB/s
  here; ``sha256`` at 0.9 GB/s can be chosen), checked over the whole encoding before
  anything is decoded or handed over; its digest is also the version's identity on the
  wire (every chunk request names it, so chunks of two versions never mix).

xxh3-128 is not a cryptographic hash: it finds corruption that the chunk CRCs miss, not a
deliberate forgery. Authenticity comes from CURVE (encrypted, authenticated transport);
a deployment that wants a cryptographic digest on top sets ``hash_algorithm="sha256"``.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import crc32c
import numpy as np
import torch
import xxhash

from worldloop.common.contracts.schemas import MAX_INT

FORMAT = "worldloop.weights/2"  # /2: the manifest names its whole-set hash; chunks carry CRC-32C
TOPIC = b"worldloop.weights"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the limit safetensors uses too

# ZMQ_MAXMSGSIZE of the sockets that read from the network: a peer that sends a larger frame is
# disconnected by libzmq from the frame's length prefix, before anything is allocated or read
# (the limit is per frame; the connection is made again and the socket keeps serving others).
# The learner's ROUTER and PUB read only requests ([command, JSON of rid, digest, chunk index]) and
# subscriptions, the actors' SUB only announcements: all under 1 KiB, so 64 KiB.
CONTROL_MAX_BYTES = 64 << 10
# An actor's DEALER reads replies: chunks of at most the whole encoding, a manifest and its CRC
# frame (4 bytes per chunk). Its limit is the subscriber's max_bytes (weights.max_bytes, by default
# 4x the model's weight files + 64 MiB) plus this headroom for the JSON headers; see reply_max_bytes.
REPLY_HEADROOM_BYTES = 1 << 20


def reply_max_bytes(max_bytes: int | None) -> int:
    """ZMQ_MAXMSGSIZE of a subscriber's DEALER: ``max_bytes`` + :data:`REPLY_HEADROOM_BYTES`, or -1
    (no limit) for a subscriber without ``max_bytes``."""
    return -1 if max_bytes is None else max_bytes + REPLY_HEADROOM_BYTES

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
ITEMSIZE: dict[torch.dtype, int] = {dt: torch.empty((), dtype=dt).element_size() for dt in DTYPES.values()}

# whole-set hashes a manifest may name: name -> (constructor of an object with update/hexdigest, hex digest length)
HASHES: dict[str, tuple[Callable[[], Any], int]] = {
    "xxh3_128": (xxhash.xxh3_128, 32),
    "sha256": (hashlib.sha256, 64),
}
DEFAULT_HASH = "xxh3_128"


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


def valid_version(version: Any) -> bool:
    """A policy version: an int in [0, 2^31), the bound of every message (common/contracts/schemas.py says why)."""
    return is_int(version) and 0 <= version < MAX_INT


def check_version(version: Any) -> int:
    if not valid_version(version):
        raise ValueError(f"version must be an integer in [0, {MAX_INT}), got {version!r}")
    return version


@dataclass(frozen=True)
class Layout:
    """Where every tensor goes in the encoding: header bytes (padded), (tensor, begin, end) in data order."""

    header: bytes
    placed: list[tuple[torch.Tensor, int, int]]

    @property
    def start(self) -> int:
        """Offset of the data section."""
        return 8 + len(self.header)

    @property
    def size(self) -> int:
        return self.start + (self.placed[-1][2] if self.placed else 0)

    @property
    def devices(self) -> set[torch.device]:
        return {t.device for t, _, _ in self.placed}


def layout(tensors: Mapping[str, torch.Tensor], version: int) -> Layout:
    """Validate ``tensors`` and place them, safetensors style (see the module docstring)."""
    check_version(version)
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
    return Layout(hb, placed)


def encode_into(lay: Layout, buf: torch.Tensor, *, non_blocking: bool = False) -> None:
    """Write the encoding of ``lay`` into ``buf`` (a 1-D uint8 CPU tensor of ``lay.size`` bytes),
    each tensor copied once, straight from its device. ``non_blocking`` copies from CUDA tensors
    are asynchronous (into pinned memory): the caller waits for them (a CUDA event) before reading."""
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != lay.size:
        raise ValueError(f"encoding buffer must be a 1-D uint8 tensor of {lay.size} bytes")
    start = lay.start
    out = memoryview(buf.numpy())
    out[:8] = struct.pack("<Q", len(lay.header))
    out[8:start] = lay.header
    with torch.no_grad():
        for t, b, e in lay.placed:
            if e <= b:
                continue
            if t.device.type == "cpu" and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
                # a plain memcpy of the bytes: several times faster than torch's typed copy here
                out[start + b:start + e] = memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())
            else:
                buf[start + b:start + e].view(t.dtype).view(t.shape).copy_(t, non_blocking=non_blocking)


def encode_tensors(tensors: Mapping[str, torch.Tensor], version: int) -> bytes:
    """Named tensors -> safetensors-compatible bytes with ``__metadata__ = {format, version}``.

    Any dtype in :data:`DTYPES` (bf16 and fp8 included), any device, contiguous
    or not. ``safetensors.torch.load`` reads the result too.
    """
    lay = layout(tensors, version)
    buf = torch.empty(lay.size, dtype=torch.uint8)
    encode_into(lay, buf)
    return buf.numpy().tobytes()


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def json_object(raw: bytes) -> dict:
    """A request's JSON object (ValueError otherwise, also for one nested too deeply to parse)."""
    try:
        req = json.loads(raw)
    except RecursionError:
        raise ValueError("request is nested too deeply") from None
    if not isinstance(req, dict):
        raise ValueError("request must be a JSON object")
    return req


def is_int(x: Any) -> bool:
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
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"header is not valid JSON: {type(e).__name__}: {e}") from None
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
        if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
            raise ValueError(f"tensor {name!r}: shape must be a list of integers >= 0, got {shape!r}")
        if not isinstance(offs, list) or len(offs) != 2 or not all(is_int(o) for o in offs):
            raise ValueError(f"tensor {name!r}: data_offsets must be [begin, end] integers, got {offs!r}")
        b, e = offs
        if not 0 <= b <= e <= data_len:
            raise ValueError(f"tensor {name!r}: data_offsets {offs} out of range (data section is {data_len} bytes)")
        want = math.prod(shape) * ITEMSIZE[dtype]
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
            if (start + b) % ITEMSIZE[dtype]:
                raw = raw.clone()  # unaligned (a foreign writer): a view would be refused
        out[name] = raw.view(dtype).view(shape)
    return version, out


# --------------------------------------------------------------------------- checksums and manifest


def chunk_crc(data: Any) -> int:
    """CRC-32C of one chunk (hardware-accelerated; releases the GIL on large buffers)."""
    return crc32c.crc32c(data)


def new_hasher(algorithm: str) -> Any:
    """A fresh whole-set hasher (``update``/``hexdigest``) for a manifest's ``hash`` name."""
    try:
        return HASHES[algorithm][0]()
    except KeyError:
        raise ValueError(f"unknown whole-set hash {algorithm!r} (known: {', '.join(HASHES)})") from None


def n_chunks(size: int, chunk_bytes: int) -> int:
    return max(1, -(-size // chunk_bytes))


@dataclass(frozen=True)
class Manifest:
    """What identifies and verifies one version: sizes, the whole-set hash, a CRC-32C per chunk."""

    version: int
    size: int
    chunk_bytes: int
    hash: str  # the whole-set hash algorithm (a key of HASHES)
    digest: str  # its hex digest of the whole encoding: also the version's identity on the wire
    crcs: tuple[int, ...]  # CRC-32C per chunk

    @property
    def n_chunks(self) -> int:
        return n_chunks(self.size, self.chunk_bytes)

    def span(self, i: int) -> tuple[int, int]:
        return i * self.chunk_bytes, min(self.size, (i + 1) * self.chunk_bytes)

    def crc_frame(self) -> bytes:
        return struct.pack(f">{len(self.crcs)}I", *self.crcs)

    def meta(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": self.version, "size": self.size, "chunk_bytes": self.chunk_bytes,
                "hash": self.hash, "digest": self.digest}

    @classmethod
    def parse(cls, hdr: dict, crc_frame: memoryview) -> Manifest:
        if hdr.get("format") != FORMAT:
            raise ValueError(f"publisher speaks {hdr.get('format')!r}, this subscriber {FORMAT!r}")
        if hdr.get("hash") not in HASHES:
            raise ValueError(f"the manifest names the whole-set hash {hdr.get('hash')!r}; "
                             f"this subscriber knows {', '.join(HASHES)}")
        try:
            crcs = struct.unpack(f">{len(crc_frame) // 4}I", crc_frame)
            m = cls(int(hdr["version"]), int(hdr["size"]), int(hdr["chunk_bytes"]), str(hdr["hash"]),
                    str(hdr["digest"]), crcs)
        except (KeyError, TypeError, ValueError, struct.error) as e:
            raise ValueError(f"bad manifest {hdr!r}: {e}") from None
        if (not valid_version(m.version) or m.size < 8 or m.chunk_bytes < 1 or len(crc_frame) != 4 * m.n_chunks
                or len(m.digest) != HASHES[m.hash][1]):
            raise ValueError(f"inconsistent manifest {hdr!r} with {len(crc_frame)} bytes of chunk CRCs")
        return m


def chunk_fault(m: Manifest, idx: int, hdr: dict, payload: list[Any], delta: bool = False) -> str | None:
    """Why a CHUNK reply does not hold chunk ``idx`` of ``m`` (of its delta with ``delta``) intact
    (frame, size, CRC-32C); None when it does."""
    b, e = m.span(idx)
    data = payload[0].buffer if len(payload) == 1 else None
    if data is None or hdr.get("index") != idx or hdr.get("digest") != m.digest or bool(hdr.get("delta")) != delta:
        return f"bad CHUNK frame for chunk {idx} of v{m.version}"
    if len(data) != e - b:
        return f"chunk {idx} of v{m.version} has {len(data)} bytes, expected {e - b}"
    if chunk_crc(data) != m.crcs[idx]:
        return f"chunk {idx} of v{m.version} failed its CRC-32C check"
    return None


def checksums(data: Any, chunk_bytes: int, algorithm: str = DEFAULT_HASH) -> tuple[str, tuple[int, ...]]:
    """(hex digest of the whole encoding, CRC-32C of each chunk) of a bytes-like ``data``."""
    mv = memoryview(data).cast("B")
    whole = new_hasher(algorithm)
    crcs = []
    for i in range(n_chunks(len(mv), chunk_bytes)):
        part = mv[i * chunk_bytes:(i + 1) * chunk_bytes]
        whole.update(part)
        crcs.append(chunk_crc(part))
    return whole.hexdigest(), tuple(crcs)


# --------------------------------------------------------------------------- small wire helpers


def check_port(port: Any, arg: str, *, allow_zero: bool) -> None:
    if is_int(port) and (0 if allow_zero else 1) <= port < 65536:
        return
    if port == 0:
        raise WeightsArgumentError(arg, "0 (an ephemeral port) only works where the socket is bound: "
                                        "give the publisher's actual port")
    raise WeightsArgumentError(arg, f"must be a TCP port{' (0 = ephemeral)' if allow_zero else ''}, got {port!r}")


def endpoint(host: str, port: int | str) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def dumps(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()
