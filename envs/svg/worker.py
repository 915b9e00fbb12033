"""Render worker for SVG code (run as a subprocess by :mod:`worldloop.envs.svg.render`; never imported by it).

Protocol on stdin/stdout, raw bytes only (no pickle): a request is ``b"R"`` + ``!II`` (side in
pixels, byte length) + that many bytes of UTF-8 SVG; the reply is ``!BI`` (status, byte length) +
payload: status 0 -> ``side * side * 3`` bytes of RGB (the drawing composited on white), status 1 ->
a UTF-8 error message. ``b"Q"`` (or end of input) stops the worker. Once its imports are done the
worker writes one byte, ``b"K"``, so that the parent's time limit counts rendering, not start-up.

The worker runs cairosvg with ``unsafe=False`` and a URL fetcher that refuses everything, under an
address-space limit; the parent enforces the time limit by killing it.
"""

from __future__ import annotations

import io
import struct
import sys

_MEMORY_LIMIT = 1 << 30  # 1 GiB of address space


def _deny(url, resource_type=None):  # cairosvg url_fetcher: no file, network or data access
    raise ValueError(f"external resource refused: {str(url)[:80]}")


def _limit_memory() -> None:
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = _MEMORY_LIMIT if hard == resource.RLIM_INFINITY else min(_MEMORY_LIMIT, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, ValueError, OSError):  # pragma: no cover - platform without rlimits
        pass


def _read_exact(stream, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = stream.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def main() -> int:
    from cairosvg.surface import PNGSurface
    import numpy as np
    from PIL import Image

    _limit_memory()
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    out.write(b"K")
    out.flush()
    while True:
        op = inp.read(1)
        if not op or op == b"Q":
            return 0
        head = _read_exact(inp, 8)
        if head is None:
            return 0
        side, n = struct.unpack("!II", head)
        data = _read_exact(inp, n)
        if data is None:
            return 0
        try:
            png = PNGSurface.convert(bytestring=data, output_width=side, output_height=side, unsafe=False,
                                     url_fetcher=_deny)
            img = Image.open(io.BytesIO(png))
            img.load()
            rgba = img.convert("RGBA")
            if rgba.size != (side, side):
                rgba = rgba.resize((side, side))
            arr = np.asarray(rgba, dtype=np.float32)
            alpha = arr[..., 3:4] / 255.0
            rgb = arr[..., :3] * alpha + 255.0 * (1.0 - alpha)
            payload = np.clip(np.rint(rgb), 0, 255).astype(np.uint8).tobytes()
            status = 0
        except MemoryError:
            payload, status = b"out of memory while rendering", 1
        except Exception as e:  # any cairosvg/PIL failure is reported, never fatal
            payload, status = f"{type(e).__name__}: {e}"[:500].encode("utf-8", "replace"), 1
        out.write(struct.pack("!BI", status, len(payload)) + payload)
        out.flush()


if __name__ == "__main__":
    sys.exit(main())
