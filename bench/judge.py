"""Judge throughput against a local OpenAI-compatible endpoint with a fixed latency.

    python bench/judge.py [--latency 0.2] [--concurrency 1,8,64] [--seconds 3] [--no-e2e]

The endpoint is worldloop/testing/fake_openai.py (a real HTTP server on loopback, in its own process so its
threads do not compete for this process's GIL) answering every request after ``--latency`` seconds. Each turn is scored by the ``llm`` scorer on both parts
(grounding + world modeling = 2 requests per turn), every prompt unique (no cache hits).

Columns, per judge concurrency c (``judge.concurrency``):
* ``scorer turns/s``: TrajectoryScorer + LLMClient in one asyncio loop (no Redis);
* ``e2e turns/s``: the same through Redis: trajectories pushed to ``rollouts``, one judge worker
  (worldloop.judge.process.JudgeWorker, batch_size = c) reading, scoring and forwarding to ``scored``;
* ``ideal``: c / (latency * 2), the limit a judge with c requests always in flight reaches;
* ``ratio``: measured / ideal. ``baseline``: the mean latency of single sequential requests with a
  plain AsyncOpenAI client measured in the same run (what one request really costs here).

    python bench/judge.py --hang [--timeout 1.0] [--retries 1] [--trajectories 3] [--concurrency 1,8,64]

measures instead how soon a judge gives up on an endpoint that accepts requests and never answers
(``tests/test_resource_faults.py`` checks what it then writes; how soon is this bench's): seconds
from the start until every turn of ``--trajectories`` trajectories holds its flagged fallback,
against ``ideal`` = (1 + ``--retries``) x the baseline, one plain AsyncOpenAI request with
``timeout=--timeout`` timing out on the same endpoint, measured in the same run. The parts of all
turns wait concurrently up to ``judge.concurrency``, so the ratio stays near 1 while the
concurrency covers the 2 x trajectories requests and grows in steps below that.
"""
from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from openai import AsyncOpenAI  # noqa: E402

from worldloop.common.contracts.config import JudgeConfig, config_from_dict  # noqa: E402
from worldloop.common.transport.control import Keys  # noqa: E402
from worldloop.common.transport.redis_local import LocalRedis  # noqa: E402
from worldloop.common.contracts.schemas import State, Trajectory, encode_trajectory  # noqa: E402
from worldloop.common.transport.streams import StreamProducer, connect  # noqa: E402
from worldloop.judge.llm import LLMClient  # noqa: E402
from worldloop.judge.process import JudgeWorker  # noqa: E402
from worldloop.judge.scoring import TrajectoryScorer  # noqa: E402
from worldloop.testing.trajectories import make_trajectory

YES = "<think>ok</think><answer>YES</answer>"
STATE = State(relations=["box0 is above and on the left side of the player",
                          "target0 is above and at the same column as the player"],
              symbolic=None, structured={})
REQUESTS_PER_TURN = 2


def trajectory(i: int, tag: str) -> Trajectory:
    t = make_trajectory(f"{tag}-{i}", turns=1)
    turn = t.turns[0]
    turn.observation, turn.prediction = f"The box is above the player ({tag} {i}).", f"The box stays above me ({tag} {i})."
    turn.state_before = turn.state_after = STATE
    return t


async def baseline_latency(url: str, n: int) -> float:
    client = AsyncOpenAI(base_url=url, api_key="x", max_retries=0)
    start = time.perf_counter()
    for i in range(n):
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"ping {i}"}])
    await client.close()
    return (time.perf_counter() - start) / n


async def score_all(cfg: JudgeConfig, trajs: list[Trajectory]) -> float:
    """Seconds a TrajectoryScorer + LLMClient (one asyncio loop, no Redis) takes to score ``trajs``."""
    llm = LLMClient(cfg)
    scorer = TrajectoryScorer(cfg, llm)
    start = time.perf_counter()
    await asyncio.gather(*(scorer.score(t) for t in trajs))
    elapsed = time.perf_counter() - start
    await llm.close()
    return elapsed


async def scorer_run(url: str, c: int, turns: int) -> float:
    cfg = JudgeConfig(base_url=url, scorers={"default": ["llm"]}, concurrency=c, cache_size=0, timeout_s=30)
    return await score_all(cfg, [trajectory(i, f"s{c}") for i in range(turns)])


def e2e_run(url: str, redis_url: str, c: int, turns: int) -> float:
    ns = f"bench{c}"
    cfg = config_from_dict({
        "redis": {"url": redis_url, "namespace": ns, "block_ms": 100, "max_backlog": 100_000},
        "judge": {"scorers": {"default": ["llm"]}, "base_url": url, "concurrency": c, "cache_size": 0,
                  "batch_size": max(8, c)},
        "metrics": {"enabled": False}})
    keys = Keys(ns)
    prod = StreamProducer(redis_url, keys.rollouts, 100_000)
    for i in range(turns):
        prod.add(encode_trajectory(trajectory(i, f"e{c}")))
    prod.close()
    r = connect(redis_url)
    worker = JudgeWorker(cfg, proc_id=f"bench-{c}")
    th = threading.Thread(target=worker.run, daemon=True)
    start = time.perf_counter()
    th.start()
    while r.xlen(keys.scored) < turns:
        time.sleep(0.01)
    elapsed = time.perf_counter() - start
    worker.stop()
    th.join(timeout=30)
    r.close()
    return elapsed


async def timeout_baseline(url: str, timeout_s: float) -> float:
    """Seconds one plain request with ``timeout=timeout_s`` takes to time out on a hanging endpoint."""
    client = AsyncOpenAI(base_url=url, api_key="x", max_retries=0, timeout=timeout_s)
    start = time.perf_counter()
    try:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "ping"}])
    except Exception:  # the timeout this measures (openai.APITimeoutError)
        pass
    elapsed = time.perf_counter() - start
    await client.close()
    return elapsed


async def hang_run(url: str, c: int, n: int, timeout_s: float, retries: int) -> float:
    """Seconds until ``n`` one-turn trajectories are scored, every part by the flagged fallback."""
    cfg = JudgeConfig(base_url=url, scorers={"default": ["llm"]}, concurrency=c, cache_size=0, timeout_s=timeout_s,
                      max_retries=retries, backoff_s=0.05)
    trajs = [trajectory(i, f"h{c}") for i in range(n)]
    elapsed = await score_all(cfg, trajs)
    if not all(turn.judge["fallback"] for t in trajs for turn in t.turns):
        raise RuntimeError("a turn was scored without the fallback: the endpoint answered")
    return elapsed


def hang_main(args) -> int:
    server = subprocess.Popen([sys.executable, "-m", "worldloop.testing.fake_openai", "--hang"], stdout=subprocess.PIPE,
                              text=True)
    rows = []
    try:
        url = server.stdout.readline().strip()
        base = asyncio.run(timeout_baseline(url, args.timeout))
        ideal = (1 + args.retries) * base
        for c in [int(x) for x in args.concurrency.split(",") if x.strip()]:
            s = asyncio.run(hang_run(url, c, args.trajectories, args.timeout, args.retries))
            rows.append([c, args.trajectories, f"{s:.2f}", f"{ideal:.2f}", f"{s / ideal:.2f}"])
    finally:
        server.terminate()
        server.wait(timeout=10)
    print_table(f"judge fallback on a hanging endpoint: judge.timeout_s {args.timeout}, max_retries {args.retries}, "
                f"{REQUESTS_PER_TURN} requests/turn (baseline: one plain request timing out = {base:.2f} s)",
                ["concurrency", "trajectories", "fallback s", "ideal s", "fallback/ideal"], rows)
    return 0


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    print(f"\n{title}")
    for row in [header, *rows]:
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--latency", type=float, default=0.2, help="endpoint latency in seconds")
    ap.add_argument("--concurrency", default="1,8,64", help="comma-separated judge.concurrency values")
    ap.add_argument("--seconds", type=float, default=3.0, help="ideal duration of each run (sets the turn count)")
    ap.add_argument("--no-e2e", action="store_true", help="skip the run through Redis and a judge worker")
    ap.add_argument("--hang", action="store_true", help="time the fallback on an endpoint that never answers instead")
    ap.add_argument("--timeout", type=float, default=1.0, help="--hang: judge.timeout_s")
    ap.add_argument("--retries", type=int, default=1, help="--hang: judge.max_retries")
    ap.add_argument("--trajectories", type=int, default=3, help="--hang: one-turn trajectories to score")
    args = ap.parse_args(argv)
    if args.hang:
        return hang_main(args)
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    rows = []
    redis_srv = None if args.no_e2e else LocalRedis().start()
    server = subprocess.Popen([sys.executable, "-m", "worldloop.testing.fake_openai", "--delay", str(args.latency),
                               "--answer", YES], stdout=subprocess.PIPE, text=True)
    try:
        url = server.stdout.readline().strip()
        base = asyncio.run(baseline_latency(url, 5))
        for c in levels:
            ideal = c / (args.latency * REQUESTS_PER_TURN)
            turns = max(4, int(ideal * args.seconds))
            s = turns / asyncio.run(scorer_run(url, c, turns))
            row = [c, turns, f"{s:.2f}"]
            if redis_srv is not None:
                e = turns / e2e_run(url, redis_srv.url, c, turns)
                row.append(f"{e:.2f}")
            row += [f"{ideal:.2f}", f"{s / ideal:.2f}"]
            if redis_srv is not None:
                row.append(f"{e / ideal:.2f}")
            rows.append(row)
    finally:
        server.terminate()
        server.wait(timeout=10)
        if redis_srv is not None:
            redis_srv.close()
    header = ["concurrency", "turns", "scorer turns/s"] + (["e2e turns/s"] if redis_srv else []) + \
             ["ideal turns/s", "scorer/ideal"] + (["e2e/ideal"] if redis_srv else [])
    print_table(f"judge throughput, endpoint latency {args.latency * 1000:.0f} ms, {REQUESTS_PER_TURN} requests/turn "
                f"(baseline: one request with plain AsyncOpenAI = {base * 1000:.1f} ms)", header, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
