"""The actors' side of the weight channel: fetch the newest complete, verified version.

:class:`WeightSubscriber` connects a SUB socket (announcements) and a DEALER (chunk requests)
to a :class:`~worldloop.common.transport.weights.publisher.WeightPublisher`; see the package docstring for
the wire protocol.

* **Verified, complete, single-version hand-over.** Every chunk is checked against its CRC-32C
  in the manifest before it is copied into place; a chunk that fails (wrong bytes, wrong
  length, wrong index, bad frame) is counted in ``worldloop_weights_rejected_chunks`` and
  requested again, up to ``max_chunk_retries`` times per chunk. The whole encoding is hashed
  with the manifest's algorithm (xxh3-128 by default; in a helper thread, in order, while later
  chunks still arrive) and must match the manifest's digest before the header is decoded and
  the tensors handed over; a mismatch (corruption the CRCs miss) fails the fetch and hands over
  nothing. Every GET names the version's digest, so a chunk of another version is never mixed
  in: when the publisher has moved on it answers with the new manifest and the subscriber
  starts over on the newest version (at most ``max_restarts`` times per ``fetch``).
* **Late joiners** ask the ROUTER (``INFO``) instead of relying on PUB, so ``fetch`` works for
  a subscriber that connected after the announcement or missed versions.
* **Memory.** Each verified chunk is copied into one preallocated buffer and the returned
  tensors are views into it (no second copy); a restart drops the partial download before
  allocating the next, so a subscriber holds at most the set its caller kept plus the one being
  fetched. ``max_bytes`` refuses a manifest larger than that before anything is allocated, and
  no peer can make a socket read a larger frame: the DEALER's ZMQ_MAXMSGSIZE is ``max_bytes`` +
  1 MiB, the SUB's 64 KiB (:data:`~worldloop.common.transport.weights.codec.CONTROL_MAX_BYTES`); libzmq
  drops a connection that announces a larger frame before reading it, and the socket reconnects.
* **Flow control.** At most ``window_bytes`` (16 MiB: 4 chunks) of requests are in flight;
  whatever got no reply within ``resend_s`` is asked again (e.g. after a publisher restart).
  Each resend that brings no reply doubles the wait before the next one (up to half of
  ``fetch_timeout_s``), and a reply sets it back to ``resend_s``: a reply slower than ``resend_s``
  (a slow link, or a publisher whose uplink many actors share) then still arrives, where a fixed
  interval would throw it away on every resend and never finish. A request the publisher had
  when it died is lost with it; when the same connection shakes hands again (a restarted
  learner on the same port) everything in flight is asked again at once, at ``resend_s``, instead
  of after a wait that may outlast the new learner's whole run.
* **Silent connections (network partitions).** A TCP connection that had data in flight when
  the network went away backs its retransmissions off exponentially (Linux: up to 120 s between
  tries), so after the link is back it can carry nothing for minutes while the kernel still
  considers it alive, and ZeroMQ queues every resend behind it. So each resend ("lazy pirate")
  closes the DEALER with linger 0 and sends on a fresh one (a new TCP connection; the
  publisher answers every request on its own, so nothing is lost by it), and the SUB socket
  pings the publisher (ZeroMQ heartbeats): when no answer comes within
  ``_HEARTBEAT_TIMEOUT_MS`` ZeroMQ drops the connection and reconnects, so announcements come
  again. A connect that gets no answer is abandoned after ``_CONNECT_TIMEOUT_MS`` and tried
  afresh (rather than waiting out the kernel's SYN back-off).
* **Delta versions.** A subscriber keeps the encoding of the last version it verified and names
  its digest when it asks for the current version (``INFO {have}``). When the publisher holds the
  new version as a delta from exactly that one (:mod:`.delta`), the manifest offers it: the
  subscriber fetches the delta's chunks (each checked against its CRC-32C), rebuilds the encoding
  from its base, and checks the whole-set hash of the result against the new version's digest, so
  the weights it hands over equal the learner's bit for bit. A delta that is truncated, corrupt or
  for another base is refused with a log line (``worldloop_weights_delta_refused``) and the full
  snapshot is fetched instead; nothing is ever handed over from a delta that failed. A subscriber
  that missed a version, or starts fresh, gets the full snapshot.
* **Timeouts.** ``fetch`` raises :class:`WeightsTimeout` when the publisher gives no answer for
  ``fetch_timeout_s`` (a progress timeout); the message says whether the TCP connection was
  never made, the CURVE handshake failed or the publisher is connected but silent, from the
  socket's monitor events.

One subscriber belongs to one thread.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from worldloop.common.metrics import metric
from worldloop.common.transport.weights.codec import (
    CONTROL_MAX_BYTES,
    FORMAT,
    TOPIC,
    Manifest,
    WeightsArgumentError,
    WeightsError,
    WeightsTimeout,
    check_port,
    chunk_fault,
    decode_tensors,
    dumps,
    endpoint,
    is_int,
    new_hasher,
    reply_max_bytes,
    valid_version,
)
from worldloop.common.transport.weights.delta import DeltaError, apply_delta, parse_offer
from worldloop.common.transport.weights.keys import client_keys, from_config

log = logging.getLogger(__name__)

_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_MONITOR_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | _HANDSHAKE_FAILED
# SUB: a PING every 2 s; a connection that brings nothing (no PONG, no announcement) for 10 s is
# dropped and made again. Not on the DEALER: a PONG waits behind a chunk that is being received, so a
# slow link would drop healthy connections; the DEALER is renewed on each resend instead.
_HEARTBEAT_IVL_MS = 2_000
_HEARTBEAT_TIMEOUT_MS = 10_000
_CONNECT_TIMEOUT_MS = 5_000  # both: a TCP connect unanswered this long is abandoned and tried again


class _Moved:
    """The publisher serves another version now (``manifest``; None: nothing)."""

    def __init__(self, manifest: Manifest | None):
        self.manifest = manifest


class WeightSubscriber:
    """Fetches the newest complete, verified version from a :class:`WeightPublisher`."""

    def __init__(self, host: str, pub_port: int, fetch_port: int, *, fetch_timeout_s: float = 30,
                 curve_server_public_key_file: str | os.PathLike | None = None,
                 curve_client_key_file: str | os.PathLike | None = None,
                 window_bytes: int = 16 << 20, max_chunk_retries: int = 5, max_restarts: int = 20,
                 resend_s: float | None = None, max_bytes: int | None = None, deltas: bool = True):
        if not fetch_timeout_s > 0:
            raise ValueError(f"fetch_timeout_s must be > 0, got {fetch_timeout_s!r}")
        if max_bytes is not None and max_bytes < 8:
            raise WeightsArgumentError("max_bytes", f"must be >= 8 bytes or None, got {max_bytes!r}")
        self.max_bytes = max_bytes
        check_port(pub_port, "pub_port", allow_zero=False)
        check_port(fetch_port, "fetch_port", allow_zero=False)
        self.fetch_timeout_s = float(fetch_timeout_s)
        self.resend_s = resend_s if resend_s is not None else max(0.5, min(10.0, self.fetch_timeout_s / 3))
        self.window_bytes = window_bytes
        self.max_chunk_retries = max_chunk_retries
        self.max_restarts = max_restarts
        self.endpoint = endpoint(host, fetch_port)
        self.stats = {"fetches": 0, "restarts": 0, "rejected_chunks": 0, "resent_requests": 0, "reconnects": 0,
                      "delta_fetches": 0, "delta_refused": 0}
        self.deltas = deltas
        self._base: tuple[str, np.ndarray] | None = None  # (digest, encoding) of the last verified version
        self._offer: tuple[str, str, Manifest] | None = None  # (version digest, base digest, delta manifest)
        server_key, client = client_keys(curve_server_public_key_file, curve_client_key_file)
        self.curve = server_key is not None
        self._keys = (server_key, client)
        self._ctx = zmq.Context()
        self._n_dealers = self._n_subs = 0
        self._link = "no TCP connection was made (is the learner up, are host and fetch_port right?)"
        self._sub_addr = endpoint(host, pub_port)
        try:
            self._open_sub()
            self._open_dealer()
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        self._announced: int | None = None
        self._rid = 0
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="weights-hash")
        self._m_version = metric("worldloop_weights_version")
        self._m_seconds = metric("worldloop_weights_fetch_seconds")
        self._m_rejected = metric("worldloop_weights_rejected_chunks")
        self._m_fetched = metric("worldloop_weights_fetched_bytes")
        self._m_refused = metric("worldloop_weights_delta_refused")

    def _socket(self, kind: int, server_key: bytes | None, client: tuple[bytes, bytes | None] | None) -> zmq.Socket:
        s = self._ctx.socket(kind)
        s.linger = 0
        s.setsockopt(zmq.CONNECT_TIMEOUT, _CONNECT_TIMEOUT_MS)
        if server_key is not None and client is not None:
            s.curve_serverkey = server_key
            s.curve_publickey, s.curve_secretkey = client
        return s

    def _connected(self, kind: int, events: int, name: str, addr: str) -> tuple[zmq.Socket, zmq.Socket]:
        """A socket of ``kind`` (this subscriber's keys, :meth:`_sockopts` set before connecting)
        connected to ``addr``, and its monitor of ``events``; on failure nothing stays open."""
        sock = self._socket(kind, *self._keys)
        try:
            self._sockopts(kind, sock)
            monitor = sock.get_monitor_socket(events, addr=f"inproc://worldloop-weights-{name}-{id(self)}")
            try:
                sock.connect(addr)
            except zmq.ZMQError as e:
                raise ValueError(f"cannot connect to the weight publisher at {addr}: {e}") from None
        except BaseException:
            sock.close(linger=0)
            raise
        return sock, monitor

    def _sockopts(self, kind: int, sock: zmq.Socket) -> None:
        """Options set before connecting. SUB: announcements (small) and heartbeats; DEALER: replies of
        at most max_bytes + headroom (ZMQ_MAXMSGSIZE, see codec.CONTROL_MAX_BYTES)."""
        if kind == zmq.SUB:
            sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
            sock.setsockopt(zmq.MAXMSGSIZE, CONTROL_MAX_BYTES)
            sock.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
        else:
            sock.setsockopt(zmq.MAXMSGSIZE, reply_max_bytes(self.max_bytes))

    def _open_sub(self) -> None:
        """The SUB for announcements, with a monitor of its disconnects: libzmq does not reconnect a
        connection that it dropped for a protocol error (a frame over ZMQ_MAXMSGSIZE), so
        :meth:`latest_announced` opens a fresh SUB after any disconnect."""
        self._n_subs += 1
        self._sub, self._sub_monitor = self._connected(zmq.SUB, zmq.EVENT_DISCONNECTED, f"sub-{self._n_subs}",
                                                       self._sub_addr)

    def _close_sub(self) -> None:
        self._sub.disable_monitor()
        self._sub_monitor.close(linger=0)
        self._sub.close(linger=0)

    def _open_dealer(self) -> None:
        """A fresh DEALER (a new TCP connection) with its monitor, polled by ``_reply``."""
        self._n_dealers += 1
        self._dealer, self._monitor = self._connected(zmq.DEALER, _MONITOR_EVENTS, f"monitor-{self._n_dealers}",
                                                      self.endpoint)
        self._handshakes = 0  # on this DEALER; a second one means the publisher came back
        self._peer_back = False
        self._poller = zmq.Poller()
        self._poller.register(self._dealer, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)

    def _close_dealer(self) -> None:
        self._dealer.disable_monitor()
        self._monitor.close(linger=0)
        self._dealer.close(linger=0)

    def _backoff(self, wait: float) -> float:
        """The wait before the next resend after one that got no reply (see Flow control)."""
        return min(2.0 * wait, max(self.resend_s, self.fetch_timeout_s / 2))

    def _resend_due(self, since_send: float, wait: float) -> tuple[bool, float]:
        """(resend now?, the wait after it): after ``wait`` without a reply (then the wait grows), or
        at once when the publisher came back on this connection (then it starts over)."""
        if self._peer_back:
            self._peer_back = False
            log.info("weights: the publisher at %s came back; asking again for what was in flight", self.endpoint)
            return True, self.resend_s
        if since_send > wait:
            return True, self._backoff(wait)
        return False, wait

    def _reconnect(self) -> None:
        """Lazy pirate: drop the DEALER whose requests got no answer, with whatever its TCP connection
        still holds (after a partition it may stay silent for minutes), and continue on a fresh one."""
        self._drain_monitor()
        self._close_dealer()
        self._open_dealer()
        self.stats["reconnects"] += 1
        if not self._link.startswith(("the handshake failed", "no TCP connection")):
            self._link = ("the connection went silent and a fresh one has not reached the publisher "
                          "(a network partition, or the learner is gone?)")

    # ---- announcements

    def latest_announced(self) -> int | None:
        """The version of the newest announcement received so far (non-blocking), None if none."""
        while True:
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                if self._sub_monitor.poll(0):  # dropped: a fresh SUB (see _open_sub)
                    log.info("weights: the announcement connection to %s dropped; connecting again", self._sub_addr)
                    self._close_sub()
                    self._open_sub()
                return self._announced
            try:
                msg = json.loads(frames[1])
                if msg.get("format") == FORMAT and valid_version(msg.get("version")):
                    self._announced = msg["version"]
            except (IndexError, ValueError, AttributeError, RecursionError):  # RecursionError: nested too deep
                log.debug("weights: ignored a malformed announcement")

    # ---- fetching

    def fetch(self, min_version: int = 0) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest complete, verified version newer than ``min_version``, or None.

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
        version, tensors, received = got
        elapsed = time.perf_counter() - t0
        self._m_version.set(version)
        self._m_seconds.observe(elapsed)
        log.info("fetched weights v%d: %.1f MB%s in %.2f s", version, manifest.size / 1e6,
                 f" as a {received / 1e6:.2f} MB delta" if received < manifest.size else "", elapsed)
        return version, tensors

    def _send(self, cmd: bytes, req: dict) -> int:
        """Send a request without ever blocking; one that cannot go out now counts as lost (resent later)."""
        self._rid += 1
        try:
            # a DEALER without a live connection (e.g. refused by the publisher's ZAP) would block forever
            self._dealer.send_multipart([b"", cmd, dumps({"rid": self._rid, **req})], zmq.NOBLOCK)
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
            if not isinstance(hdr, dict) or not is_int(hdr.get("rid")):
                raise ValueError("no request id")
        except (ValueError, RecursionError) as e:  # RecursionError: a header nested too deep
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
                self._handshakes += 1
                if self._handshakes > 1:  # reconnected: what was in flight died with the old publisher
                    self._peer_back = True
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

    def _ask_manifest(self) -> Manifest | None:
        self._drain_monitor()
        self._peer_back = False  # a reconnect before this request lost nothing of it
        info = {"have": self._base[0]} if self.deltas and self._base is not None else {}
        rid = self._send(b"INFO", info)
        last_progress = last_send = time.monotonic()
        wait = self.resend_s
        while True:
            reply = self._reply(0.1)
            now = time.monotonic()
            if reply is None:
                if now - last_progress > self.fetch_timeout_s:
                    raise self._timeout("asking for the current version")
                resend, wait = self._resend_due(now - last_send, wait)
                if resend:
                    self._reconnect()
                    rid, last_send = self._send(b"INFO", info), now
                    self.stats["resent_requests"] += 1
                continue
            got_rid, kind, hdr, payload = reply
            if got_rid != rid:
                continue  # a late reply to an earlier request
            return self._manifest_from(kind, hdr, payload)

    def _manifest_from(self, kind: bytes, hdr: dict, payload: list[zmq.Frame]) -> Manifest | None:
        if kind == b"NONE":
            return None
        if kind == b"ERROR":
            raise WeightsError(f"the publisher refused the request: {hdr.get('error')}")
        if kind != b"MANIFEST" or len(payload) not in (1, 2) or (len(payload) == 2) != ("delta" in hdr):
            raise WeightsError(f"unexpected {kind[:32]!r} reply to a version request")
        try:
            m = Manifest.parse(hdr, payload[0].buffer)
            self._offer = (m.digest, *parse_offer(hdr["delta"], payload[1].buffer, m)) if len(payload) == 2 else None
        except ValueError as e:
            raise WeightsError(str(e)) from None
        if self.max_bytes is not None and m.size > self.max_bytes:
            raise WeightsError(f"the publisher offers v{m.version} of {m.size:,} bytes, more than this subscriber's "
                               f"max_bytes {self.max_bytes:,} (weights.max_bytes); nothing was allocated")
        return m

    def _download(self, m: Manifest) -> tuple[int, dict[str, torch.Tensor], int] | _Moved:
        """Fetch, verify and decode version ``m`` (as a delta when one from the held version is
        offered); (version, tensors, bytes received), or _Moved when the publisher serves another one now."""
        offer, base = self._offer, self._base
        if offer is not None and base is not None and offer[0] == m.digest and offer[1] == base[0]:
            got = self._download_delta(m, base[1], offer[2])
            if got is not None:
                return got
        arr = self._download_full(m)
        return arr if isinstance(arr, _Moved) else (*self._decode(m, arr), m.size)

    def _download_delta(self, m: Manifest, base: np.ndarray,
                        dm: Manifest) -> tuple[int, dict[str, torch.Tensor], int] | _Moved | None:
        """Version ``m`` rebuilt from ``base`` and its delta (``dm``); None when the delta is refused."""
        data = np.empty(dm.size, dtype=np.uint8)
        moved = self._receive_chunks(dm, data, None, delta=True)
        if moved is not None:
            return moved
        self._m_fetched.labels(kind="delta").inc(dm.size)
        whole = new_hasher(m.hash)
        try:
            arr = apply_delta(base, data, hasher=whole)  # the hash is fed as the blocks are rebuilt
        except DeltaError as e:
            return self._refuse_delta(m, str(e))
        if whole.hexdigest() != m.digest:
            return self._refuse_delta(m, f"the rebuilt encoding does not match the manifest's {m.hash} digest")
        self.stats["delta_fetches"] += 1
        return (*self._decode(m, arr), dm.size)

    def _refuse_delta(self, m: Manifest, why: str) -> None:
        self.stats["delta_refused"] += 1
        self._m_refused.inc()
        self._base = None
        log.warning("weights: refused the delta for v%d (%s); fetching the full snapshot", m.version, why)
        return None

    def _download_full(self, m: Manifest) -> np.ndarray | _Moved:
        arr = np.empty(m.size, dtype=np.uint8)
        whole = new_hasher(m.hash)
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
        self._m_fetched.labels(kind="full").inc(m.size)
        if whole.hexdigest() != m.digest:
            self._reject(f"v{m.version}: every chunk passed its CRC-32C but the whole encoding fails its {m.hash}")
            raise WeightsError(f"v{m.version}: every chunk passed its CRC-32C but the whole encoding does not match the "
                               f"manifest {m.hash} digest (corrupted in a way the chunk CRCs miss); nothing was "
                               f"handed over, fetch again")
        return arr

    def _decode(self, m: Manifest, arr: np.ndarray) -> tuple[int, dict[str, torch.Tensor]]:
        """The tensors of a verified encoding (views into ``arr``, kept as the base of the next delta)."""
        try:
            version, tensors = decode_tensors(arr)
        except ValueError as e:
            raise WeightsError(f"v{m.version} passed its checksums but does not decode: {e}") from None
        if version != m.version:
            raise WeightsError(f"the manifest says v{m.version} but the encoding says v{version}")
        self._base = (m.digest, arr) if self.deltas else None
        return version, tensors

    def _receive_chunks(self, m: Manifest, arr: np.ndarray, feed: Any, delta: bool = False) -> _Moved | None:
        """Fill ``arr`` with verified chunks (of the delta with ``delta``), ``feed`` them in order to the
        hasher thread (no ``feed``: no hashing) and wait for it."""
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
        wait = self.resend_s
        while remaining:
            while todo and len(inflight) < window:
                idx = todo.popleft()
                get = {"digest": m.digest, "index": idx, **({"delta": True} if delta else {})}
                inflight[self._send(b"GET", get)] = idx
                last_send = time.monotonic()
            reply = self._reply(0.1)
            now = time.monotonic()
            if reply is None:
                if now - last_progress > self.fetch_timeout_s:
                    raise self._timeout(f"fetching v{m.version} ({n - remaining}/{n} chunks done)")
                resend, new_wait = self._resend_due(now - last_send, wait) if inflight else (False, wait)
                if resend:  # lost requests/replies: ask again, afresh
                    self._reconnect()
                    self.stats["resent_requests"] += len(inflight)
                    todo.extendleft(sorted(inflight.values(), reverse=True))
                    inflight.clear()
                    wait = new_wait
                continue
            rid, kind, hdr, payload = reply
            idx = inflight.pop(rid, None)
            if idx is None:
                continue  # a late reply to an earlier request or fetch
            last_progress = now
            wait = self.resend_s
            if kind != b"CHUNK":
                return _Moved(self._manifest_from(kind, hdr, payload))
            reason = chunk_fault(m, idx, hdr, payload, delta)
            if reason is None:
                b, e = m.span(idx)
                arr[b:e] = np.frombuffer(payload[0].buffer, dtype=np.uint8)
                done[idx] = 1
                remaining -= 1
                while feed is not None and hashed < n and done[hashed]:
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
        self._close_dealer()
        self._close_sub()
        self._ctx.term()

    def __enter__(self) -> WeightSubscriber:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# --------------------------------------------------------------------------- from the config


def default_max_bytes(model_dir: str | os.PathLike | None) -> int:
    """The largest weight set an actor of ``model_dir`` accepts by default: 4x the bytes of its weight
    files (``*.safetensors``, ``*.bin``; a float32 set for a bfloat16 checkpoint, with room to spare)
    + 64 MiB. No directory (a ``model.path`` not resolved yet) counts as no weight files."""
    files = [] if model_dir is None else [p for pattern in ("*.safetensors", "*.bin") for p in Path(model_dir).glob(pattern)]
    on_disk = sum(p.stat().st_size for p in files)
    return 4 * on_disk + (64 << 20)


def subscriber_from_config(cfg: Any) -> WeightSubscriber:
    """An actor's subscriber from ``cfg.weights`` (host, ports, timeout, CURVE server public + client
    secret, size cap: ``weights.max_bytes`` or :func:`default_max_bytes` of ``model.path``)."""
    w = cfg.weights
    max_bytes = w.max_bytes or default_max_bytes(cfg.model.path)
    return from_config(WeightSubscriber, host=w.host, pub_port=w.pub_port, fetch_port=w.fetch_port,
                       fetch_timeout_s=w.fetch_timeout_s, curve_server_public_key_file=w.curve_server_public,
                       curve_client_key_file=w.curve_client_secret, max_bytes=max_bytes, deltas=w.delta)


__all__ = ["WeightSubscriber", "default_max_bytes", "subscriber_from_config"]
