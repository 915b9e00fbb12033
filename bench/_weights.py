"""Weight channel throughput: seconds to deliver one version to 1, 2 and 4 subscribers.

    python bench/_weights.py [--size-mb 1024] [--subscribers 1,2,4] [--repeats 1]
    python bench/transport.py            # prints this table after the Redis one
    WORLDLOOP_BENCH_WEIGHTS_MB=64 python bench/transport.py   # a quick run

Ours: a WeightPublisher in this process publishes ``--size-mb`` MiB of tensors (f32 and
bf16) and N WeightSubscriber processes (real actors are processes too) fetch it
over loopback: encode, xxh3-128 of the whole and CRC-32C of every chunk, chunked
fetch (each chunk one shared zero-copy frame for every subscriber), verification,
decode to tensors. "ours s" runs from the ``publish`` call until the last subscriber
holds the verified tensors; "blocked s" is the time the ``publish`` call blocked its
caller (the hand-over: validation and the copy into the encoding buffer), measured in
the steady state: the publisher has served a version before, as a learner's has after
start-up (a first version also pays for allocating its buffer); checksums and serving
happen behind the caller. "speed vs raw" is raw TCP seconds / ours seconds: per-subscriber
throughput relative to raw loopback TCP (goal >= 0.8).

Baseline, measured in the same run: the limit of the machine for this traffic,
a plain TCP ``sendall`` of the same number of bytes from this process (one thread
per receiver) to N receiver processes that ``recv_into`` a preallocated buffer;
no framing, no checksums, no copies beyond the kernel's. "CPU s/sub" is the CPU
time (user + system, all threads) one receiving process spent on the transfer:
on a machine with fewer cores than subscribers, the totals are CPU-bound. "sender CPU s" /
"publisher CPU s" is the CPU time of the sending process over the same span (the publisher's
includes the checksums and its ZeroMQ I/O threads): what each extra subscriber costs the learner's
machine.

Children are separate Python processes that report over stdout lines (time.monotonic
is system-wide on Linux, so their end times compare with ours).
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HOST = "127.0.0.1"
ENV_SIZE = "WORLDLOOP_BENCH_WEIGHTS_MB"


# --------------------------------------------------------------------------- children


def _child_ours(pub_port: int, fetch_port: int, version: int) -> None:
    from worldloop.common.transport.weights import WeightSubscriber

    sub = WeightSubscriber(HOST, pub_port, fetch_port, fetch_timeout_s=300)
    cpu0 = _cpu_seconds()
    print("ready", flush=True)
    got = None
    while got is None:
        got = sub.fetch(min_version=version - 1)
        if got is None:
            time.sleep(0.002)
    end = time.monotonic()
    v, tensors = got
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    cpu = _cpu_seconds() - cpu0
    print(f"done {end!r} {cpu!r} {v} {nbytes} {sub.stats['restarts']} {sub.stats['rejected_chunks']}", flush=True)
    sub.close()


def _child_raw(port: int, size: int) -> None:
    import numpy as np

    buf = np.empty(size, dtype=np.uint8)
    view = memoryview(buf)
    conn = socket.create_connection((HOST, port))
    cpu0 = _cpu_seconds()
    print("ready", flush=True)
    got = 0
    while got < size:
        n = conn.recv_into(view[got:])
        if n == 0:
            raise SystemExit(f"raw receiver: connection closed after {got} of {size} bytes")
        got += n
    end = time.monotonic()
    print(f"done {end!r} {_cpu_seconds() - cpu0!r}", flush=True)
    conn.close()


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)  # all threads of this process
    return r.ru_utime + r.ru_stime


def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", *args],
                            stdout=subprocess.PIPE, text=True, cwd=str(ROOT))


def _expect(proc: subprocess.Popen, word: str) -> list[str]:
    line = proc.stdout.readline() if proc.stdout else ""
    parts = line.split()
    if not parts or parts[0] != word:
        proc.kill()
        raise RuntimeError(f"bench child said {line!r}, expected {word!r} (exit code {proc.wait()})")
    return parts[1:]


# --------------------------------------------------------------------------- measurements


def make_tensors(size: int) -> dict:
    """``size`` bytes of random f32 (3/4) and bf16 (1/4) tensors in 8 pieces."""
    import torch

    g = torch.Generator().manual_seed(0)
    piece = size // 8 // 4 * 4
    out = {}
    for i in range(8):
        raw = torch.randint(0, 256, (piece,), dtype=torch.uint8, generator=g)
        out[f"layer{i}.weight"] = raw.view(torch.float32 if i < 6 else torch.bfloat16)
    return out


def measure_ours(tensors: dict, n_subs: int) -> tuple[float, float, float, float, int]:
    """(seconds publish-to-last-subscriber, seconds publish blocked its caller, mean CPU s per subscriber,
    CPU s of this (the publisher's) process over the same span, bytes)."""
    from worldloop.common.transport.weights import WeightPublisher

    want = sum(t.numel() * t.element_size() for t in tensors.values())
    with WeightPublisher(HOST) as pub:
        pub.publish(tensors, 1, wait=True)  # start-up: buffers allocated; the measured version is 2
        procs = [_spawn("ours", str(pub.pub_port), str(pub.fetch_port), "2") for _ in range(n_subs)]
        try:
            for p in procs:
                _expect(p, "ready")
            t0, cpu0 = time.monotonic(), _cpu_seconds()
            blocked = pub.publish(tensors, 2)
            ends, cpus = [], []
            for p in procs:
                end, cpu, v, nbytes, restarts, rejected = _expect(p, "done")
                if (int(v), int(nbytes), int(restarts), int(rejected)) != (2, want, 0, 0):
                    raise RuntimeError(f"bad delivery: v{v}, {nbytes}/{want} bytes, "
                                       f"{restarts} restarts, {rejected} rejected")
                ends.append(float(end))
                cpus.append(float(cpu))
            encoded = pub.nbytes
        finally:
            for p in procs:
                if p.wait(60) != 0:
                    raise RuntimeError(f"subscriber process exited with {p.returncode}")
            pub_cpu = _cpu_seconds() - cpu0
    return max(ends) - t0, blocked, sum(cpus) / len(cpus), pub_cpu, encoded


def measure_raw(size: int, n_subs: int) -> tuple[float, float, float]:
    """(seconds for plain TCP sendall of ``size`` bytes to ``n_subs`` receiver processes, mean CPU s per
    receiver, CPU s of this (the sending) process)."""
    import numpy as np

    src = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    with socket.create_server((HOST, 0)) as srv:
        procs = [_spawn("raw", str(srv.getsockname()[1]), str(size)) for _ in range(n_subs)]
        conns = [srv.accept()[0] for _ in procs]
        try:
            for p in procs:
                _expect(p, "ready")
            t0, cpu0 = time.monotonic(), _cpu_seconds()
            senders = [threading.Thread(target=c.sendall, args=(memoryview(src),)) for c in conns]
            for s in senders:
                s.start()
            done = [[float(x) for x in _expect(p, "done")] for p in procs]
            for s in senders:
                s.join()
            send_cpu = _cpu_seconds() - cpu0
        finally:
            for c in conns:
                c.close()
            for p in procs:
                p.wait(60)
    return max(end for end, _ in done) - t0, sum(cpu for _, cpu in done) / len(done), send_cpu


def weights_rows(size_mb: int | None = None, subscribers: tuple[int, ...] = (1, 2, 4), repeats: int = 1) -> list[dict]:
    """One row per subscriber count (best of ``repeats``); size from ``WORLDLOOP_BENCH_WEIGHTS_MB`` or 1024 MiB."""
    size_mb = size_mb or int(os.environ.get(ENV_SIZE, "1024"))
    size = size_mb << 20
    tensors = make_tensors(size)
    rows = []
    for n in subscribers:
        raw, raw_cpu, raw_send_cpu = min((measure_raw(size, n) for _ in range(repeats)), key=lambda r: r[0])
        total, blocked, cpu, pub_cpu, encoded = min((measure_ours(tensors, n) for _ in range(repeats)), key=lambda r: r[0])
        rows.append({
            "subscribers": n,
            "MiB each": f"{encoded / 2**20:.0f}",
            "raw TCP s": f"{raw:.2f}",
            "ours s": f"{total:.2f}",
            "blocked s": f"{blocked:.2f}",
            "speed vs raw": f"{raw / total:.2f}",
            "raw MB/s/sub": f"{size / raw / 1e6:.0f}",
            "ours MB/s/sub": f"{encoded / total / 1e6:.0f}",
            "raw CPU s/sub": f"{raw_cpu:.2f}",
            "ours CPU s/sub": f"{cpu:.2f}",
            "raw sender CPU s": f"{raw_send_cpu:.2f}",
            "ours publisher CPU s": f"{pub_cpu:.2f}",
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        kind, *rest = argv[1:]
        if kind == "ours":
            _child_ours(int(rest[0]), int(rest[1]), int(rest[2]))
        else:
            _child_raw(int(rest[0]), int(rest[1]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=None, help=f"MiB per version (default ${ENV_SIZE} or 1024)")
    ap.add_argument("--subscribers", default="1,2,4", help="comma-separated subscriber counts")
    ap.add_argument("--repeats", type=int, default=1, help="measurements per point (best is shown)")
    a = ap.parse_args(argv)
    subs = tuple(int(x) for x in a.subscribers.split(","))
    if (a.size_mb is not None and a.size_mb < 1) or a.repeats < 1 or min(subs) < 1:
        ap.error("--size-mb, --repeats and every subscriber count must be >= 1")
    from transport import print_table  # bench/ is on sys.path when run as a script

    rows = weights_rows(a.size_mb, subs, a.repeats)
    print_table("ZeroMQ weight channel", list(rows[0]), [list(r.values()) for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
