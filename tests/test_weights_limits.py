"""Frame-size limits of the weight channel (issue 38, finding 9), with real ZeroMQ sockets on
loopback: a peer that sends any weight socket a frame larger than it expects is disconnected by
libzmq from the frame's length prefix (ZMQ_MAXMSGSIZE; nothing is read or allocated), and the
socket goes on serving. Each test watches the oversized sender's side of the connection with a
ZeroMQ monitor: the disconnect is what shows that the frame was refused, not read."""

from __future__ import annotations

import json
import threading

import pytest
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from worldloop.common.transport.weights import WeightPublisher, WeightSubscriber
from worldloop.common.transport.weights.codec import (
    CONTROL_MAX_BYTES,
    FORMAT,
    REPLY_HEADROOM_BYTES,
    TOPIC,
    Manifest,
    reply_max_bytes,
    valid_version,
)

from procs import wait_for

HOST = "127.0.0.1"


class Monitored:
    """A raw ZeroMQ socket of ``kind`` with a monitor that records its connection events."""

    def __init__(self, ctx: zmq.Context, kind: int, name: str):
        self.sock = ctx.socket(kind)
        self.sock.linger = 0
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED,
                                                    addr=f"inproc://limits-{name}")
        self.events: list[int] = []

    def count(self, event: int) -> int:
        while self.monitor.poll(0):
            self.events.append(recv_monitor_message(self.monitor)["event"])
        return self.events.count(event)

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)


def test_the_limits_follow_the_model_size() -> None:
    # requests, subscriptions and announcements are JSON under 1 KiB; replies are bounded by max_bytes
    assert CONTROL_MAX_BYTES == 64 * 1024
    assert reply_max_bytes(64 << 20) == (64 << 20) + REPLY_HEADROOM_BYTES == 68_157_440
    assert reply_max_bytes(None) == -1  # a subscriber without max_bytes: libzmq's "no limit"


def test_the_router_drops_an_oversized_request_and_keeps_serving() -> None:
    """A 1 MiB request frame (the learner's ROUTER takes 64 KiB) costs its sender the connection
    and gets no answer; the same peer, reconnected, and a real subscriber are then served."""
    pub = WeightPublisher(HOST, chunk_bytes=64 * 1024, announce_interval_s=0.2)
    ctx = zmq.Context()
    peer = Monitored(ctx, zmq.DEALER, "router-peer")
    sub = None
    try:
        tensors = {"w": torch.arange(50_000, dtype=torch.float32)}
        pub.publish(tensors, 1)
        assert pub.flush(30)
        peer.sock.connect(f"tcp://{HOST}:{pub.fetch_port}")
        wait_for(lambda: peer.count(zmq.EVENT_HANDSHAKE_SUCCEEDED) >= 1, "the peer's handshake", 30)
        peer.sock.send_multipart([b"", b"INFO", b'{"rid": 1, "pad": "' + b"x" * (1 << 20) + b'"}'])
        wait_for(lambda: peer.count(zmq.EVENT_DISCONNECTED) >= 1, "the ROUTER to drop the oversized sender", 30)
        assert not peer.sock.poll(0)  # no answer (without the limit: an ERROR reply after reading 1 MiB)
        # the same peer reconnects by itself; a request of the right size is answered
        wait_for(lambda: peer.count(zmq.EVENT_HANDSHAKE_SUCCEEDED) >= 2, "the peer's reconnect", 30)
        peer.sock.send_multipart([b"", b"INFO", json.dumps({"rid": 2}).encode()])
        assert peer.sock.poll(30_000)
        frames = peer.sock.recv_multipart()
        assert frames[1] == b"MANIFEST" and json.loads(frames[2])["rid"] == 2
        sub = WeightSubscriber(HOST, pub.pub_port, pub.fetch_port, fetch_timeout_s=30, max_bytes=1 << 20)
        got = sub.fetch()
        assert got is not None and got[0] == 1 and torch.equal(got[1]["w"], tensors["w"])
    finally:
        if sub is not None:
            sub.close()
        peer.close()
        ctx.term()
        pub.close()


def _announcement(version: int, pad: int = 0) -> list[bytes]:
    return [TOPIC, json.dumps({"format": FORMAT, "version": version, "pad": "x" * pad}).encode()]


def test_an_actors_sub_drops_an_oversized_announcement_and_keeps_listening() -> None:
    """A PUB (standing for a learner, or whoever answers at its address) sends a 128 KiB
    announcement: the subscriber's SUB disconnects instead of reading it, so it never sees that
    version, then reconnects and takes the next, well-sized announcement."""
    ctx = zmq.Context()
    pub = Monitored(ctx, zmq.PUB, "sub-peer")
    fetch = ctx.socket(zmq.ROUTER)  # the subscriber's DEALER needs somewhere to connect; never asked here
    sub = None
    try:
        pub_port = pub.sock.bind_to_random_port(f"tcp://{HOST}")
        fetch_port = fetch.bind_to_random_port(f"tcp://{HOST}")
        sub = WeightSubscriber(HOST, pub_port, fetch_port, fetch_timeout_s=30, max_bytes=1 << 20)
        seen: list[int | None] = []

        def announced(version: int) -> bool:
            pub.sock.send_multipart(_announcement(version))
            seen.append(sub.latest_announced())
            return seen[-1] == version

        wait_for(lambda: announced(1), "the first announcement", 30)
        pub.sock.send_multipart(_announcement(99, pad=128 * 1024))
        wait_for(lambda: pub.count(zmq.EVENT_DISCONNECTED) >= 1, "the SUB to drop the oversized announcement", 30)
        wait_for(lambda: announced(2), "an announcement after the reconnect", 30)
        assert 99 not in seen
    finally:
        if sub is not None:
            sub.close()
        fetch.close(0)
        pub.close()
        ctx.term()


def test_an_actors_dealer_drops_a_reply_over_max_bytes_and_asks_again() -> None:
    """A ROUTER (standing for the learner) answers the first request with a 2 MiB header frame, more
    than the subscriber's max_bytes (64 KiB) + 1 MiB: the DEALER's connection is dropped unread
    (nothing rejected: it never got in), the subscriber asks again, and the next answer is taken."""
    ctx = zmq.Context()
    router = Monitored(ctx, zmq.ROUTER, "dealer-peer")
    pub = ctx.socket(zmq.PUB)
    stop = threading.Event()
    answered: list[int] = []

    def serve() -> None:
        while not stop.is_set():
            if not router.sock.poll(50):
                continue
            ident, empty, _cmd, body = router.sock.recv_multipart()
            rid = json.loads(body)["rid"]
            pad = "x" * (2 << 20) if not answered else ""
            answered.append(rid)
            router.sock.send_multipart([ident, empty, b"NONE", json.dumps({"rid": rid, "pad": pad}).encode()])

    thread = threading.Thread(target=serve, daemon=True)
    sub = None
    try:
        fetch_port = router.sock.bind_to_random_port(f"tcp://{HOST}")
        pub_port = pub.bind_to_random_port(f"tcp://{HOST}")
        thread.start()
        sub = WeightSubscriber(HOST, pub_port, fetch_port, fetch_timeout_s=30, resend_s=0.5, max_bytes=64 * 1024)
        assert sub.fetch() is None  # NONE: nothing published, answered on the second try
        assert len(answered) >= 2 and router.count(zmq.EVENT_DISCONNECTED) >= 1
        assert sub.stats["rejected_chunks"] == 0 and sub.stats["resent_requests"] >= 1
    finally:
        stop.set()
        thread.join(5)
        if sub is not None:
            sub.close()
        pub.close(0)
        router.close()
        ctx.term()


@pytest.mark.parametrize("max_bytes", [None, 5 << 20])
def test_a_real_fetch_fits_under_the_dealers_limit(max_bytes) -> None:
    """The limit refuses nothing legitimate: a set of ~1.6 MiB, in one chunk larger than the
    control limit, arrives whole with the DEALER's limit at max_bytes + 1 MiB (and with none)."""
    pub = WeightPublisher(HOST, chunk_bytes=4 << 20, announce_interval_s=0.2)
    sub = WeightSubscriber(HOST, pub.pub_port, pub.fetch_port, fetch_timeout_s=30, max_bytes=max_bytes)
    try:
        tensors = {"a": torch.randn(400_000, generator=torch.Generator().manual_seed(3))}
        pub.publish(tensors, 4)
        assert pub.flush(30)
        got = sub.fetch()
        assert got is not None and got[0] == 4 and torch.equal(got[1]["a"], tensors["a"])
        assert sub._dealer.getsockopt(zmq.MAXMSGSIZE) == reply_max_bytes(max_bytes)
    finally:
        sub.close()
        pub.close()


def test_a_version_out_of_the_message_bound_is_refused_everywhere() -> None:
    """Policy versions are < 2^31 in every message (common/contracts/schemas.py): the publisher refuses to
    publish 2^31, a manifest naming 2^62 is refused, and an announcement of 2^62 is ignored."""
    assert valid_version(0) and valid_version(2**31 - 1)
    assert not any(valid_version(v) for v in (-1, 2**31, 2**62, True, 1.0, "3"))
    pub = WeightPublisher(HOST, chunk_bytes=64 * 1024, announce_interval_s=0.2)
    try:
        with pytest.raises(ValueError, match=r"version must be an integer in \[0, 2147483648\), got 2147483648"):
            pub.publish({"w": torch.zeros(4)}, 2**31)
    finally:
        pub.close()
    good = {"format": FORMAT, "version": 3, "size": 16, "chunk_bytes": 1024, "hash": "xxh3_128", "digest": "0" * 32}
    assert Manifest.parse(good, memoryview(b"\0" * 4)).version == 3
    with pytest.raises(ValueError, match="inconsistent manifest"):
        Manifest.parse({**good, "version": 2**62}, memoryview(b"\0" * 4))
    ctx = zmq.Context()
    pub_sock, fetch = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    sub = None
    try:
        pub_port, fetch_port = pub_sock.bind_to_random_port(f"tcp://{HOST}"), fetch.bind_to_random_port(f"tcp://{HOST}")
        sub = WeightSubscriber(HOST, pub_port, fetch_port, fetch_timeout_s=30)

        def announced(version: int) -> bool:
            pub_sock.send_multipart(_announcement(version))
            return sub.latest_announced() == version

        wait_for(lambda: announced(5), "an announcement", 30)
        pub_sock.send_multipart(_announcement(2**62))
        assert sub._sub.poll(30_000)  # it has arrived (and nothing else was sent): now it is read
        assert sub.latest_announced() == 5
        wait_for(lambda: announced(6), "the next announcement", 30)
    finally:
        if sub is not None:
            sub.close()
        pub_sock.close(0)
        fetch.close(0)
        ctx.term()
