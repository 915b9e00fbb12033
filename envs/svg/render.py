"""Safe SVG handling for the SVG reconstruction env: extraction, validation, bounded rendering.

Untrusted SVG (the agent's answer, or a file of a local dataset) goes through two gates:

1. :func:`validate_svg` (in process, linear time): at most ``max_bytes`` characters; no DTD,
   entity, element/attlist declaration or processing instruction; parsed by ``defusedxml`` (entities
   and external references forbidden); root element ``svg``; at most ``max_elements`` elements and
   ``max_depth`` nesting; none of ``script``, ``foreignObject``, ``image``, ``iframe``, ``object``,
   ``embed``, ``audio``, ``video``, ``feImage``, animation elements; no ``on*`` event attributes; every
   ``href`` a local ``#fragment``; every ``url(...)`` a local ``url(#...)``; no ``@import`` or
   ``javascript:``; every number in an attribute within ±1e6 (huge ``width``/``height``/``viewBox``
   are refused); at most 64 ``<use>`` elements, each pointing at an existing element that is not
   itself a ``use``/``svg`` nor contains one (no reference blow-up); no dash pattern finer than 0.01.
   Violations raise :class:`SVGRejected` with the reason.
2. :func:`render_svg` rasterises with cairosvg in a separate worker process
   (:mod:`worldloop.envs.svg.worker`: ``unsafe=False``, a URL fetcher that refuses everything, 1 GiB address-space
   limit) and kills it when a render exceeds ``timeout_s`` (default 3 s); the next render starts a new
   worker. Failures raise :class:`SVGRenderError`. The worker is shared by all envs of a process
   (one render at a time, guarded by a lock) and restarted after a fork.

Public API::

    extract_svg(text) -> str | None              # first "<svg" .. last "</svg>", O(n)
    validate_svg(svg, max_bytes=65536, max_elements=2000, max_depth=24) -> ET.Element
    render_svg(svg, size, timeout_s=3.0) -> np.ndarray uint8 [size, size, 3] (white background)
    shutdown_worker()

What a validated drawing shows, in words (``describe_svg``, ``element_sentence``, ``color_name``), is
:mod:`worldloop.envs.svg.describe`.
"""

from __future__ import annotations

import atexit
import math
import os
import re
import select
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from xml.etree import ElementTree as ET

import numpy as np

try:  # a dependency of cairosvg
    from defusedxml import ElementTree as _SAFE_ET
except ImportError:  # pragma: no cover - declarations are refused before parsing anyway
    _SAFE_ET = None

MAX_BYTES = 65536
MAX_ELEMENTS = 2000
MAX_DEPTH = 24
MAX_USE = 64
MAX_NUMBER = 1e6
MIN_DASH = 0.01
DEFAULT_TIMEOUT_S = 3.0
WORKER_SCRIPT = Path(__file__).with_name("worker.py")
START_TIMEOUT_S = 60.0  # a fresh worker's imports (cairosvg, PIL, numpy): not counted against a render

_FORBIDDEN_TAGS = {"script", "foreignobject", "image", "iframe", "object", "embed", "audio", "video",
                   "feimage", "animate", "animatemotion", "animatetransform", "animatecolor", "set",
                   "handler", "listener", "discard"}
_DECL_RE = re.compile(r"<!\s*(doctype|entity|element|attlist|notation)|<\?", re.IGNORECASE)
_URL_RE = re.compile(r"url\s*\(\s*(['\"]?)\s*([^)'\"]*)", re.IGNORECASE)
_NUM_RE = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_HEX_RE = re.compile(r"#[0-9a-fA-F]+\b")
_BAD_TEXT_RE = re.compile(r"@import|javascript\s*:|expression\s*\(", re.IGNORECASE)


class SVGRejected(ValueError):
    """The SVG failed validation (the message says why)."""


class SVGRenderError(RuntimeError):
    """The SVG could not be rendered (error in the renderer, or the time limit was hit)."""


# ----------------------------------------------------------------------------- extraction


def extract_svg(text: str) -> str | None:
    """The span from the first ``<svg`` to the last ``</svg>`` (linear time), or None."""
    if not isinstance(text, str):
        return None
    start = text.find("<svg")
    if start < 0:
        return None
    end = text.rfind("</svg>")
    if end < start:
        return None
    return text[start:end + len("</svg>")]


# ----------------------------------------------------------------------------- validation


def _local(name: str) -> str:
    return name.rsplit("}", 1)[-1].rsplit(":", 1)[-1].lower()


def validate_svg(svg: str, max_bytes: int = MAX_BYTES, max_elements: int = MAX_ELEMENTS,
                 max_depth: int = MAX_DEPTH) -> ET.Element:
    """Check untrusted SVG code against the rules of the module docstring; returns the parsed root."""
    root = _parse_untrusted(svg, max_bytes)
    ids: dict[str, ET.Element] = {}
    uses: list[tuple[ET.Element, str]] = []
    count = 0
    stack = [(root, 1)]
    while stack:
        el, depth = stack.pop()
        count += 1
        if count > max_elements:
            raise SVGRejected(f"more than {max_elements} elements")
        if depth > max_depth:
            raise SVGRejected(f"elements nested deeper than {max_depth}")
        tag = _local(el.tag) if isinstance(el.tag, str) else ""
        if tag in _FORBIDDEN_TAGS:
            raise SVGRejected(f"<{tag}> elements are not allowed")
        _check_attributes(el, ids)
        if el.text:
            _check_urls(el.text)
            if tag == "style" and "dasharray" in el.text:
                _check_dashes(el.text)
        if tag == "use":
            href = next((v for k, v in el.attrib.items() if _local(k) == "href"), "")
            uses.append((el, href.strip()[1:]))
            if len(uses) > MAX_USE:
                raise SVGRejected(f"more than {MAX_USE} <use> elements")
        for child in el:
            stack.append((child, depth + 1))
    _check_uses(uses, ids)
    _check_root_size(root)
    return root


def _parse_untrusted(svg: str, max_bytes: int) -> ET.Element:
    """The text-level checks (size, declarations, @import / javascript:), then a parse with entities
    and external references forbidden; the root must be ``<svg>``."""
    if not isinstance(svg, str):
        raise SVGRejected("SVG code must be text")
    if len(svg) > max_bytes:
        raise SVGRejected(f"SVG code has {len(svg)} characters, more than {max_bytes}")
    if _DECL_RE.search(svg):
        raise SVGRejected("DTD/entity declarations and processing instructions are not allowed")
    if _BAD_TEXT_RE.search(svg):
        raise SVGRejected("@import, javascript: and expression() are not allowed")
    try:
        if _SAFE_ET is not None:
            root = _SAFE_ET.fromstring(svg, forbid_dtd=True, forbid_entities=True, forbid_external=True)
        else:  # pragma: no cover
            root = ET.fromstring(svg)
    except Exception as e:  # ParseError, defusedxml's DTDForbidden/EntitiesForbidden, ...
        raise SVGRejected(f"not well-formed XML: {type(e).__name__}: {str(e)[:120]}") from None
    if _local(root.tag) != "svg":
        raise SVGRejected(f"root element is <{_local(root.tag)}>, not <svg>")
    return root


def _check_attributes(el: ET.Element, ids: dict[str, ET.Element]) -> None:
    """One element's attributes: no event handlers, only local references, numbers within ±MAX_NUMBER,
    no too-fine dashes; records its ``id`` in ``ids``."""
    for name, value in el.attrib.items():
        lname = _local(name)
        if lname.startswith("on"):
            raise SVGRejected(f"event attribute {lname!r} is not allowed")
        if lname == "href" and not value.strip().startswith("#"):
            raise SVGRejected("only local references (href=\"#id\") are allowed")
        _check_urls(value)
        if lname in ("id", "class", "font-family"):
            if lname == "id":
                ids[value] = el
            continue
        for tok in _NUM_RE.findall(_HEX_RE.sub(" ", value)):
            try:
                v = float(tok)
            except ValueError:  # pragma: no cover - the regex only yields numbers
                continue
            if not math.isfinite(v) or abs(v) > MAX_NUMBER:
                raise SVGRejected(f"number {tok[:20]} in {lname!r} is out of range (|x| <= {MAX_NUMBER:g})")
        if lname == "stroke-dasharray" or (lname == "style" and "dasharray" in value):
            _check_dashes(value)


def _check_uses(uses: list[tuple[ET.Element, str]], ids: dict[str, ET.Element]) -> None:
    """Every ``<use>`` points at an existing element that neither is nor contains a use/svg."""
    for _, ref in uses:
        target = ids.get(ref)
        if target is None:
            raise SVGRejected(f"<use> refers to a missing element #{ref[:40]}")
        if any(isinstance(e.tag, str) and _local(e.tag) in ("use", "svg") for e in target.iter()):
            raise SVGRejected("<use> may not refer to an element that is or contains <use>/<svg>")


def _check_urls(value: str) -> None:
    for m in _URL_RE.finditer(value):
        if not m.group(2).strip().startswith("#"):
            raise SVGRejected("only local url(#id) references are allowed")


def _check_dashes(value: str) -> None:
    m = re.search(r"dasharray\s*:\s*([^;]*)", value)
    text = m.group(1) if m else value
    for tok in _NUM_RE.findall(text):
        v = abs(float(tok))
        if 0 < v < MIN_DASH:
            raise SVGRejected(f"dash pattern finer than {MIN_DASH} is not allowed")


def _check_root_size(root: ET.Element) -> None:
    vb = root.attrib.get("viewBox")
    if vb is not None:
        nums = [float(t) for t in _NUM_RE.findall(vb)]
        if len(nums) != 4 or nums[2] <= 0 or nums[3] <= 0:
            raise SVGRejected(f"invalid viewBox {vb[:60]!r}")
    for key in ("width", "height"):
        v = root.attrib.get(key)
        if v is None or v.strip().endswith("%"):
            continue
        nums = _NUM_RE.findall(v)
        if nums and float(nums[0]) > 10000:
            raise SVGRejected(f"{key}={v[:20]!r} is too large (<= 10000)")


# ----------------------------------------------------------------------------- rendering


class _Worker:
    """One cairosvg worker process, started on demand and killed on timeout."""

    def __init__(self, script: Path = WORKER_SCRIPT) -> None:
        self.script = script
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.pid_owner = os.getpid()

    def _start(self) -> None:
        """A new worker, once it has said it is ready (its imports can take seconds on a loaded machine)."""
        self.proc = subprocess.Popen([sys.executable, "-u", str(self.script)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True)
        hello = self._read(1, time.monotonic() + START_TIMEOUT_S,
                           f"the render worker did not start within {START_TIMEOUT_S:g} s")
        if hello != b"K":
            self.stop()
            raise SVGRenderError("the render worker sent no greeting")

    def _read(self, n: int, deadline: float, late: str) -> bytes:
        """Exactly ``n`` bytes from the worker by ``deadline`` (``time.monotonic()``); on a timeout or its
        death it is stopped."""
        fd = self.proc.stdout.fileno()
        buf = bytearray()
        while len(buf) < n:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([fd], [], [], max(left, 0.0))  # bytes already there are read, even late
            if not ready:
                if left <= 0:
                    self.stop()
                    raise SVGRenderError(late)
                continue
            chunk = os.read(fd, n - len(buf))
            if not chunk:
                self.stop()
                raise SVGRenderError("the render worker died (out of memory or crashed)")
            buf += chunk
        return bytes(buf)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and self.pid_owner == os.getpid():
            try:
                proc.kill()
                proc.wait(timeout=5)
            except Exception:  # pragma: no cover - already gone
                pass
            for f in (proc.stdin, proc.stdout):
                try:
                    f.close()
                except Exception:  # pragma: no cover
                    pass

    def render(self, data: bytes, side: int, timeout_s: float) -> np.ndarray:
        with self.lock:
            if self.pid_owner != os.getpid():  # forked: the parent's worker is not ours
                self.proc, self.pid_owner = None, os.getpid()
            for attempt in range(2):
                if self.proc is None or self.proc.poll() is not None:
                    self.stop()
                    self._start()
                try:
                    self.proc.stdin.write(b"R" + struct.pack("!II", side, len(data)) + data)
                    self.proc.stdin.flush()
                except (BrokenPipeError, OSError):
                    self.stop()
                    if attempt:
                        raise SVGRenderError("the render worker died") from None
                    continue
                return self._reply(side, timeout_s)
            raise SVGRenderError("the render worker died")  # pragma: no cover

    def _reply(self, side: int, timeout_s: float) -> np.ndarray:
        deadline = time.monotonic() + timeout_s
        late = f"rendering took longer than {timeout_s:g} s"
        status, n = struct.unpack("!BI", self._read(5, deadline, late))
        payload = self._read(n, deadline, late)
        if status != 0:
            raise SVGRenderError(payload.decode("utf-8", "replace"))
        if n != side * side * 3:
            self.stop()
            raise SVGRenderError("the render worker replied with a wrong image size")
        return np.frombuffer(payload, dtype=np.uint8).reshape(side, side, 3).copy()


_WORKER = _Worker()
atexit.register(_WORKER.stop)


def render_svg(svg: str, size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> np.ndarray:
    """Rasterise (already validated) SVG code to ``size`` x ``size`` RGB on white, within ``timeout_s``."""
    return _WORKER.render(svg.encode("utf-8"), int(size), float(timeout_s))


def shutdown_worker() -> None:
    """Stop the shared render worker (a later render starts a new one)."""
    with _WORKER.lock:
        _WORKER.stop()
