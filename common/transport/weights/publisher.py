"""The learner's side of the weight channel: hand a version over, serve it behind the caller.

:meth:`WeightPublisher.publish` is a **hand-over**: it validates the tensors, copies them once
into an encoding buffer (from CUDA: an asynchronous copy into pinned memory, ordered on the
caller's stream, so the caller does not wait for it) and returns. Everything else happens in
the ``weights-prepare`` thread behind the caller: waiting for that copy, the CRC-32C of every
chunk and the whole-set hash, the zero-copy frames, and then serving from the ROUTER thread.

Buffers (double-buffered, never more than two encodings):

* the one being **served** and the one being **prepared** (handed over, not served yet);
* a hand-over while the other buffer is still *pending* (handed over, preparation not started)
  replaces that older version in its buffer (``worldloop_weights_superseded_versions``);
* a hand-over while the other buffer is being *prepared* waits for it (this wait is part of
  the blocked time: a learner that publishes faster than a version can be checksummed);
* an ``owned=True`` hand-over (tensors the caller never changes again, e.g. the CPU copies a
  ZeRO-3 gather makes) copies nothing in the caller's thread and never waits: the prepare
  thread copies it when it gets to it, and a newer hand-over replaces it until then;
* when a newer version is served, the old buffer is reused for the next hand-over as soon as
  ZeroMQ has released every frame that pointed into it (chunks still queued for a slow peer);
  if that takes longer than ``retire_timeout_s`` the buffer is left to be freed when ZeroMQ is
  done, and the next hand-over allocates a fresh one.

The time a caller spent inside ``publish`` goes to ``worldloop_weights_publish_blocked_seconds``
(and :attr:`WeightPublisher.last_blocked_s`); the learner's blocked fraction of step time is
that over its step time. ``worldloop_weights_prepare_seconds`` is the time from hand-over to
serving.

Consistency for subscribers: once ``publish(v)`` has returned, a fetch that starts asks for the
current version (``INFO``) and gets ``v`` or newer: while a newer hand-over is being prepared,
the ROUTER holds ``INFO`` answers back until it is served. Subscribers already fetching an
older version go on receiving it until the newer one is served; then their next request is
answered with the new manifest and they start over on it (never a mix of two versions).

Serving many subscribers: the encoding is cut once into chunks, each wrapped once in a
zero-copy ``zmq.Frame``; every reply sends a reference to that frame (libzmq shares the data,
no per-subscriber copy or re-encoding). One ROUTER thread serves any number of subscribers.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import zmq

from worldloop.common.metrics import ephemeral_range, metric
from worldloop.common.transport.weights.codec import (
    CONTROL_MAX_BYTES,
    DEFAULT_HASH,
    FORMAT,
    HASHES,
    TOPIC,
    Layout,
    Manifest,
    WeightsError,
    check_port,
    check_version,
    chunk_crc,
    dumps,
    encode_into,
    endpoint,
    is_int,
    json_object,
    layout,
    n_chunks,
    new_hasher,
)
from worldloop.common.transport.weights.buffers import EncodingBuffer
from worldloop.common.transport.weights.delta import DeltaOffer, make_offer
from worldloop.common.transport.weights.keys import from_config, server_keys

log = logging.getLogger(__name__)


@dataclass
class _Job:
    """A handed-over version: its encoding is (being) copied into ``buf``; ``events`` mark the copy's end.
    An owned hand-over has no buffer yet: ``lay`` holds the caller's tensors until the prepare thread
    copies them."""

    version: int
    buf: EncodingBuffer | None
    events: list[Any]
    n_tensors: int
    handed_at: float
    lay: Layout | None = None
    size: int = 0


@dataclass
class _Served:
    manifest: Manifest
    buf: EncodingBuffer
    frames: list[zmq.Frame] = field(default_factory=list)  # one zero-copy frame per chunk
    delta: DeltaOffer | None = None  # this version as a delta from the one served before it


# A client that reconnects to a port of the ephemeral range on its own host while nothing listens
# there can be handed that very port as its source and connect to itself (TCP simultaneous open; a
# DEALER to itself even completes the ZeroMQ handshake and stays): a learner restarted meanwhile then
# cannot bind it. Ports below the range are never handed out as sources.
SELF_CONNECT = ("a subscriber reconnecting while the learner was down can hold such a port, connected to itself; "
                "use ports below the range, as worldloop up does")


class WeightPublisher:
    """Announces versions on PUB and serves the newest one in chunks from a ROUTER thread."""

    def __init__(self, bind: str = "127.0.0.1", pub_port: int = 0, fetch_port: int = 0, *,
                 chunk_bytes: int = 4 << 20, curve_secret_key_file: str | os.PathLike | None = None,
                 curve_authorized_clients: str | os.PathLike | None = None,
                 announce_interval_s: float = 1.0, io_threads: int | None = None, hash_algorithm: str = DEFAULT_HASH,
                 retire_timeout_s: float = 2.0, delta: bool = True, delta_level: int = 1,
                 delta_max_ratio: float = 0.5):
        if not is_int(chunk_bytes) or chunk_bytes < 1024:
            raise ValueError(f"chunk_bytes must be an integer >= 1024, got {chunk_bytes!r}")
        if announce_interval_s <= 0:
            raise ValueError(f"announce_interval_s must be > 0, got {announce_interval_s!r}")
        if hash_algorithm not in HASHES:
            raise ValueError(f"hash_algorithm must be one of {', '.join(HASHES)}, got {hash_algorithm!r}")
        check_port(pub_port, "pub_port", allow_zero=True)
        check_port(fetch_port, "fetch_port", allow_zero=True)
        self.chunk_bytes = chunk_bytes
        self.announce_interval_s = announce_interval_s
        self.hash_algorithm = hash_algorithm
        self.retire_timeout_s = retire_timeout_s
        # delta versions (delta.py): each version also as its changed bytes against the one before, for
        # subscribers that hold that one
        self.delta, self.delta_level, self.delta_max_ratio = delta, delta_level, delta_max_ratio
        self.last_blocked_s = 0.0  # seconds the last publish call blocked its caller
        self._current: _Served | None = None  # read by the ROUTER thread under _serve_lock
        self._serve_lock = threading.Lock()  # held while a request reads the current version
        self._publish_lock = threading.Lock()  # serializes publish calls
        self._cond = threading.Condition()  # guards the hand-over state below
        self._pending: _Job | None = None  # handed over, preparation not started
        self._preparing = False  # the prepare thread works on a job
        self._spare: EncodingBuffer | None = None  # a buffer no frame points into any more
        self._handed: int | None = None  # the newest version handed over (pending, preparing or served)
        self._handed_size: int | None = None
        self._failure: BaseException | None = None  # a preparation that failed, raised by the next call
        self._closed = False
        self._auth = None
        # ZeroMQ I/O threads do the socket writes: one per subscriber connection up to 4 (or the cores)
        self._ctx = zmq.Context(io_threads or max(1, min(4, os.cpu_count() or 1)))
        self._sockets: list[zmq.Socket] = []
        self._wake_lock = threading.Lock()
        self._open_sockets(bind, pub_port, fetch_port, curve_secret_key_file, curve_authorized_clients)
        self._m_versions = metric("worldloop_weights_published_versions")
        self._m_bytes = metric("worldloop_weights_published_bytes")
        self._m_served = metric("worldloop_weights_served_chunks")
        self._m_version = metric("worldloop_weights_version")
        self._m_blocked = metric("worldloop_weights_publish_blocked_seconds")
        self._m_prepare = metric("worldloop_weights_prepare_seconds")
        self._m_superseded = metric("worldloop_weights_superseded_versions")
        self._m_delta = metric("worldloop_weights_delta_bytes")
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="weights-hash")
        self._waiting: list[tuple[list[bytes], Any, Any]] = []  # INFO requests held back (ROUTER thread only)
        self._thread = threading.Thread(target=self._serve, name="weights-router", daemon=True)
        self._thread.start()
        self._preparer = threading.Thread(target=self._prepare_loop, name="weights-prepare", daemon=True)
        self._preparer.start()
        log.info("weights publisher: PUB %s, ROUTER %s%s", endpoint(bind, self.pub_port),
                 endpoint(bind, self.fetch_port), " (CURVE)" if self.curve else "")

    def _open_sockets(self, bind: str, pub_port: int, fetch_port: int, curve_secret_key_file: str | os.PathLike | None,
                      curve_authorized_clients: str | os.PathLike | None) -> None:
        """Bind PUB and ROUTER (CURVE when a secret key is given) and the inproc wake-up pair; on any
        failure close what was opened and raise."""
        try:
            keys, self._auth = server_keys(self._ctx, curve_secret_key_file, curve_authorized_clients)
            self._pub = self._socket(zmq.PUB, keys)
            self._router = self._socket(zmq.ROUTER, keys)
            for s in (self._pub, self._router):  # both read from the network: subscriptions, requests
                s.setsockopt(zmq.MAXMSGSIZE, CONTROL_MAX_BYTES)
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
        addr = endpoint(host, port if port else "*")
        low, high = ephemeral_range()
        in_range = bool(port) and low <= port <= high
        if in_range:
            log.warning("weights.%s %d is in this host's ephemeral range %d-%d: %s", arg, port, low, high, SELF_CONNECT)
        try:
            sock.bind(addr)
        except zmq.ZMQError as e:
            hint = f" ({SELF_CONNECT})" if in_range and e.errno == zmq.EADDRINUSE else ""
            raise WeightsError(f"cannot bind the weights {arg} socket on {addr}: {e}{hint}") from None
        return int(sock.last_endpoint.decode().rsplit(":", 1)[1])

    @property
    def version(self) -> int | None:
        """The newest version handed over (None before the first publish): a fetch that starts now gets it
        or a newer one (it may still be being prepared; :attr:`served_version` is the one served now)."""
        return self._handed

    @property
    def served_version(self) -> int | None:
        cur = self._current
        return cur.manifest.version if cur else None

    @property
    def nbytes(self) -> int | None:
        """Size of the encoding of :attr:`version` (None before the first publish)."""
        return self._handed_size

    _reserved: EncodingBuffer | None = None  # reserve()'s second buffer, taken once the first version is served

    def reserve(self, tensors: Mapping[str, torch.Tensor]) -> int:
        """Allocate and touch both encoding buffers for tensors like ``tensors`` (pinned for CUDA ones:
        cudaHostAlloc took 6 s for a 3B model, issue 30) before the first :meth:`publish`, so that no
        hand-over waits for one; returns one buffer's bytes. Nothing is copied."""
        lay = layout(tensors, 0)
        pinned = any(d.type == "cuda" for d in lay.devices) and torch.cuda.is_available()
        capacity = lay.size + 256  # room for headers that grow with the version number
        bufs = [EncodingBuffer.alloc(lay.size, pinned, capacity, touch=True) for _ in range(2)]
        with self._cond:
            if self._handed is not None:
                raise WeightsError("reserve() must come before the first publish")
            self._spare, self._reserved = bufs
        return capacity

    # ---- the hand-over (caller's thread)

    def publish(self, tensors: Mapping[str, torch.Tensor], version: int, *, owned: bool = False,
                wait: bool = False, timeout: float | None = None) -> float:
        """Hand ``tensors`` (any device/dtype) over as ``version``; return the seconds the caller was blocked.

        ``version`` must be newer than the last one handed over. Returns once the tensors are copied
        (from CUDA: once the copy is queued on the caller's current stream, so later work on that
        stream cannot change them first): the caller may change them right after. Checksums and
        serving happen behind it; ``wait=True`` (or :meth:`flush`) waits until the version is served.
        A preparation that failed in the background is raised here, by the next call.

        ``owned=True``: the caller hands the tensors themselves over and never changes them again
        (e.g. fresh CPU copies gathered under ZeRO-3): nothing is copied here, the prepare thread
        copies them when it gets to them, and the call never waits for a buffer; a newer hand-over
        replaces one whose preparation has not started (its tensors are dropped).
        """
        t0 = time.perf_counter()
        check_version(version)
        lay = layout(tensors, version)  # validation errors are the caller's, raised here
        with self._publish_lock:
            with self._cond:
                self._raise_failure()
                if self._closed:
                    raise WeightsError("the publisher is closed")
                if self._handed is not None and version <= self._handed:
                    raise ValueError(f"version {version} is not newer than the published version {self._handed}")
                while self._preparing and not owned and not self._closed:  # both buffers taken: wait
                    self._cond.wait()
                if self._closed:
                    raise WeightsError("the publisher is closed")
                buf = None
                if self._pending is not None:  # not started yet: the newer version replaces it (in its buffer)
                    log.info("weights: v%d replaces v%d before its preparation started", version, self._pending.version)
                    buf, self._pending = self._pending.buf, None
                    self._m_superseded.inc()
                if owned and buf is not None:
                    self._spare, buf = self._spare or buf, None
                elif not owned and buf is None and self._spare is not None:
                    buf, self._spare = self._spare, None
            try:
                job = (_Job(version, None, [], len(tensors), t0, lay=lay, size=lay.size) if owned
                       else self._copy(lay, buf, version, len(tensors), t0))
            except BaseException:
                self._forget_unserved()  # a replaced pending version is gone too: back to what is served
                raise
            with self._cond:
                self._pending = job
                self._handed, self._handed_size = version, lay.size
                self._cond.notify_all()
        blocked = time.perf_counter() - t0
        self.last_blocked_s = blocked
        self._m_blocked.observe(blocked)
        if wait:
            self.flush(timeout)
        return blocked

    def _copy(self, lay: Layout, buf: EncodingBuffer | None, version: int, n_tensors: int, t0: float) -> _Job:
        cuda = sorted({d for d in lay.devices if d.type == "cuda"}, key=str)
        pinned = bool(cuda) and torch.cuda.is_available()
        fits = buf is not None and buf.capacity >= lay.size and buf.pinned == pinned
        buf = buf.sized(lay.size) if fits else EncodingBuffer.alloc(lay.size, pinned)
        try:
            encode_into(lay, buf.tensor, non_blocking=pinned)
        except BaseException:
            with self._cond:
                self._spare = self._spare or buf
            raise
        events = []
        for dev in cuda if pinned else ():
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(dev))
            events.append(ev)
        return _Job(version, buf, events, n_tensors, t0, size=lay.size)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every version handed over is served; False on timeout. Raises a failed preparation."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while (self._pending is not None or self._preparing) and not self._closed:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            self._raise_failure()
            return True

    def _forget_unserved(self) -> None:
        """After a failed hand-over or preparation: the newest version is the served one again, and
        INFO requests held back for the lost one are answered."""
        with self._cond:
            cur, pending = self._current, self._pending
            if pending is not None:  # a newer hand-over that came meanwhile is still on its way
                self._handed, self._handed_size = pending.version, pending.size
            else:
                self._handed = cur.manifest.version if cur else None
                self._handed_size = cur.manifest.size if cur else None
        self._wakeup(b"failed")

    def _raise_failure(self) -> None:
        failure, self._failure = self._failure, None
        if failure is not None:
            raise WeightsError(f"preparing an earlier weight version failed: {failure}") from failure

    # ---- behind the caller: the prepare thread

    def _prepare_loop(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job, self._pending = self._pending, None
                self._preparing = True
            old = spare = None
            try:
                served = self._prepare(job)
                with self._serve_lock:  # after this no request reads the old version
                    old, self._current = self._current, served
                self._wakeup(b"announce")
                self._m_versions.inc()
                self._m_bytes.inc(served.manifest.size)
                self._m_version.set(job.version)
                took = time.perf_counter() - job.handed_at
                self._m_prepare.observe(took)
                log.info("published weights v%d: %d tensors, %.1f MB, %d chunks, served %.2f s after the hand-over",
                         job.version, job.n_tensors, served.manifest.size / 1e6, served.manifest.n_chunks, took)
                if old is not None:
                    spare = self._retire(old)
                elif self._spare is None:  # the first version: make the second buffer now (or take reserve()'s)
                    spare, self._reserved = self._reserved or job.buf.fresh_like(), None
            except Exception as e:  # report it to the next publish/flush; subscribers keep the served version
                log.exception("weights: preparing v%d failed", job.version)
                spare = job.buf
                with self._cond:
                    self._failure = e
                self._forget_unserved()
            finally:
                with self._cond:
                    self._preparing = False
                    if spare is not None and self._spare is None:
                        self._spare = spare
                    self._cond.notify_all()

    def _prepare(self, job: _Job) -> _Served:
        if job.buf is None:  # an owned hand-over: copy the caller's tensors now
            with self._cond:
                buf, self._spare = self._spare, None
            buf = buf.sized(job.lay.size) if buf is not None and buf.capacity >= job.lay.size else EncodingBuffer.alloc(job.lay.size, False)
            job.buf = buf
            encode_into(job.lay, buf.tensor)
            job.lay = None  # the caller's tensors are no longer needed
        for ev in job.events:  # the device -> host copy, queued by the caller
            ev.synchronize()
        mv = memoryview(job.buf.arr)
        size, cb = len(mv), self.chunk_bytes
        spans = [(i * cb, min(size, (i + 1) * cb)) for i in range(n_chunks(size, cb))]
        whole = new_hasher(self.hash_algorithm)

        def hash_all() -> str:
            for b, e in spans:
                whole.update(mv[b:e])
            return whole.hexdigest()

        digest = self._hasher.submit(hash_all)  # both passes release the GIL: they run side by side
        crcs = tuple(chunk_crc(mv[b:e]) for b, e in spans)
        manifest = Manifest(job.version, size, cb, self.hash_algorithm, digest.result(), crcs)
        frames = [zmq.Frame(mv[b:e], copy=False, track=True) for b, e in spans]
        return _Served(manifest, job.buf, frames, self._delta_from_served(job, manifest))

    def _delta_from_served(self, job: _Job, manifest: Manifest) -> DeltaOffer | None:
        """``job``'s version as a delta from the version served now (its buffer is still intact: it is
        reused only after the new version is served), or None (off, nothing served, another layout)."""
        prev = self._current
        if not self.delta or prev is None or prev.manifest.size != manifest.size:
            return None
        offer = make_offer(prev.manifest.digest, prev.buf.arr, job.buf.arr, manifest, level=self.delta_level,
                           max_ratio=self.delta_max_ratio)
        if offer is not None:
            self._m_delta.inc(offer.manifest.size)
            log.info("weights: v%d as a delta from v%d: %.2f MB (%.2f %% of the snapshot)", manifest.version,
                     prev.manifest.version, offer.manifest.size / 1e6, 100 * offer.manifest.size / manifest.size)
        return offer

    def _retire(self, old: _Served) -> EncodingBuffer | None:
        """Drop ``old``'s frames; its buffer once ZeroMQ holds no frame of it any more (None: not in time)."""
        trackers = [f.tracker for f in old.frames]
        old.frames.clear()
        deadline = time.monotonic() + self.retire_timeout_s
        while not all(t.done for t in trackers):
            if time.monotonic() > deadline:
                log.info("weights: chunks of v%d are still queued for a slow subscriber; its buffer is "
                         "released later and the next version gets a fresh one", old.manifest.version)
                return None
            time.sleep(0.002)
        return old.buf

    def _wakeup(self, what: bytes) -> None:
        with self._wake_lock:
            try:
                self._wake.send(what, zmq.NOBLOCK)
            except (zmq.Again, zmq.ZMQError):  # already queued, or closing
                pass

    # ---- the ROUTER thread (owns PUB, ROUTER and the wake socket's reading end)

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
                    while True:
                        try:
                            what = self._wake_in.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if what == b"stop":
                            return
                    next_announce = 0.0
                    self._answer_waiting()
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
            msg = {"format": FORMAT, "version": m.version, "hash": m.hash, "digest": m.digest, "size": m.size}
            self._pub.send_multipart([TOPIC, dumps(msg)], zmq.NOBLOCK)

    def _newer_coming(self, cur: _Served | None) -> bool:
        handed = self._handed
        return handed is not None and (cur is None or handed > cur.manifest.version)

    def _answer_waiting(self) -> None:
        with self._serve_lock:
            cur = self._current
            if self._newer_coming(cur):
                return
            waiting, self._waiting = self._waiting, []
            for envelope, rid, have in waiting:
                self._send_manifest(envelope, rid, cur, have)

    def _send_manifest(self, envelope: list[bytes], rid: Any, cur: _Served | None, have: Any = None) -> None:
        """NONE, or the MANIFEST of ``cur``; with its delta offer too when the asker holds (``have``) its base."""
        if cur is None:
            self._router.send_multipart(envelope + [b"NONE", dumps({"rid": rid})])
            return
        m, d = cur.manifest, cur.delta
        if d is not None and have == d.base:
            head = dumps({"rid": rid, **m.meta(), "delta": d.meta()})
            self._router.send_multipart(envelope + [b"MANIFEST", head, m.crc_frame(), d.manifest.crc_frame()])
        else:
            self._router.send_multipart(envelope + [b"MANIFEST", dumps({"rid": rid, **m.meta()}), m.crc_frame()])

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
            req = json_object(body[1])
            rid = req.get("rid")
            cmd = body[0]
            if cmd not in (b"INFO", b"GET"):
                raise ValueError(f"unknown command {cmd[:32]!r}")
        except ValueError as e:
            self._router.send_multipart(envelope + [b"ERROR", dumps({"rid": rid, "error": str(e)})])
            return
        cur = self._current
        if cmd == b"GET" and cur is not None and req.get("digest") == cur.manifest.digest:
            want_delta = req.get("delta") is True and cur.delta is not None
            m, frames = (cur.delta.manifest, cur.delta.frames) if want_delta else (cur.manifest, cur.frames)
            idx = req.get("index")
            if not is_int(idx) or not 0 <= idx < m.n_chunks:
                self._router.send_multipart(envelope + [b"ERROR", dumps({"rid": rid, "error": f"bad chunk index {idx!r}"})])
                return
            head = dumps({"rid": rid, "digest": m.digest, "index": idx, **({"delta": True} if want_delta else {})})
            # the chunk's frame is shared, not copied: libzmq sends a reference to the same data
            self._router.send_multipart(envelope + [b"CHUNK", head, frames[idx]], copy=False)
            self._m_served.inc()
            return
        if self._newer_coming(cur):  # a newer version is being prepared: answer when it is served
            if len(self._waiting) < 100_000:
                self._waiting.append((envelope, rid, req.get("have")))
            return
        # INFO, or a GET for a version no longer served: the current manifest (or NONE)
        self._send_manifest(envelope, rid, cur, req.get("have") if cmd == b"INFO" else None)

    # ---- lifecycle

    def close(self) -> None:
        with self._publish_lock, self._cond:
            if self._closed:
                return
            self._closed = True
            if self._pending is not None:
                log.info("weights: closing with v%d handed over but never served", self._pending.version)
            self._cond.notify_all()
        self._wakeup(b"stop")
        self._preparer.join(timeout=30)
        self._thread.join(timeout=10)
        self._hasher.shutdown(wait=True)
        self._teardown()

    def _teardown(self) -> None:
        for s in self._sockets:
            s.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._current = self._spare = self._pending = None
        self._ctx.term()

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def publisher_from_config(cfg: Any) -> WeightPublisher:
    """The learner's publisher from ``cfg.weights`` (bind, ports, chunk size, CURVE server + allowed clients)."""
    w = cfg.weights
    return from_config(WeightPublisher, bind=w.bind, pub_port=w.pub_port, fetch_port=w.fetch_port,
                       chunk_bytes=w.chunk_bytes, delta=w.delta, curve_secret_key_file=w.curve_server_secret,
                       curve_authorized_clients=w.curve_client_public)


__all__ = ["WeightPublisher", "publisher_from_config"]
