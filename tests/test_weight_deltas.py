"""Delta versions of the weight channel (common/transport/weights/delta.py) over real ZeroMQ sockets:
the XOR/zstd encoding by hand and by property, a subscriber that holds the previous version gets
only the delta and ends bit-for-bit on the learner's weights, one that missed a version gets the
full snapshot, and a corrupt delta or a damaged base is refused and replaced by the full snapshot."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worldloop.common.transport.weights import WeightPublisher, WeightSubscriber
from worldloop.common.transport.weights import delta as delta_mod
from worldloop.common.transport.weights.codec import DEFAULT_HASH, chunk_crc, new_hasher
from worldloop.common.transport.weights.delta import DeltaError, apply_delta, encode_delta

HOST = "127.0.0.1"


# --------------------------------------------------------------------------- the encoding


def test_a_delta_by_hand_names_the_changed_bytes_and_rebuilds_the_new_encoding() -> None:
    import struct

    import zstandard

    base = np.array([0x00, 0x3F, 0x80, 0x3F, 0x00, 0x40], dtype=np.uint8)  # bf16 1.0, 1.0, 2.0
    new = np.array([0x01, 0x3F, 0x80, 0x3F, 0x02, 0x40], dtype=np.uint8)  # 1.0078125, 1.0, 2.015625
    data = encode_delta(base, new, max_ratio=100.0)
    # the frame: header (BLOCK, 6 bytes in all); one block: 2 changes, at gaps 0 (byte 0) and 4 (byte 4), XOR 01 and 02
    raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=1024)
    assert raw == struct.pack("<IQ", delta_mod.BLOCK, 6) + struct.pack("<I", 2) + struct.pack("<II", 0, 4) + bytes([1, 2])
    out = apply_delta(base, data)
    assert out.tolist() == new.tolist()
    assert base.tolist() == [0x00, 0x3F, 0x80, 0x3F, 0x00, 0x40]


def test_no_delta_between_sizes_or_when_it_would_not_be_smaller() -> None:
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, 4096, dtype=np.uint8)
    assert encode_delta(a, a[:-1]) is None  # another layout: only a full snapshot carries it
    assert encode_delta(a, rng.integers(0, 256, 4096, dtype=np.uint8), max_ratio=0.5) is None  # all bytes changed
    assert encode_delta(a, a, max_ratio=0.5) is not None  # nothing changed: a few bytes of zstd


def test_truncated_corrupt_or_foreign_deltas_raise_delta_error() -> None:
    rng = np.random.default_rng(1)
    a = rng.integers(0, 256, 100_000, dtype=np.uint8)
    b = a.copy()
    b[::97] ^= 1
    data = encode_delta(a, b, max_ratio=1.0)
    with pytest.raises(DeltaError, match="truncated"):
        apply_delta(a, data[: len(data) // 2])
    broken = bytearray(data)
    broken[len(broken) // 2] ^= 0xFF
    with pytest.raises(DeltaError, match="does not decompress|is for an encoding of|truncated|claims|past its end"):
        apply_delta(a, bytes(broken))
    with pytest.raises(DeltaError, match="for an encoding of 100,000 bytes, the base has 99,999"):
        apply_delta(a[:-1], data)


def test_positions_that_wrap_past_a_block_are_refused() -> None:
    import struct

    import zstandard

    # gaps 2^32 - 1 then 2: positions far past the 16-byte block (a u32 running sum would wrap the
    # second back to 1, inside it)
    a = np.zeros(16, dtype=np.uint8)
    raw = struct.pack("<IQ", 16, 16) + struct.pack("<I", 2) + struct.pack("<II", 2**32 - 1, 2) + bytes([1, 1])
    with pytest.raises(DeltaError, match="block 0 has a change past its end"):
        apply_delta(a, zstandard.ZstdCompressor().compress(raw))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3000), seed=st.integers(0, 2**32 - 1), share=st.floats(0.0, 1.0),
       block=st.sampled_from([1, 7, 64, 1000, delta_mod.BLOCK]))
def test_property_apply_inverts_encode_across_block_boundaries(n: int, seed: int, share: float, block: int) -> None:
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 256, n, dtype=np.uint8)
    b = a.copy()
    idx = rng.random(n) < share
    b[idx] = rng.integers(0, 256, int(idx.sum()), dtype=np.uint8)
    old = delta_mod.BLOCK
    delta_mod.BLOCK = block  # small blocks cut the buffers at many places
    try:
        data = encode_delta(a, b, max_ratio=1e9)
    finally:
        delta_mod.BLOCK = old
    # the block size travels in the delta: the decoder needs no setting
    assert apply_delta(a, data).tobytes() == b.tobytes()
    # the hash fed block by block (the subscriber's check, pipelined on threads) is the new encoding's
    h, want = new_hasher(DEFAULT_HASH), new_hasher(DEFAULT_HASH)
    want.update(b.tobytes())
    assert apply_delta(a, data, hasher=h).tobytes() == b.tobytes()
    assert h.hexdigest() == want.hexdigest()


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 500), seed=st.integers(0, 2**32 - 1), cut=st.integers(0, 10_000), flip=st.integers(0, 10_000),
       block=st.sampled_from([7, 64, delta_mod.BLOCK]))
def test_property_a_damaged_delta_raises_delta_error_or_rebuilds_exactly(n: int, seed: int, cut: int, flip: int,
                                                                          block: int) -> None:
    # untrusted bytes: only DeltaError may come out, also from a block deep in the pipeline (small
    # blocks: many in flight on apply_delta's threads); whatever decodes is checked by the caller's hash
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 256, n, dtype=np.uint8)
    b = a.copy()
    b[rng.random(n) < 0.1] ^= 1
    old = delta_mod.BLOCK
    delta_mod.BLOCK = block
    try:
        data = bytearray(encode_delta(a, b, max_ratio=1e9))
    finally:
        delta_mod.BLOCK = old
    data[flip % len(data)] ^= 0x10
    try:
        out = apply_delta(a, bytes(data[: len(data) - cut % len(data)]))
    except DeltaError:
        return
    assert len(out) == n


# --------------------------------------------------------------------------- over the channel


def trained_sets(steps: int, lr: float = 1e-6) -> list[dict[str, torch.Tensor]]:
    """The bf16 weights of a small model before and after each of ``steps`` real AdamW steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(512, 64), torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 512))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    out = []
    for step in range(steps + 1):
        out.append({k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()})
        x = torch.randint(0, 512, (8, 16))
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 512), x.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
    return out


def same_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return sorted(got) == sorted(want) and all(
        got[k].dtype == want[k].dtype and torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)


@pytest.fixture
def channel():
    pub = WeightPublisher(HOST, chunk_bytes=4096)
    sub = WeightSubscriber(HOST, pub.pub_port, pub.fetch_port, fetch_timeout_s=30)
    try:
        yield pub, sub
    finally:
        sub.close()
        pub.close()


def fetch_as(sub: WeightSubscriber, version: int) -> dict[str, torch.Tensor]:
    got = sub.fetch()
    assert got is not None and got[0] == version
    return got[1]


def test_a_subscriber_holding_the_last_version_gets_only_the_delta_and_the_exact_weights(channel) -> None:
    pub, sub = channel
    sets = trained_sets(2)
    pub.publish(sets[0], 1, wait=True)
    assert same_bits(fetch_as(sub, 1), sets[0])
    assert sub.stats["delta_fetches"] == 0
    for version in (2, 3):
        pub.publish(sets[version - 1], version, wait=True)
        assert same_bits(fetch_as(sub, version), sets[version - 1])
        assert sub.stats["delta_fetches"] == version - 1
        # the delta crossed the wire in place of the snapshot: every step at lr 1e-6 moves few bf16 bits
        offer = pub._current.delta
        assert offer is not None and offer.manifest.size < pub._current.manifest.size / 5
    assert sub.stats["delta_refused"] == 0


def test_a_subscriber_that_missed_a_version_or_starts_fresh_gets_the_full_snapshot(channel) -> None:
    pub, sub = channel
    sets = trained_sets(2)
    pub.publish(sets[0], 1, wait=True)
    fetch_as(sub, 1)
    pub.publish(sets[1], 2, wait=True)
    pub.publish(sets[2], 3, wait=True)  # v3's delta is from v2, which this subscriber never held
    assert same_bits(fetch_as(sub, 3), sets[2])
    assert sub.stats["delta_fetches"] == 0
    late = WeightSubscriber(HOST, pub.pub_port, pub.fetch_port, fetch_timeout_s=30)
    try:
        assert same_bits(fetch_as(late, 3), sets[2]) and late.stats["delta_fetches"] == 0
    finally:
        late.close()


def test_a_corrupt_delta_is_refused_with_a_log_line_and_the_full_snapshot_is_fetched(channel, caplog) -> None:
    pub, sub = channel
    sets = trained_sets(1)
    pub.publish(sets[0], 1, wait=True)
    fetch_as(sub, 1)
    pub.publish(sets[1], 2, wait=True)
    # alter one byte of the delta on the publisher and forge that chunk's CRC-32C, so the chunk passes
    # its check and only the delta's own verification can catch it
    offer = pub._current.delta
    data = bytearray(offer.data)
    data[len(data) // 2] ^= 0x40
    offer.data = bytes(data)
    cb = offer.manifest.chunk_bytes
    idx = (len(data) // 2) // cb
    crcs = list(offer.manifest.crcs)
    crcs[idx] = chunk_crc(memoryview(offer.data)[idx * cb:(idx + 1) * cb])
    offer.manifest = type(offer.manifest)(**{**offer.manifest.__dict__, "crcs": tuple(crcs)})
    import zmq
    offer.frames = [zmq.Frame(memoryview(offer.data)[i * cb:(i + 1) * cb], copy=False) for i in range(offer.manifest.n_chunks)]
    with caplog.at_level(logging.WARNING, logger="worldloop.common.transport.weights.subscriber"):
        got = fetch_as(sub, 2)
    assert same_bits(got, sets[1])
    assert sub.stats["delta_refused"] == 1 and sub.stats["delta_fetches"] == 0
    assert "refused the delta for v2" in caplog.text and "fetching the full snapshot" in caplog.text


def test_a_damaged_base_fails_the_rebuilt_hash_and_the_full_snapshot_is_fetched(channel, caplog) -> None:
    pub, sub = channel
    sets = trained_sets(1)
    pub.publish(sets[0], 1, wait=True)
    held = fetch_as(sub, 1)
    # the caller changed a tensor it was handed (a view into the subscriber's base) in place
    next(iter(held.values())).view(torch.uint8).reshape(-1)[0] ^= 0x01
    pub.publish(sets[1], 2, wait=True)
    with caplog.at_level(logging.WARNING, logger="worldloop.common.transport.weights.subscriber"):
        got = fetch_as(sub, 2)
    assert same_bits(got, sets[1])
    assert sub.stats["delta_refused"] == 1
    assert "does not match the manifest's xxh3_128 digest" in caplog.text


def test_deltas_off_on_either_side_means_full_snapshots() -> None:
    sets = trained_sets(1)
    with WeightPublisher(HOST, chunk_bytes=4096, delta=False) as pub:
        with WeightSubscriber(HOST, pub.pub_port, pub.fetch_port, fetch_timeout_s=30) as sub:
            pub.publish(sets[0], 1, wait=True)
            fetch_as(sub, 1)
            pub.publish(sets[1], 2, wait=True)
            assert pub._current.delta is None
            assert same_bits(fetch_as(sub, 2), sets[1]) and sub.stats["delta_fetches"] == 0
    with WeightPublisher(HOST, chunk_bytes=4096) as pub:
        with WeightSubscriber(HOST, pub.pub_port, pub.fetch_port, fetch_timeout_s=30, deltas=False) as sub:
            pub.publish(sets[0], 1, wait=True)
            fetch_as(sub, 1)
            pub.publish(sets[1], 2, wait=True)
            assert pub._current.delta is not None  # offered, but this subscriber holds no base and never asks
            assert same_bits(fetch_as(sub, 2), sets[1]) and sub.stats["delta_fetches"] == 0
