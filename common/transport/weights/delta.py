"""Delta versions: the bytes that changed between two encodings of one layout, sparse and compressed.

A policy step at RL learning rates changes few bytes of a bf16 weight set: most weights round to
the same bf16 value, and the ones that move change their low mantissa bits (1-3 % of the bytes per
step at lr 1e-6). So a version is sent as the positions and XOR values of its changed bytes against
the version before it, zstd-compressed: a few percent of the snapshot (``bench/weights.py``,
docs/benchmarks.md "Weight versions: full snapshots and deltas (`bench/weights.py`)").

The delta is one zstd frame holding, for each block of ``BLOCK`` bytes of the encoding in order:
``u32 count`` of changed bytes, ``count`` u32 gaps (the first from the block's start, then from the
previous change: their running sum gives the positions) and ``count`` XOR bytes, after a 12-byte
header of ``u32 BLOCK, u64`` the encoding's size. Everything is little-endian.

* :func:`encode_delta` (publisher): block by block (memory bounded by a block, never a second copy
  of the model); ``None`` when the two encodings differ in size (another layout: only a full
  snapshot can carry it) or the delta would not be smaller than ``max_ratio`` of the snapshot.
* :func:`apply_delta` (subscriber): the new encoding from the base it already holds, into a fresh
  buffer (the base is never written: tensors handed out earlier may still point into it),
  streaming the delta a few blocks at a time on threads and feeding the caller's whole-set hasher
  as the blocks are rebuilt. A truncated or corrupt delta raises :class:`DeltaError`; one that
  decodes but was applied to the wrong base, or was altered on the way in a way zstd's own
  checksum misses, is caught by that hash, which must equal the new version's digest.

Why sparse positions and not ``zstd(base XOR new)`` whole: the XOR is as large as the model, so
rebuilding from it decompresses the full size (70-100 ms for 14 MB here) where the sparse form
decompresses only the changes (12 ms) and is also smaller (2.4 % against 3.1-3.4 % of the
snapshot, on the same real AdamW step; measured 2026-11-28 while choosing).
"""

from __future__ import annotations

import struct
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq
import zstandard

from worldloop.common.transport.weights.codec import Manifest, chunk_crc, n_chunks

BLOCK = 16 << 20  # bytes of the encoding per block of the delta (positions within a block fit a u32)
WINDOW = 4  # blocks decoded or rebuilt ahead of the hash in apply_delta (bounds its memory)


class DeltaError(ValueError):
    """A delta that cannot be applied (truncated, corrupt, or for another size)."""


def encode_delta(base: memoryview | np.ndarray, new: memoryview | np.ndarray, *, level: int = 1,
                 max_ratio: float = 0.5) -> bytes | None:
    """The sparse delta from ``base`` to ``new`` (module docstring), or None (other size, or not smaller than ``max_ratio``)."""
    a = np.frombuffer(base, dtype=np.uint8)
    b = np.frombuffer(new, dtype=np.uint8)
    if len(a) != len(b) or len(b) == 0:
        return None
    limit = int(len(b) * max_ratio)
    comp = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=False).compressobj()
    parts = [comp.compress(struct.pack("<IQ", BLOCK, len(b)))]
    size = len(parts[0])
    scratch = np.empty(min(BLOCK, len(b)), dtype=np.uint8)
    for start in range(0, len(b), BLOCK):
        end = min(len(b), start + BLOCK)
        x = scratch[: end - start]
        np.bitwise_xor(a[start:end], b[start:end], out=x)
        where = np.flatnonzero(x)
        gaps = np.diff(where, prepend=0).astype("<u4")
        for piece in (struct.pack("<I", len(where)), gaps.tobytes(), x[where].tobytes()):
            part = comp.compress(piece)
            parts.append(part)
            size += len(part)
        if size > limit:
            return None
    parts.append(comp.flush())
    out = b"".join(parts)
    return out if len(out) <= limit else None


def apply_delta(base: np.ndarray | memoryview, delta: bytes | memoryview, *, hasher: Any = None) -> np.ndarray:
    """The encoding that :func:`encode_delta` took from ``base`` to, in a new array (``base`` untouched).

    With ``hasher`` (a whole-set hasher, ``codec.new_hasher``) the rebuilt bytes are also fed to it in
    order, so the caller's check of the new version's digest needs no second pass over the model.

    The work is pipelined block by block on four threads, at most :data:`WINDOW` blocks ahead: one
    decompresses the blocks' changes in order, two rebuild blocks (copy of the base, then the changes
    applied), and one feeds the rebuilt blocks to ``hasher`` in order. zstd, numpy's copies and
    xxhash release the GIL, so they overlap (``bench/weights.py``: the "apply s" columns)."""
    base = np.frombuffer(base, dtype=np.uint8)
    n = len(base)
    out = np.empty(n, dtype=np.uint8)
    view = memoryview(out)
    decoder, builders, hashing = (ThreadPoolExecutor(k, thread_name_prefix=f"delta-{name}")
                                  for k, name in ((1, "decode"), (2, "build"), (1, "hash")))
    try:
        with zstandard.ZstdDecompressor().stream_reader(memoryview(delta), read_across_frames=False) as reader:
            try:
                block, total = struct.unpack("<IQ", _read(reader, 12, "the header"))
                if block < 1:
                    raise DeltaError(f"the delta names a block of {block} bytes")
                if total != n:
                    raise DeltaError(f"the delta is for an encoding of {total:,} bytes, the base has {n:,}")
                spans = [(start, min(n, start + block)) for start in range(0, n, block)]
                built: list[Future] = []

                def queue(k: int) -> None:  # decode (in order, one thread) and rebuild block k
                    changes = decoder.submit(_read_block, reader, k, spans[k][1] - spans[k][0])
                    built.append(builders.submit(_rebuild, out, base, *spans[k], changes))

                for k in range(min(WINDOW, len(spans))):
                    queue(k)
                hashed: Future | None = None
                for k, (start, end) in enumerate(spans):
                    built[k].result()
                    if k + WINDOW < len(spans):
                        queue(k + WINDOW)
                    if hasher is not None:
                        if hashed is not None:
                            hashed.result()
                        hashed = hashing.submit(hasher.update, view[start:end])
                if hashed is not None:
                    hashed.result()
            finally:  # nothing left running on the reader once it closes (a failure cancels what is queued)
                for pool in (decoder, builders, hashing):
                    pool.shutdown(wait=True, cancel_futures=True)
            if reader.read(1):
                raise DeltaError(f"the delta holds more than the base's {n:,} bytes")
    except zstandard.ZstdError as e:
        raise DeltaError(f"the delta does not decompress: {e}") from None
    return out


def _rebuild(out: np.ndarray, base: np.ndarray, start: int, end: int, changes: Future) -> None:
    """``out[start:end]``: the base's bytes with the block's changes (``changes``: :func:`_read_block`'s future)."""
    where, values = changes.result()
    dst = out[start:end]
    np.copyto(dst, base[start:end])
    dst[where] ^= values


def _read_block(reader: Any, index: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions within the block, XOR bytes) of block ``index`` (``size`` bytes of the encoding)."""
    (count,) = struct.unpack("<I", _read(reader, 4, f"block {index}"))
    if count > size:
        raise DeltaError(f"block {index} claims {count:,} changes in {size:,} bytes")
    # running sums in intp (numpy's index type: the scatter needs no conversion); gaps are >= 0, so the last is the largest
    where = np.cumsum(np.frombuffer(_read(reader, 4 * count, "positions"), dtype="<u4"), dtype=np.intp)
    values = np.frombuffer(_read(reader, count, "values"), dtype=np.uint8)
    if count and int(where[-1]) >= size:
        raise DeltaError(f"block {index} has a change past its end")
    return where, values


def _read(reader: Any, size: int, what: str) -> np.ndarray:
    """Exactly ``size`` bytes of the stream (a new uint8 array), or DeltaError (truncated)."""
    buf = np.empty(size, dtype=np.uint8)  # not zero-filled: every byte is read into
    view, got = memoryview(buf), 0
    while got < size:
        k = reader.readinto(view[got:])
        if not k:
            raise DeltaError(f"the delta is truncated in {what} ({got:,} of {size:,} bytes)")
        got += k
    return buf


# --------------------------------------------------------------------------- on the wire


@dataclass
class DeltaOffer:
    """The delta of a served version from the version served before it (publisher side).

    ``manifest`` describes the delta's bytes as the channel sends them: its ``size``, chunks and a
    CRC-32C per chunk, and the **new version's** ``version``, ``hash`` and ``digest``, since the
    whole-set hash is checked on the encoding the delta rebuilds, not on the delta."""

    base: str  # digest of the version the delta applies to
    manifest: Manifest
    data: bytes
    frames: list = field(default_factory=list)

    def meta(self) -> dict[str, Any]:
        return {"base": self.base, "size": self.manifest.size}


def make_offer(base_digest: str, base: np.ndarray, new: np.ndarray, new_manifest: Manifest, *,
               level: int = 1, max_ratio: float = 0.5) -> DeltaOffer | None:
    """The delta from ``base`` to ``new`` cut into ``new_manifest``'s chunk size, or None (see :func:`encode_delta`)."""
    data = encode_delta(base, new, level=level, max_ratio=max_ratio)
    if data is None:
        return None
    cb = new_manifest.chunk_bytes
    spans = [(i * cb, min(len(data), (i + 1) * cb)) for i in range(n_chunks(len(data), cb))]
    mv = memoryview(data)
    crcs = tuple(chunk_crc(mv[b:e]) for b, e in spans)
    m = Manifest(new_manifest.version, len(data), cb, new_manifest.hash, new_manifest.digest, crcs)
    return DeltaOffer(base_digest, m, data, [zmq.Frame(mv[b:e], copy=False) for b, e in spans])


def parse_offer(meta: Any, crc_frame: memoryview, new_manifest: Manifest) -> tuple[str, Manifest]:
    """(base digest, the delta's manifest) from a MANIFEST reply's ``delta`` field; ValueError when malformed."""
    if not isinstance(meta, dict):
        raise ValueError(f"bad delta offer {meta!r}")
    try:
        base, size = str(meta["base"]), int(meta["size"])
        crcs = struct.unpack(f">{len(crc_frame) // 4}I", crc_frame)
    except (KeyError, TypeError, ValueError, struct.error) as e:
        raise ValueError(f"bad delta offer {meta!r}: {e}") from None
    m = Manifest(new_manifest.version, size, new_manifest.chunk_bytes, new_manifest.hash, new_manifest.digest, crcs)
    if size < 1 or len(crc_frame) != 4 * m.n_chunks:
        raise ValueError(f"inconsistent delta offer {meta!r} with {len(crc_frame)} bytes of chunk CRCs")
    return base, m


__all__ = ["BLOCK", "DeltaError", "DeltaOffer", "apply_delta", "encode_delta", "make_offer", "parse_offer"]
