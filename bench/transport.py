"""Transport throughput: our Redis-stream layer against plain redis-py, plus the weights table.

    python bench/transport.py [--size 65536] [--count 2000] [--batch 64] [--cluster]

Redis part: ``--count`` messages of ``--size`` bytes through
StreamProducer.add -> StreamConsumer.read -> ack (XADD, XREADGROUP, XACK+XDEL,
with the XLEN backpressure check on every add), and in the same run the raw
baseline: plain redis-py XADD then XREAD (no group, no ack, no backlog check)
on the same private LocalRedis. Both run produce-all then consume-all in one
thread. Prints messages/s and MB/s and the ratio ours/raw. ``--cluster`` adds our path on a
private Redis Cluster (``LocalRedisCluster``: 3 primaries, a replica each, through a
``redis+cluster://`` URL, so RedisCluster and replication to the replica are in the cost).

Weights part: ``bench/_weights.py``'s ``weights_rows()`` for the ZeroMQ weight channel
(owned by its engineer; rows as dicts, or a header row then value rows) when that file exists.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from worldloop.common.transport.redis_cluster_local import LocalRedisCluster  # noqa: E402
from worldloop.common.transport.redis_local import LocalRedis  # noqa: E402
from worldloop.common.transport.streams import StreamConsumer, StreamProducer  # noqa: E402


def run_ours(url: str, payload: bytes, count: int, batch: int) -> float:
    """Seconds to push ``count`` payloads through producer -> consumer.read -> ack."""
    prod = StreamProducer(url, "bench:ours", max_backlog=count + 1)
    cons = StreamConsumer(url, "bench:ours", "g", "c", block_ms=100)
    start = time.perf_counter()
    for _ in range(count):
        prod.add(payload)
    done = 0
    while done < count:
        msgs = cons.read(batch)
        cons.ack([m.id for m in msgs])
        done += len(msgs)
    elapsed = time.perf_counter() - start
    prod.close()
    cons.close()
    return elapsed


def run_raw(url: str, payload: bytes, count: int, batch: int) -> float:
    """Seconds for the same traffic with plain XADD and XREAD (no group, no ack)."""
    r = redis.Redis.from_url(url)
    start = time.perf_counter()
    for _ in range(count):
        r.xadd("bench:raw", {b"data": payload})
    last, done = "0-0", 0
    while done < count:
        res = r.xread({"bench:raw": last}, count=batch)
        entries = res[0][1]
        last = entries[-1][0]
        done += len(entries)
    elapsed = time.perf_counter() - start
    r.delete("bench:raw")
    r.close()
    return elapsed


def measure(name: str, fn: Callable[..., float], url: str, payload: bytes, count: int, batch: int,
            repeats: int) -> dict:
    best = min(fn(url, payload, count, batch) for _ in range(repeats))
    return {"name": name, "seconds": best, "msg_s": count / best, "mb_s": count * len(payload) / best / 1e6}


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    print(f"\n{title}")
    for row in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)))


def redis_table(size: int, count: int, batch: int, repeats: int, cluster: bool = False) -> None:
    payload = os.urandom(size)
    with LocalRedis() as srv:
        raw = measure("raw redis-py XADD -> XREAD", run_raw, srv.url, payload, count, batch, repeats)
        ours = measure("ours add -> read -> ack(+XDEL)", run_ours, srv.url, payload, count, batch, repeats)
    paths = [raw, ours]
    if cluster:
        with LocalRedisCluster(primaries=3, replicas=1) as c:
            paths.append(measure("ours on a 3-primary cluster (+replicas)", run_ours, c.url, payload, count, batch,
                                 repeats))
    rows = [[m["name"], f"{m['seconds']:.3f}", f"{m['msg_s']:.0f}", f"{m['mb_s']:.1f}", f"{m['msg_s'] / raw['msg_s']:.2f}"]
            for m in paths]
    print_table(f"Redis streams: {count} messages x {size} B, read batch {batch}, best of {repeats}",
                ["path", "seconds", "msg/s", "MB/s", "ratio vs raw"], rows)


def weights_table() -> None:
    path = ROOT / "bench" / "_weights.py"
    if not path.exists():
        print("\nweights: bench/_weights.py is not there yet; only the Redis table was measured")
        return
    spec = importlib.util.spec_from_file_location("bench_weights", path)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    rows = list(mod.weights_rows())
    if not rows:
        print("\nweights: weights_rows() returned no rows")
        return
    if isinstance(rows[0], dict):  # rows as mappings: the keys are the header
        header = list(rows[0])
        body = [[str(r.get(k, "")) for k in header] for r in rows]
    else:  # rows as sequences: the first row is the header
        header, body = [str(x) for x in rows[0]], [[str(x) for x in r] for r in rows[1:]]
    print_table("ZeroMQ weight channel", header, body)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=64 * 1024, help="payload bytes per message")
    ap.add_argument("--count", type=int, default=2000, help="messages per measurement")
    ap.add_argument("--batch", type=int, default=64, help="entries per XREAD / XREADGROUP")
    ap.add_argument("--repeats", type=int, default=3, help="measurements per path (best is shown)")
    ap.add_argument("--no-weights", action="store_true", help="skip the weights table")
    ap.add_argument("--cluster", action="store_true", help="also our path on a local 3-primary Redis Cluster")
    a = ap.parse_args(argv)
    if min(a.size, a.count, a.batch, a.repeats) < 1:
        ap.error("--size, --count, --batch and --repeats must be >= 1")
    redis_table(a.size, a.count, a.batch, a.repeats, a.cluster)
    if not a.no_weights:
        weights_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
