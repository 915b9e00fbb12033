"""The ZeroMQ weight channel over real sockets on loopback: delivery, late joiners, no mixed
versions, publishing behind the caller, corrupted and lost chunks through a real ZeroMQ hop, the
whole-set hash the manifest names, CURVE, the safetensors-style codec."""

from __future__ import annotations

import contextlib
import json
import select
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

import crc32c
import pytest
import safetensors.torch
import torch
import zmq
import zmq.auth
from prometheus_client import REGISTRY

from worldloop.common.contracts.config import ConfigError, config_from_dict
from worldloop.common.metrics import free_port, unassigned_port
from worldloop.common.transport.weights import (
    DTYPES,
    WeightPublisher,
    WeightsError,
    WeightSubscriber,
    WeightsTimeout,
    decode_tensors,
    encode_tensors,
    publisher_from_config,
    subscriber_from_config,
)

from procs import returns_within, wait_for

HOST = "127.0.0.1"


def weight_set(version: int, scale: int = 1 << 20) -> dict[str, torch.Tensor]:
    """A deterministic set of mixed dtypes, about 25*scale bytes (scale=4 MiB: ~100 MiB); differs per version."""
    g = torch.Generator().manual_seed(1000 + version)
    return {
        "model.embed.weight": torch.randn(scale * 5 // 4, 4, generator=g),  # f32, 20*scale bytes
        "model.layers.0.mlp.weight": torch.randn(scale, 2, generator=g).to(torch.bfloat16),  # 4*scale
        "model.layers.0.norm.weight": torch.randn(scale // 4, generator=g).to(torch.float16),
        "model.layers.0.bias": torch.randint(-(2**40), 2**40, (scale // 16,), generator=g),  # int64
        "model.mask": torch.rand(scale // 8, generator=g) > 0.5,  # bool
        "model.step": torch.tensor(version, dtype=torch.int32),  # 0-dim
    }


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape, k
        # compare the raw bytes: exact, and NaN-safe
        assert torch.equal(g.contiguous().reshape(-1).view(torch.uint8), w.contiguous().reshape(-1).view(torch.uint8)), k


def counter(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


class Tap:
    """A real ZeroMQ hop between subscriber and publisher (ROUTER in front, DEALER behind).

    Requests pass unchanged; each CHUNK reply goes through ``on_chunk(n, header, frames)``
    (n counts CHUNK replies from 0), which returns the frames to forward or None to drop them;
    MANIFEST replies through ``on_manifest(frames)`` the same way.
    """

    def __init__(self, fetch_port: int, on_chunk: Callable[[int, dict, list[bytes]], list[bytes] | None],
                 on_manifest: Callable[[list[bytes]], list[bytes]] = lambda frames: frames):
        self.on_chunk = on_chunk
        self.on_manifest = on_manifest
        self.chunks: list[tuple[str, int]] = []  # (version digest, index) of every CHUNK reply seen
        self.ctx = zmq.Context()
        self.front = self.ctx.socket(zmq.ROUTER)
        self.port = self.front.bind_to_random_port(f"tcp://{HOST}")
        self.back = self.ctx.socket(zmq.DEALER)
        self.back.connect(f"tcp://{HOST}:{fetch_port}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        poller.register(self.back, zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(50))
            if self.front in events:
                self.back.send_multipart(self.front.recv_multipart())
            if self.back in events:
                frames = self.back.recv_multipart()  # [subscriber id, b"", kind, header, payload...]
                if frames[2] == b"CHUNK":
                    hdr = json.loads(frames[3])
                    self.chunks.append((hdr["digest"], hdr["index"]))
                    frames = self.on_chunk(len(self.chunks) - 1, hdr, frames)
                elif frames[2] == b"MANIFEST":
                    frames = self.on_manifest(frames)
                if frames is not None:
                    self.front.send_multipart(frames)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.front.close(0)
        self.back.close(0)
        self.ctx.term()


def flip_byte(frames: list[bytes]) -> list[bytes]:
    data = bytearray(frames[4])
    data[len(data) // 2] ^= 0x01
    return frames[:4] + [bytes(data)]


@contextlib.contextmanager
def tapped(publisher: WeightPublisher, on_chunk: Callable, on_manifest: Callable | None = None,
           **kwargs) -> Iterator[tuple[WeightSubscriber, Tap]]:
    """A subscriber that fetches through a Tap in front of ``publisher``; both closed afterwards."""
    tap = Tap(publisher.fetch_port, on_chunk, *([on_manifest] if on_manifest else []))
    kwargs.setdefault("fetch_timeout_s", 10)
    sub = WeightSubscriber(HOST, publisher.pub_port, tap.port, **kwargs)
    try:
        yield sub, tap
    finally:
        sub.close()
        tap.close()


def assert_fetched(got: tuple[int, dict[str, torch.Tensor]] | None, version: int, want: dict[str, torch.Tensor]) -> None:
    assert got is not None and got[0] == version
    assert_same(got[1], want)


@pytest.fixture
def publisher():
    pub = WeightPublisher(HOST, chunk_bytes=256 * 1024, announce_interval_s=0.2)
    yield pub
    pub.close()


# --------------------------------------------------------------------------- delivery


def test_three_subscribers_get_versions_1_to_3_and_a_late_joiner_gets_3() -> None:
    pub = WeightPublisher(HOST, announce_interval_s=0.2)  # default 4 MiB chunks
    subs = [WeightSubscriber(HOST, pub.pub_port, pub.fetch_port, fetch_timeout_s=20) for _ in range(3)]
    late = None
    try:
        assert all(s.fetch() is None for s in subs)  # nothing published yet
        with ThreadPoolExecutor(3) as pool:
            for v in (1, 2, 3):
                want = weight_set(v, scale=4 << 20)
                assert sum(t.numel() * t.element_size() for t in want.values()) > 100e6
                pub.publish(want, v)
                results = list(pool.map(lambda s: s.fetch(min_version=v - 1), subs))  # concurrently
                for got in results:
                    assert_fetched(got, v, want)
                del results
        assert all(s.fetch(min_version=3) is None for s in subs)  # nothing newer than 3
        wait_for(lambda: subs[0].latest_announced() == 3, "the PUB announcement of v3", 60,
                 extra=lambda: f"latest announced: {subs[0].latest_announced()}")

        late = WeightSubscriber(HOST, pub.pub_port, pub.fetch_port, fetch_timeout_s=20)
        assert_fetched(late.fetch(), 3, weight_set(3, scale=4 << 20))  # asks the ROUTER: no announcement needed
        assert late.stats["rejected_chunks"] == 0 and late.stats["restarts"] == 0
    finally:
        for s in subs + ([late] if late else []):
            s.close()
        pub.close()


def test_publish_mid_fetch_restarts_on_the_new_version_never_a_mix(publisher: WeightPublisher) -> None:
    v1, v2 = weight_set(1, scale=1 << 18), weight_set(2, scale=1 << 18)  # ~6.5 MiB: 26 chunks of 256 KiB
    for k in v1:
        if v1[k].numel() > 1:
            assert not torch.equal(v1[k], v2[k]), k  # every chunk differs between versions: a mix would show
    publisher.publish(v1, 1)

    def publish_v2_at_third_chunk(n: int, hdr: dict, frames: list[bytes]) -> list[bytes]:
        if n == 2:  # v1 is mid-fetch: the subscriber has 2 chunks, asked for 2 more
            publisher.publish(v2, 2, wait=True)  # served before this chunk goes on
        return frames

    # window of 2 chunks: the subscriber cannot have asked for all of v1 before the switch
    with tapped(publisher, publish_v2_at_third_chunk, window_bytes=512 * 1024) as (sub, tap):
        assert_fetched(sub.fetch(), 2, v2)
    assert sub.stats["restarts"] == 1
    shas = [sha for sha, _ in tap.chunks]
    v1_chunks = shas.count(shas[0])
    assert 3 <= v1_chunks < 26  # part of v1 was received, then dropped
    assert len(set(shas)) == 2 and len(shas) - v1_chunks == 26  # then all of v2


def test_corrupted_chunk_is_rejected_and_fetched_again(publisher: WeightPublisher) -> None:
    want = weight_set(7, scale=1 << 18)
    publisher.publish(want, 7)
    rejected_before = counter("worldloop_weights_rejected_chunks_total")
    with tapped(publisher, lambda n, hdr, frames: flip_byte(frames) if n == 3 else frames) as (sub, tap):
        assert_fetched(sub.fetch(), 7, want)
    assert counter("worldloop_weights_rejected_chunks_total") - rejected_before == 1
    assert sub.stats["rejected_chunks"] == 1
    corrupted = tap.chunks[3][1]
    assert [i for _, i in tap.chunks].count(corrupted) == 2  # that chunk, and only it, came twice
    assert len(tap.chunks) == 26 + 1


def test_a_chunk_that_keeps_failing_gives_a_clear_error_then_a_clean_fetch_works(publisher: WeightPublisher) -> None:
    want = weight_set(3, scale=1 << 16)
    publisher.publish(want, 3)
    corrupt = [True]

    def corrupt_chunk_1(n: int, hdr: dict, frames: list[bytes]) -> list[bytes]:
        return flip_byte(frames) if corrupt[0] and hdr["index"] == 1 else frames

    with tapped(publisher, corrupt_chunk_1, max_chunk_retries=2) as (sub, _):
        with pytest.raises(WeightsError, match=r"chunk 1 of v3 failed its CRC-32C check 3 times"):
            sub.fetch()
        assert sub.stats["rejected_chunks"] == 3
        corrupt[0] = False
        assert_fetched(sub.fetch(), 3, want)


def test_a_chunk_altered_to_pass_its_crc_is_caught_by_the_whole_set_hash(publisher: WeightPublisher) -> None:
    want = weight_set(5, scale=1 << 16)
    publisher.publish(want, 5)
    cb = publisher.chunk_bytes
    chunk2 = bytearray(encode_tensors(want, 5)[2 * cb:3 * cb])  # the encoding is deterministic
    chunk2[100] ^= 0x01
    forged_crc = crc32c.crc32c(chunk2)
    tamper = [True]

    def forge_crc(frames: list[bytes]) -> list[bytes]:  # the manifest now vouches for the altered chunk
        crcs = bytearray(frames[4])
        crcs[8:12] = struct.pack(">I", forged_crc)
        return frames[:4] + [bytes(crcs)] if tamper[0] else frames

    def alter(n: int, hdr: dict, frames: list[bytes]) -> list[bytes]:
        return frames[:4] + [bytes(chunk2)] if tamper[0] and hdr["index"] == 2 else frames

    rejected_before = counter("worldloop_weights_rejected_chunks_total")
    with tapped(publisher, alter, forge_crc) as (sub, _):
        with pytest.raises(WeightsError, match="does not match the manifest xxh3_128 digest.*nothing was handed over"):
            sub.fetch()
        assert counter("worldloop_weights_rejected_chunks_total") - rejected_before == 1
        tamper[0] = False
        assert_fetched(sub.fetch(), 5, want)


def test_the_manifest_names_its_hash_and_an_unknown_one_is_refused() -> None:
    want = weight_set(2, scale=1 << 14)
    pub = WeightPublisher(HOST, chunk_bytes=64 * 1024, hash_algorithm="sha256")
    try:
        pub.publish(want, 2)
        seen: list[dict] = []

        def rename_hash(frames: list[bytes]) -> list[bytes]:
            hdr = json.loads(frames[3])
            seen.append(hdr)
            return frames[:3] + [json.dumps({**hdr, "hash": "md5"}).encode()] + frames[4:]

        with tapped(pub, lambda n, hdr, frames: frames) as (sub, _):
            assert_fetched(sub.fetch(), 2, want)  # the subscriber follows the algorithm the manifest names
        with tapped(pub, lambda n, hdr, frames: frames, rename_hash) as (sub, tap):
            with pytest.raises(WeightsError, match="names the whole-set hash 'md5'"):
                sub.fetch()
            assert tap.chunks == []
        assert seen[0]["hash"] == "sha256" and len(seen[0]["digest"]) == 64
    finally:
        pub.close()
    with pytest.raises(ValueError, match="hash_algorithm must be one of"):
        WeightPublisher(HOST, hash_algorithm="md5")


def _next_update(live: dict[str, torch.Tensor]) -> None:
    """What the learner's optimizer step does to its parameters: change them in place."""
    with torch.no_grad():
        for t in live.values():
            if t.dtype == torch.bool:
                t.logical_not_()
            else:
                t.add_(1)


def _clone(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in tensors.items()}


def test_publishing_does_not_block_the_next_update() -> None:
    """The learner hands v over and goes on: the call returns long before subscribers have v; the
    parameters change in place right after each hand-over and v+1 follows at once, while v is still
    being served. Every fetch that completes is one whole, verified version, never a mix."""
    pub = WeightPublisher(HOST, chunk_bytes=1 << 20, announce_interval_s=0.2)
    subs = [WeightSubscriber(HOST, pub.pub_port, pub.fetch_port, fetch_timeout_s=60) for _ in range(3)]
    blocked_before = counter("worldloop_weights_publish_blocked_seconds_sum")
    live = weight_set(1, scale=4 << 20)  # ~100 MiB: "the parameters"
    want: dict[int, dict[str, torch.Tensor]] = {}
    got: list[list[tuple[int, float, dict[str, torch.Tensor]]]] = [[] for _ in subs]

    def follow(i: int, until: int, have: int = 0) -> None:
        while have < until:
            res = subs[i].fetch(min_version=have)
            if res is None:
                time.sleep(0.005)
                continue
            got[i].append((res[0], time.perf_counter(), res[1]))
            have = res[0]

    # the preparation (hash, frames) of the versions in `held` waits for their gate: what happens while
    # a version is still behind the caller is then a fact of the test, not a race against the clock
    gates = {2: threading.Event(), 4: threading.Event()}
    real_prepare = pub._prepare

    def held(job):
        gate = gates.get(job.version)
        if gate is not None and not gate.wait(120):
            raise RuntimeError(f"gate of v{job.version} never opened")
        return real_prepare(job)

    pub._prepare = held
    try:
        blocked1 = pub.publish(_clone(live), 1, wait=True)  # the learner's first publish, at start-up
        # phase 1: hand over v2 and go on: the call returns while v2 cannot even be prepared yet
        want[2] = _clone(live)
        blocked2 = returns_within(lambda: pub.publish(live, 2), "publish(v2) while v2's preparation is held", 60)
        assert not gates[2].is_set()  # so the hand-over did not wait for the preparation
        assert pub.version == 2 and pub.served_version == 1  # v2 is handed over, still behind the caller
        assert pub.last_blocked_s == blocked2
        _next_update(live)  # the next update changes the parameters in place, right after the hand-over
        gates[2].set()
        with ThreadPoolExecutor(len(subs)) as pool:
            list(pool.map(lambda i: follow(i, 2), range(len(subs))))

        # phase 2: v3 is handed over and, while subscribers are fetching it, v4
        want[3] = _clone(live)
        with ThreadPoolExecutor(len(subs)) as pool:
            # each subscriber holds v2 from phase 1: it asks for anything newer (a fetch that began before
            # publish(v3) would otherwise get v2 again)
            futures = [pool.submit(follow, i, 4, 2) for i in range(len(subs))]
            blocked3 = pub.publish(live, 3)
            _next_update(live)
            want[4] = _clone(live)
            # v3 (not held) is prepared behind the caller and served: the state the next assertion is about
            wait_for(lambda: pub.served_version == 3, "v3 prepared and served", 120,
                     extra=lambda: f"version {pub.version}, served {pub.served_version}")
            blocked4 = returns_within(lambda: pub.publish(live, 4), "publish(v4) while v4's preparation is held", 60)
            assert not gates[4].is_set()  # returned without waiting for v4's preparation ...
            assert pub.served_version == 3  # ... while v3 is served and v4 waits behind the caller
            _next_update(live)
            gates[4].set()
            for f in futures:
                f.result(timeout=120)
        for g in got:
            versions = [v for v, _, _ in g]
            assert versions[0] == 2 and versions[-1] == 4 and versions == sorted(set(versions))
            for v, _, tensors in g:
                assert_same(tensors, want[v])  # a whole version, bit for bit, never a mix
        # the caller's blocked time is what the metric adds up (the learner's blocked fraction of its step)
        assert counter("worldloop_weights_publish_blocked_seconds_sum") - blocked_before == pytest.approx(
            blocked1 + blocked2 + blocked3 + blocked4)
        assert pub.last_blocked_s == blocked4
    finally:
        for s in subs:
            s.close()
        pub.close()


def test_a_preparation_that_fails_behind_the_caller_is_reported_and_nothing_waits_for_it(
        publisher: WeightPublisher, monkeypatch: pytest.MonkeyPatch) -> None:
    v1, v2, v3 = ({"w": torch.full((1000,), float(v))} for v in (1, 2, 3))
    publisher.publish(v1, 1, wait=True)

    def broken(job):  # stands for what can fail behind the caller (e.g. a CUDA error in the copy)
        raise RuntimeError("device lost")

    monkeypatch.setattr(publisher, "_prepare", broken)
    publisher.publish(v2, 2)  # the hand-over itself succeeds
    with pytest.raises(WeightsError, match="preparing an earlier weight version failed: device lost"):
        publisher.flush(timeout=10)
    assert publisher.version == 1  # v2 never became the version a fetch waits for
    with WeightSubscriber(HOST, publisher.pub_port, publisher.fetch_port, fetch_timeout_s=5) as sub:
        assert_fetched(sub.fetch(), 1, v1)
        monkeypatch.undo()
        publisher.publish(v3, 3)
        assert_fetched(sub.fetch(min_version=1), 3, v3)


def test_owned_hand_overs_never_wait_and_a_newer_one_replaces_one_not_started(
        publisher: WeightPublisher, monkeypatch: pytest.MonkeyPatch) -> None:
    sets = {v: weight_set(v, scale=1 << 18) for v in (1, 2, 3, 4)}
    publisher.publish(sets[1], 1, wait=True)
    entered, gate = threading.Event(), threading.Event()
    real = publisher._prepare

    def slow(job):  # a preparation that takes as long as the test wants
        entered.set()
        assert gate.wait(30)
        return real(job)

    monkeypatch.setattr(publisher, "_prepare", slow)
    superseded = counter("worldloop_weights_superseded_versions_total")
    publisher.publish(sets[2], 2, owned=True)
    assert entered.wait(10)  # v2 is being prepared, and stays so
    # pending behind v2, then replacing v3, which never started; neither may wait for v2's preparation
    returns_within(lambda: publisher.publish(sets[3], 3, owned=True), "an owned hand-over of v3 behind v2", 60)
    returns_within(lambda: publisher.publish(sets[4], 4, owned=True), "an owned hand-over of v4 behind v2", 60)
    assert not gate.is_set()  # both returned while v2's preparation is still held
    assert publisher.served_version == 1 and publisher.version == 4
    assert counter("worldloop_weights_superseded_versions_total") - superseded == 1
    gate.set()
    assert publisher.flush(timeout=30)
    assert publisher.served_version == 4
    with WeightSubscriber(HOST, publisher.pub_port, publisher.fetch_port, fetch_timeout_s=10) as sub:
        assert_fetched(sub.fetch(min_version=1), 4, sets[4])


def test_reserved_buffers_serve_every_version_without_a_new_allocation(publisher: WeightPublisher) -> None:
    """reserve() at start allocates both encoding buffers (pinned on a GPU); the first publish and
    every later one, a longer header (version 2**31 - 2, the largest but one) and an owned hand-over included, are
    encoded into those two allocations and fetched intact."""
    versions = (1, 2, 3, 2**31 - 2, 2**31 - 1)
    sets = {v: weight_set(i, scale=1 << 16) for i, v in enumerate(versions)}
    nbytes = publisher.reserve(sets[1])
    reserved = {publisher._spare.storage.data_ptr(), publisher._reserved.storage.data_ptr()}
    assert len(reserved) == 2 and publisher._spare.capacity == nbytes and not publisher._spare.pinned
    sizes = {}
    with WeightSubscriber(HOST, publisher.pub_port, publisher.fetch_port, fetch_timeout_s=20) as sub:
        for v, tensors in sets.items():
            publisher.publish(tensors, v, wait=True, owned=v == 3)
            served = publisher._current.buf
            assert served.storage.data_ptr() in reserved, v
            sizes[v] = served.nbytes
            assert served.nbytes == publisher.nbytes <= nbytes
            assert_fetched(sub.fetch(min_version=v - 1), v, tensors)
    assert sizes[2**31 - 2] > sizes[1] and publisher._reserved is None  # the header grew; both buffers in use
    with pytest.raises(WeightsError, match="before the first publish"):
        publisher.reserve(sets[1])


def test_a_lost_reply_is_requested_again(publisher: WeightPublisher) -> None:
    want = weight_set(4, scale=1 << 16)
    publisher.publish(want, 4)
    with tapped(publisher, lambda n, hdr, frames: None if n == 1 else frames, resend_s=0.3) as (sub, _):  # drop one
        assert_fetched(sub.fetch(), 4, want)
    assert sub.stats["resent_requests"] >= 1


def test_replies_slower_than_resend_s_still_arrive(publisher: WeightPublisher) -> None:
    """Every CHUNK reply takes 0.5 s through the tap, longer than resend_s: each resend throws away
    what was on the old connection, so only a growing wait between resends lets a reply through."""
    want = weight_set(5, scale=1 << 14)  # ~400 KiB: 2 chunks of 256 KiB
    publisher.publish(want, 5)

    def slow(n: int, hdr: dict, frames: list[bytes]) -> list[bytes]:
        time.sleep(0.5)
        return frames

    # fetch_timeout_s 30, not 10: every resend leaves its requests' slow replies queued in the tap
    # (0.5 s each), so the wait has to outgrow that backlog too; under -n 3 on 2 cores the fourth
    # resend's 4.8 s window once passed without a reply, and 10 s ended the fetch with 0/2 chunks
    with tapped(publisher, slow, resend_s=0.3, fetch_timeout_s=30) as (sub, _):
        assert_fetched(sub.fetch(), 5, want)
    assert sub.stats["resent_requests"] >= 2 and sub.stats["reconnects"] >= 1  # it did resend, and finished


def test_a_request_lost_with_a_dead_publisher_is_asked_again_when_it_comes_back() -> None:
    """A learner killed while it holds a request, then restarted on the same ports: the request is
    asked again as soon as the connection shakes hands with the new learner, not after ``resend_s``
    (here longer than ``fetch_timeout_s``, so waiting for it would end in WeightsTimeout)."""
    pub_port, fetch_port = unassigned_port(), unassigned_port()  # not in the ephemeral range: SELF_CONNECT
    # the learner that takes the request and dies without answering, in a context of its own: a
    # socket's close is carried out by the context's I/O thread later, and only terminating the
    # context waits until the listening port is really released for the new learner to bind
    dying_ctx = zmq.Context()
    dying = dying_ctx.socket(zmq.ROUTER)
    dying.bind(f"tcp://{HOST}:{fetch_port}")
    sub = WeightSubscriber(HOST, pub_port, fetch_port, fetch_timeout_s=8, resend_s=30)
    want = weight_set(1, scale=1 << 14)
    pub = None
    try:
        with ThreadPoolExecutor(1) as pool:
            def fetch_until_a_version():
                for _ in range(50):  # the new learner may answer "nothing yet" until its v1 is ready
                    got = sub.fetch()
                    if got is not None:
                        return got
                    time.sleep(0.1)
                return None

            fut = pool.submit(fetch_until_a_version)
            assert dying.poll(5000), "the subscriber's request never reached the first publisher"
            assert dying.recv_multipart()[2] == b"INFO"
            dying.close(linger=0)
            dying_ctx.term()
            pub = WeightPublisher(HOST, pub_port=pub_port, fetch_port=fetch_port, announce_interval_s=0.2)
            pub.publish(want, 1)
            assert_fetched(fut.result(timeout=60), 1, want)
        assert sub.stats["resent_requests"] >= 1
    finally:
        sub.close()
        if pub is not None:
            pub.close()
        if not dying_ctx.closed:
            dying_ctx.destroy(linger=0)


class Cable:
    """Real TCP between the subscriber and the publisher's two ports, through a link that can be cut.

    :meth:`cut` is a network partition as the subscriber meets it: every connection open at that
    moment goes silent for good (nothing more is carried either way, yet neither end sees it
    closed: a TCP connection whose retransmissions back off for minutes after a partition), and
    new connections are refused until :meth:`heal`. After the heal new connections are carried;
    the silent ones stay silent. ``cut_after_bytes`` cuts by itself once that many bytes came back
    from the fetch port (mid-fetch).
    """

    def __init__(self, pub_port: int, fetch_port: int, cut_after_bytes: int | None = None):
        self.cut_after_bytes = cut_after_bytes
        self.fetched_bytes = 0  # publisher -> subscriber on the fetch port
        self.down = False
        self.cuts = 0
        self.ports: dict[int, int] = {}  # our port -> the publisher's
        self._lock = threading.Lock()
        self._listeners: dict[socket.socket, int] = {}
        self._peer: dict[socket.socket, socket.socket] = {}  # carried connections, both ends
        self._from_fetch: set[socket.socket] = set()  # the publisher's end of fetch-port connections
        self._silent: list[socket.socket] = []
        for target in (pub_port, fetch_port):
            ls = socket.create_server((HOST, 0))
            self._listeners[ls] = target
            self.ports[target] = ls.getsockname()[1]
        self._fetch_port = fetch_port
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cable", daemon=True)
        self._thread.start()

    def port(self, target: int) -> int:
        return self.ports[target]

    def cut(self) -> None:
        with self._lock:
            self._cut_locked()

    def _cut_locked(self) -> None:
        self.down = True
        self.cuts += 1
        self._silent.extend(self._peer)
        self._peer.clear()
        self._from_fetch.clear()

    def heal(self) -> None:
        with self._lock:
            self.down = False

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                watched = [*self._listeners, *self._peer]
            ready, _, _ = select.select(watched, [], [], 0.05)
            for s in ready:
                with self._lock:
                    if s in self._listeners:
                        conn, _ = s.accept()
                        if self.down:
                            conn.close()  # refused while the link is cut
                            continue
                        up = socket.create_connection((HOST, self._listeners[s]))
                        self._peer[conn], self._peer[up] = up, conn
                        if self._listeners[s] == self._fetch_port:
                            self._from_fetch.add(up)
                        continue
                    other = self._peer.get(s)
                    if other is None:
                        continue  # went silent meanwhile
                    try:
                        data = s.recv(1 << 16)
                    except OSError:
                        data = b""
                    if not data:
                        for x in (s, other):
                            self._peer.pop(x, None)
                            x.close()
                        continue
                    if s in self._from_fetch:
                        self.fetched_bytes += len(data)
                        if self.cut_after_bytes is not None and self.fetched_bytes >= self.cut_after_bytes:
                            self.cut_after_bytes = None
                            self._cut_locked()
                            continue  # these bytes are lost in the partition
                    other.sendall(data)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for s in [*self._listeners, *self._peer, *self._silent]:
            s.close()


def test_a_partition_mid_fetch_is_survived_on_fresh_connections_and_announcements_come_again(
        publisher: WeightPublisher) -> None:
    """After a partition the connections that were busy when it began can stay silent for minutes
    (TCP retransmission back-off): the fetch must go on over a fresh connection, and the SUB side
    must get announcements again, once the link is back."""
    want = weight_set(7, scale=1 << 17)  # ~3.3 MB: 13 chunks of 256 KiB
    publisher.publish(want, 7)
    cable = Cable(publisher.pub_port, publisher.fetch_port)
    sub = WeightSubscriber(HOST, cable.port(publisher.pub_port), cable.port(publisher.fetch_port),
                           fetch_timeout_s=60, resend_s=0.5)

    def heal_in(seconds: float) -> threading.Timer:
        t = threading.Timer(seconds, cable.heal)
        t.start()
        return t

    def announced(version: int, within_s: float) -> None:
        wait_for(lambda: sub.latest_announced() == version, f"an announcement of v{version} "
                 f"(latest {sub.latest_announced()} when the wait began)", within_s)

    try:
        announced(7, 30)
        # the request for the current version goes into a connection that then stays silent
        cable.cut()
        healer = heal_in(2.0)
        assert_fetched(sub.fetch(), 7, want)
        healer.join()
        assert sub.stats["reconnects"] >= 1
        # cut mid-fetch, after about a third of the chunks came back; the link is back 2 s later
        cable.cut_after_bytes = cable.fetched_bytes + 1_000_000
        want8 = weight_set(8, scale=1 << 17)
        publisher.publish(want8, 8)
        assert publisher.flush(30)
        with ThreadPoolExecutor(1) as pool:
            fetching = pool.submit(sub.fetch, 7)
            wait_for(lambda: cable.cuts == 2, "the fetch to get a third of the way (the second cut)", 30)
            healer = heal_in(2.0)
            assert_fetched(fetching.result(timeout=60), 8, want8)
        healer.join()
        # the SUB connection went silent in the first cut: its heartbeats give up on it, it reconnects
        publisher.publish(weight_set(9, scale=1 << 10), 9)
        announced(9, 60)
    finally:
        sub.close()
        cable.close()


def test_timeouts_and_bad_publishes_give_clear_errors(publisher: WeightPublisher) -> None:
    nobody = WeightSubscriber(HOST, free_port(), free_port(), fetch_timeout_s=0.5)
    try:
        with pytest.raises(WeightsTimeout, match="no TCP connection was made"):
            nobody.fetch()
    finally:
        nobody.close()
    publisher.publish({"w": torch.ones(3)}, 5)
    with pytest.raises(ValueError, match="not newer than the published version 5"):
        publisher.publish({"w": torch.ones(3)}, 5)
    with pytest.raises(ValueError, match="version must be an integer"):
        publisher.publish({"w": torch.ones(3)}, -1)
    with pytest.raises(ValueError, match="expected a torch.Tensor"):
        publisher.publish({"w": [1.0, 2.0]}, 6)  # type: ignore[dict-item]
    assert publisher.version == 5  # a refused publish changes nothing
    with WeightSubscriber(HOST, publisher.pub_port, publisher.fetch_port, fetch_timeout_s=5) as sub:
        assert_fetched(sub.fetch(), 5, {"w": torch.ones(3)})


def test_a_set_larger_than_max_bytes_is_refused_before_any_chunk_is_fetched(publisher: WeightPublisher) -> None:
    want = {"w": torch.arange(4096, dtype=torch.float32)}  # 16 KiB of tensor data
    publisher.publish(want, 1)
    with tapped(publisher, lambda i, hdr, frames: frames, max_bytes=8 * 1024) as (sub, tap):
        with pytest.raises(WeightsError, match="more than this subscriber's max_bytes 8,192"):
            sub.fetch()
        assert tap.chunks == []  # refused on the manifest: nothing was requested or allocated
    with tapped(publisher, lambda i, hdr, frames: frames, max_bytes=64 * 1024) as (sub, _):
        assert_fetched(sub.fetch(), 1, want)


def test_default_max_bytes_follows_the_model_directory(tmp_path: Path) -> None:
    from worldloop.common.transport.weights import default_max_bytes

    (tmp_path / "model-00001.safetensors").write_bytes(b"\0" * 1000)
    (tmp_path / "model-00002.safetensors").write_bytes(b"\0" * 500)
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0" * 250)
    (tmp_path / "tokenizer.json").write_bytes(b"\0" * 10_000)  # not weights
    assert default_max_bytes(tmp_path) == 4 * 1750 + (64 << 20)


# --------------------------------------------------------------------------- CURVE


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    for name in ("server", "client", "other", "intruder"):
        zmq.auth.create_certificates(tmp_path, name)
    return tmp_path


def test_curve_right_key_gets_weights_wrong_keys_time_out(certs: Path) -> None:
    want = weight_set(1, scale=1 << 14)
    pub = WeightPublisher(HOST, chunk_bytes=64 * 1024, announce_interval_s=0.2,
                          curve_secret_key_file=certs / "server.key_secret",
                          curve_authorized_clients=certs / "client.key")
    pub.publish(want, 1)
    ports = (HOST, pub.pub_port, pub.fetch_port)
    good = WeightSubscriber(*ports, fetch_timeout_s=10, curve_server_public_key_file=certs / "server.key",
                            curve_client_key_file=certs / "client.key_secret")
    wrong_server = WeightSubscriber(*ports, fetch_timeout_s=1, curve_server_public_key_file=certs / "other.key",
                                    curve_client_key_file=certs / "client.key_secret")
    unknown_client = WeightSubscriber(*ports, fetch_timeout_s=1, curve_server_public_key_file=certs / "server.key",
                                      curve_client_key_file=certs / "intruder.key_secret")
    plain = WeightSubscriber(*ports, fetch_timeout_s=1)
    try:
        assert_fetched(good.fetch(), 1, want)
        # PUB is a CURVE server too
        wait_for(lambda: good.latest_announced() == 1, "the CURVE PUB announcement of v1", 60,
                 extra=lambda: f"latest announced: {good.latest_announced()}")
        with pytest.raises(WeightsTimeout, match=r"handshake failed.*curve_server_public"):
            wrong_server.fetch()
        with pytest.raises(WeightsTimeout, match=r"handshake failed.*refused this client key"):
            unknown_client.fetch()
        with pytest.raises(WeightsTimeout, match=r"handshake failed.*no CURVE"):
            plain.fetch()
        assert wrong_server.latest_announced() is None and plain.latest_announced() is None
    finally:
        for s in (good, wrong_server, unknown_client, plain):
            s.close()
        pub.close()


def test_from_config_with_curve_and_errors_that_name_the_key(certs: Path) -> None:
    keys = {
        "curve_server_public": str(certs / "server.key"),
        "curve_server_secret": str(certs / "server.key_secret"),
        "curve_client_public": str(certs),  # a folder: every *.key in it is authorized
        "curve_client_secret": str(certs / "client.key_secret"),
    }
    cfg = config_from_dict({"weights": {"pub_port": 0, "fetch_port": 0, "chunk_bytes": 65536, **keys}})
    pub = publisher_from_config(cfg)
    try:
        assert pub.curve and pub.chunk_bytes == 65536 and pub.pub_port > 0 and pub.fetch_port > 0
        pub.publish({"w": torch.arange(10)}, 2)
        actor_cfg = config_from_dict({"weights": {"pub_port": pub.pub_port, "fetch_port": pub.fetch_port,
                                                  "fetch_timeout_s": 10.0, **keys}})
        with subscriber_from_config(actor_cfg) as sub:
            assert_fetched(sub.fetch(), 2, {"w": torch.arange(10)})
    finally:
        pub.close()

    missing = config_from_dict({"weights": {"pub_port": 0, "fetch_port": 0, **keys,
                                            "curve_server_secret": str(certs / "nope.key_secret")}})
    with pytest.raises(ConfigError, match=r"'weights.curve_server_secret'.*nope.key_secret.*does not exist"):
        publisher_from_config(missing)
    public_only = config_from_dict({"weights": {**keys, "curve_client_secret": str(certs / "client.key")}})
    with pytest.raises(ConfigError, match=r"'weights.curve_client_secret'.*holds no secret key"):
        subscriber_from_config(public_only)
    (certs / "garbage.key").write_text("not a certificate\n")
    garbage = config_from_dict({"weights": {"pub_port": 0, "fetch_port": 0, **keys,
                                            "curve_client_public": str(certs / "garbage.key")}})
    with pytest.raises(ConfigError, match=r"'weights.curve_client_public'.*garbage.key"):
        publisher_from_config(garbage)
    with pytest.raises(ConfigError, match=r"'weights.curve_server_public'"):  # caught when the config loads
        config_from_dict({"weights": {"curve_client_secret": keys["curve_client_secret"]}})
    ephemeral = config_from_dict({"weights": {"pub_port": 0, "fetch_port": 0}})  # fine for the learner only
    with pytest.raises(ConfigError, match=r"'weights.pub_port'.*give the publisher's actual port"):
        subscriber_from_config(ephemeral)


# --------------------------------------------------------------------------- codec


def all_dtype_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, 5, generator=g) * 4
    out = {}
    for code, dt in DTYPES.items():
        if dt.is_complex:
            t = torch.complex(base, -base).to(dt)
        elif dt == torch.bool:
            t = base > 0
        elif dt.is_floating_point:
            t = base.to(dt)
        else:  # integers incl. uint16/32/64: through int64
            t = (base * 10).abs().to(torch.int64).to(dt)
        out[f"t.{code}"] = t
    out["scalar"] = torch.tensor(2.5, dtype=torch.bfloat16)
    out["empty"] = torch.empty(0, 7, dtype=torch.float16)
    out["transposed"] = torch.arange(12, dtype=torch.int16).reshape(3, 4).t()  # not contiguous
    out["odd.size.u8"] = torch.arange(7, dtype=torch.uint8)  # 7 bytes: only the size ordering keeps others aligned
    return out


def test_encode_decode_round_trip_for_every_dtype() -> None:
    want = all_dtype_tensors()
    assert {"BF16", "F16", "F32", "F64", "BOOL", "U8", "I64", "F8_E4M3", "C64"} <= set(DTYPES)
    data = encode_tensors(want, 42)
    version, got = decode_tensors(data)  # read-only bytes: copies
    assert version == 42
    assert_same(got, want)
    version, views = decode_tensors(bytearray(data))  # writable: zero-copy views
    assert version == 42
    assert_same(views, want)
    # safetensors-compatible in both directions (for the dtypes safetensors knows)
    st_dtypes = {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
                 torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64}
    st_ok = {k: v.contiguous() for k, v in want.items() if v.dtype in st_dtypes}
    assert len(st_ok) >= 15
    assert_same(safetensors.torch.load(encode_tensors(st_ok, 1)), st_ok)
    version, got = decode_tensors(safetensors.torch.save(st_ok, metadata={"version": "9"}))
    assert version == 9
    assert_same(got, st_ok)


def test_encode_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="version must be an integer"):
        encode_tensors({"a": torch.ones(1)}, True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not allowed"):
        encode_tensors({"__metadata__": torch.ones(1)}, 1)
    with pytest.raises(ValueError, match="only dense tensors"):
        encode_tensors({"s": torch.eye(3).to_sparse()}, 1)
    with pytest.raises(ValueError, match="expected a torch.Tensor"):
        encode_tensors({"n": 3}, 1)  # type: ignore[dict-item]


def raw(header: bytes | dict, data_len: int = 0, declared_len: int | None = None) -> bytes:
    hb = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(hb) if declared_len is None else declared_len) + hb + bytes(data_len)


META = {"__metadata__": {"version": "1"}}


def f32(offsets: list[int], shape: list[int] | None = None) -> dict:
    shape = shape if shape is not None else [(offsets[1] - offsets[0]) // 4]
    return {"dtype": "F32", "shape": shape, "data_offsets": offsets}


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"\x01\x02", "too short"),
        (raw(META, declared_len=10_000), "runs past the end"),
        (raw(META, declared_len=1 << 40), "exceeds the limit"),
        (raw(b"{not json"), "not valid JSON"),
        (raw(b"\xff\xfe{}"), "not valid JSON"),
        (raw(b'{"__metadata__": {"version": "1"}, "a": {}, "a": {}}'), "duplicate key 'a'"),
        (raw(b"[1, 2]"), "must be a JSON object"),
        (raw({"a": f32([0, 4])}, 4), "__metadata__"),
        (raw({"__metadata__": {"version": "v1"}}), "version must be a decimal integer"),
        (raw({**META, "a": {"dtype": "F13", "shape": [1], "data_offsets": [0, 4]}}, 4), "unknown dtype 'F13'"),
        (raw({**META, "a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, 4), "shape must be"),
        (raw({**META, "a": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, 4), "data_offsets must be"),
        (raw({**META, "a": {"dtype": "F32", "shape": [1]}}, 4), "exactly dtype, shape and data_offsets"),
        (raw({**META, "a": f32([0, 400])}, 16), "out of range"),
        (raw({**META, "a": f32([8, 4], [1])}, 16), "out of range"),
        (raw({**META, "a": f32([0, 8]), "b": f32([4, 12])}, 12), "overlap"),
        (raw({**META, "a": f32([0, 8], [3])}, 8), r"8 bytes for F32 \[3\] which needs 12"),
        (raw({**META, "a": f32([0, 4]), "b": f32([8, 12])}, 12), r"bytes \[4, 8\) of the data section belong to no tensor"),
        (raw({**META, "a": f32([0, 4])}, 8), "4 trailing bytes"),
    ],
)
def test_decode_rejects_malformed_data(data: bytes, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        decode_tensors(data)
