"""Rollout throughput of the actor's backends: HF transformers (baseline), the in-process vLLM engine
and a vLLM inference server (``actor.backend: server``).

    python bench/actor.py [--episodes 16] [--concurrency 8] [--max-turns 3] [--max-new-tokens 64]

All three play the same FrozenLake episodes (vision mode, one image per turn) through
``worldloop.actor.episodes.play_episodes`` with the embedded tiny Qwen2.5-VL model, seeded sampling
at temperature 0.7 / top-p 0.95, one after the other (never two engines at once). The server is
a ``worldloop serve`` process on this machine (same dtype, context and KV-cache size as the
in-process engine), reached over loopback HTTP; its start-up is not timed. The table gives
episodes/s, generated tokens/s and the ratio to the HF baseline measured in the same run. The
vLLM rows are skipped when vLLM is not installed. One warm-up episode per backend is excluded.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _model(path: Path) -> Path:
    import worldloop.bootstrap.tiny_model as tiny

    return tiny.make_tiny_model(path, seed=0, max_image_side=112)


def _play(backend, args) -> tuple[float, int, int]:
    from worldloop.actor.episodes import play_episodes
    from worldloop.actor.rollout import EpisodeSpec, Sampling

    kw = {"size": 4, "is_slippery": False, "render_mode": "vision", "image_size": 112}
    sampling = Sampling(0.7, 0.95, args.max_new_tokens)
    play_episodes(backend, [EpisodeSpec("worldloop/FrozenLake-v0", 10_000, kw, max_turns=1)], sampling=sampling,
                  max_model_len=4096, sample_seed=1)  # warm-up
    specs = [EpisodeSpec("worldloop/FrozenLake-v0", s, kw, max_turns=args.max_turns) for s in range(args.episodes)]
    t0 = time.perf_counter()
    trajs = play_episodes(backend, specs, concurrency=args.concurrency, sampling=sampling, max_model_len=4096, sample_seed=0)
    seconds = time.perf_counter() - t0
    tokens = sum(len(t.response_ids) for tr in trajs for t in tr.turns)
    return seconds, len(trajs), tokens


def _serve(model: Path, tmp: Path, name: str = "serve", **sections: dict) -> tuple[str, subprocess.Popen]:
    """A ``worldloop serve`` for ``model`` on a free port, once it answers ready; ``sections`` are
    more config sections (default: no weight channel), ``name`` names its config and log files."""
    import yaml

    from worldloop.common.metrics import free_port

    cfg = tmp / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"path": str(model), "dtype": "float32", "max_model_len": 4096,
                                             "max_image_side": 112},
                                   "weights": {"pub_port": 0, "fetch_port": 0}, **sections}))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(tmp / f"{name}.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "worldloop", "serve", "--config", str(cfg), "--port", str(port)],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url + "/worldloop/info", timeout=5) as resp:
                if json.loads(resp.read())["ready"]:
                    return url, proc
        except OSError:
            pass
        time.sleep(1.0)
    _stop(proc)
    raise RuntimeError(f"the inference server did not start; see {tmp / f'{name}.log'}")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (vLLM's engine and workers too), SIGKILL after 60 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def _vllm_rows(model: Path, tmp: Path, args) -> list[tuple]:
    try:
        from worldloop.actor.vllm_backend import VLLMBackend
    except ImportError as e:
        print(f"vllm not installed ({e}); only the baseline")
        return []
    rows = []
    vb = VLLMBackend(model, max_model_len=4096, max_image_side=112, dtype="float32")
    try:
        rows.append(("vllm", *_play(vb, args)))
    finally:
        vb.close()
    from worldloop.actor.server.client import ServerBackend

    url, proc = _serve(model, tmp)
    try:
        sb = ServerBackend([url], model, max_image_side=112, max_model_len=4096)
        try:
            rows.append(("server", *_play(sb, args)))
        finally:
            sb.close()
    finally:
        _stop(proc)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-turns", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    from worldloop import envs  # noqa: F401
    from worldloop.actor.hf_backend import HFBackend

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = _model(Path(tmp) / "vl")
        hf = HFBackend(model, max_image_side=112)
        rows.append(("hf (baseline)", *_play(hf, args)))
        hf.close()
        rows += _vllm_rows(model, Path(tmp), args)
    base = rows[0][3] / rows[0][1]
    print(f"\n{args.episodes} episodes x {args.max_turns} turns, concurrency {args.concurrency}, "
          f"max_new_tokens {args.max_new_tokens}")
    print(f"{'backend':<15}{'seconds':>9}{'episodes/s':>12}{'tokens':>8}{'tokens/s':>10}{'ratio':>7}")
    for name, seconds, n, tokens in rows:
        print(f"{name:<15}{seconds:>9.2f}{n / seconds:>12.2f}{tokens:>8d}{tokens / seconds:>10.1f}{tokens / seconds / base:>7.2f}")


if __name__ == "__main__":
    main()
