"""Issue 38, finding 4: untrusted bytes never raise anything but the documented error.

A 200 KB entry nested 70,000 maps deep (each an unknown field of the one above) made msgspec raise
``RecursionError`` while it skipped the unknown field. The consumer dead-lettered the entry, but
the admission refund hook then called ``trajectory_id_of``, which let the RecursionError out of
``StreamConsumer.read``, and the judge exited (6 such entries ended a whole ``up`` run).
"""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worldloop.common.transport.admission import Admission
from worldloop.common.transport.control import read_stats
from worldloop.common.contracts.keys import Keys
from worldloop.common.contracts.schemas import SchemaError, decode_deadletter, decode_trajectory, trajectory_id_of
from worldloop.common.transport.streams import StreamProducer, connect
from tests.procs import wait_for
from tests.test_judge_process import _push, _scored, _spawn


def nested(depth: int, tid: str | None = "deep-1") -> bytes:
    """A msgpack map ``{"trajectory_id": tid, "a": {"a": {... depth maps ... nil}}}``: 3 bytes a level
    (fixmap of 1, fixstr "a"), so depth 70,000 is about 205 KB."""
    head = msgpack.packb({"trajectory_id": tid})  # fixmap(1) + key + value
    return bytes([0x82]) + head[1:] + b"\xa1a" + b"\x81\xa1a" * depth + b"\xc0"


def test_a_deeply_nested_payload_raises_only_schema_error_and_names_no_id() -> None:
    data = nested(70_000)
    assert 200_000 < len(data) < 215_000
    # each decoder says what went wrong in its documented type (RecursionError before the fix)
    with pytest.raises(SchemaError, match=r"nested deeper than the decoder allows \(210\d{3} bytes\)"):
        decode_trajectory(data)
    with pytest.raises(SchemaError, match="nested deeper than the decoder allows"):
        decode_deadletter(data)
    # the refund hook's reader: "no id" (it cannot be read without decoding the rest), never a raise
    assert trajectory_id_of(data) is None
    # a shallow one of the same shape still gives its id (the field is found when decoding works)
    assert trajectory_id_of(nested(10)) == "deep-1"


def test_a_payload_that_is_not_bytes_raises_schema_error() -> None:
    with pytest.raises(SchemaError, match="payload is not bytes"):
        decode_trajectory(12345)  # type: ignore[arg-type]
    assert trajectory_id_of(None) is None  # type: ignore[arg-type]


_LEAVES = st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=8) | st.binary(max_size=8)
_VALUES = st.recursive(_LEAVES, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                       max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(value=_VALUES, depth=st.integers(0, 80_000), raw=st.binary(max_size=64))
def test_decoders_raise_only_schema_error_on_any_payload(value, depth: int, raw: bytes) -> None:
    """Property: whatever the bytes (arbitrary msgpack values, wrapped in up to 80,000 levels of
    maps or lists, or raw garbage), the decoders raise SchemaError or return, and trajectory_id_of
    returns a str or None."""
    body = msgpack.packb(value)
    for data in (raw, body, b"\x81\xa1a" * depth + body, b"\x91" * depth + body, nested(depth)):
        for decode in (decode_trajectory, decode_deadletter):
            try:
                decode(data)
            except SchemaError:
                pass
        tid = trajectory_id_of(data)
        assert tid is None or isinstance(tid, str)


def test_a_judge_survives_a_deeply_nested_entry_and_refunds_it(redis_url: str, tmp_path: Path) -> None:
    """A real judge process on a real stream: two nested entries (one whose id the refund can read,
    one too deep to read) between good ones. Both are dead-lettered as decode errors, the judge
    keeps running and scores the good ones; the readable id's admission budget comes back."""
    keys = Keys("jdeep")
    r = connect(redis_url)
    adm = Admission(redis_url, keys, max_staleness=4, batch_size=4)
    assert adm.admit(["shallow-1"], actor_version=0).admitted
    adm.settle("shallow-1")
    prod = StreamProducer(redis_url, keys.rollouts, max_backlog=10_000)
    _push(redis_url, keys, 1)
    prod.add(nested(70_000))
    prod.add(nested(500, tid="shallow-1"))  # its id can be read; it is no trajectory
    prod.close()
    _push(redis_url, keys, 2)  # traj-000 and traj-001 again: two more good entries
    cfg = {"redis": {"url": redis_url, "namespace": keys.ns, "claim_idle_ms": 1000, "block_ms": 200},
           "judge": {"scorers": {"default": ["rule"]}}, "metrics": {"enabled": False}}
    proc, _ = _spawn(tmp_path, "judge", cfg)
    try:
        wait_for(lambda: r.xlen(keys.scored) >= 2 and r.xlen(keys.deadletter) == 2 and r.xlen(keys.rollouts) == 0,
                 "the judge to score the good entries and dead-letter both nested ones", 120, children=[proc])
        assert proc.returncode is None, proc.describe()
    finally:
        proc.kill()
    recs = [decode_deadletter(f[b"data"]) for _, f in r.xrange(keys.deadletter)]
    assert all("decode failed: SchemaError" in rec.reason for rec in recs), [rec.reason for rec in recs]
    assert any("nested deeper than the decoder allows" in rec.reason for rec in recs)
    assert read_stats(r, keys)["deadletter_rollouts_decode_error"] == 2
    assert {t.trajectory_id for t in _scored(r, keys)} == {"traj-000", "traj-001"}
    assert adm.state()["refunded"] == 1  # shallow-1's budget; the unreadable one named no id
    adm.close()


def test_the_other_json_readers_of_untrusted_bytes_raise_value_error_on_deep_nesting(redis_url: str) -> None:
    """The same RecursionError from json.loads (Python's JSON scanner recurses too): a weights
    header, a weights request and a ``{ns}:procs`` record nested 100,000 deep."""
    import struct

    from worldloop.common.transport.control import list_processes
    from worldloop.common.transport.weights.codec import decode_tensors
    from worldloop.common.transport.weights.codec import json_object as _json_object

    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(ValueError, match="header is not valid JSON: RecursionError"):
        decode_tensors(struct.pack("<Q", len(deep)) + deep)
    with pytest.raises(ValueError, match="request is nested too deeply"):
        _json_object(deep)
    keys = Keys("deepjson")
    r = connect(redis_url)
    r.hset(keys.procs, mapping={"judge:bad": deep, "judge:good": b'{"role": "judge", "id": "good"}'})
    assert list_processes(r, keys) == [{"role": "judge", "id": "good"}]
