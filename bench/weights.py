"""Weight versions on the wire: full snapshots against delta versions, with real optimizer steps.

    python bench/weights.py                                  # tiny and 0.5b shapes, lr 1e-6 and 1e-5
    python bench/weights.py --sizes tiny --lrs 1e-6 --steps 2
    python bench/weights.py --no-full --lora-rank 16           # only the LoRA rows

For each model shape and learning rate: a model in fp32 takes ``--steps`` real AdamW steps on random
tokens (next-token loss), and after each step its weights, cast to ``--dtype`` (bf16, what a GPU
learner publishes), are handed to a real :class:`WeightPublisher` as a new version. Two real
:class:`WeightSubscriber` s fetch every version over loopback ZeroMQ:

* **full** (the baseline, measured in the same run on the same versions): ``deltas=False``, so it
  receives every version as the whole snapshot;
* **delta**: holds the previous version and receives the delta (zstd of the byte-plane-split XOR,
  ``common/transport/weights/delta.py``), rebuilds the snapshot and checks its whole-set hash.

Columns: bytes on the wire per version and their ratio to the snapshot; "prepare s" is the
publisher's time from hand-over to serving (checksums and the delta: it runs behind the learner,
never in its step); "fetch s" is each subscriber's time to hold the verified tensors over loopback
(where moving 1 GB costs a memcpy, so it favours the snapshot; a remote actor's link makes the
wire bytes count); "apply s" is the subscriber's work on bytes it holds, timed apart (the best of 3):
for the snapshot, copying the received bytes into a fresh buffer (as the subscriber does with each
chunk), the whole-set hash and the decode; for the delta, rebuilding the encoding into a fresh
buffer from the base with the hash fed block by block as the subscriber does it (``apply_delta``'s
pipeline: decompression, rebuild and hash overlap on threads), and the decode; "apply/full" is
their ratio (goal <= 1.5). Both
pay for a fresh buffer's page faults, as the subscriber does for every version. The first version has
no delta (nothing before it) and is not in the table. Both subscribers' tensors are compared bit
for bit with the learner's.

* **lora** (``--lora-rank``, default 16; 0 = skip): the same shape with peft LoRA adapters on
  q/k/v/o/gate/up/down (``model.lora``, ``common/lora.py``); only the adapters take the AdamW steps
  and a version is the adapter tensors alone, as a LoRA learner publishes them, fetched by a third
  subscriber. Its "apply s" is copying the fetched tensors into an actor-side copy of the adapted
  model (what ``HFBackend.update_weights`` does); "lora/snap" is its bytes on the wire against the
  full model's snapshot (the table's "snapshot MB").

Shapes: ``tiny`` is a Qwen2-style decoder of hidden 256, 4 layers, vocab 8,192 (7 M parameters);
``0.5b`` is Qwen2.5-0.5B's text shape (hidden 896, 24 layers, 14/2 heads, intermediate 4,864,
vocab 151,936: 494 M parameters, about 1 GB in bf16; its fp32 AdamW state takes about 8 GB of RAM).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from worldloop.common.transport.weights import WeightPublisher, WeightSubscriber, decode_tensors  # noqa: E402
from worldloop.common.transport.weights.codec import new_hasher  # noqa: E402
from worldloop.common.transport.weights.delta import apply_delta  # noqa: E402

SHAPES = {
    "tiny": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=8192),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
}


def make_model(size: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**SHAPES[size]))


def snapshot(model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(dtype).clone() for k, v in model.state_dict().items()}


def same_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)


def timed_fetch(sub: WeightSubscriber, version: int) -> tuple[float, dict[str, torch.Tensor]]:
    t0 = time.perf_counter()
    got = sub.fetch(version - 1)
    took = time.perf_counter() - t0
    if got is None or got[0] != version:
        raise RuntimeError(f"fetched {got and got[0]}, expected v{version}")
    return took, got[1]


def best_of(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def apply_times(prev, served) -> tuple[float, float]:
    """(snapshot apply s, delta apply s): receive + hash + decode, against rebuild (hash fed as it goes) + decode."""
    def verify(arr):
        h = new_hasher(served.manifest.hash)
        h.update(memoryview(arr))
        assert h.hexdigest() == served.manifest.digest
        decode_tensors(arr)

    def receive(arr):
        out = np.empty(len(arr), dtype=np.uint8)
        out[:] = arr
        return out

    def rebuild():  # as the subscriber does it: the hash fed block by block while the delta is applied
        h = new_hasher(served.manifest.hash)
        arr = apply_delta(prev, served.delta.data, hasher=h)
        assert h.hexdigest() == served.manifest.digest
        decode_tensors(arr)

    full = best_of(lambda: verify(receive(served.buf.arr)))
    delta = best_of(rebuild) if served.delta else float("nan")
    return full, delta


def run(size: str, lr: float, steps: int, dtype: torch.dtype, tokens: int) -> list[dict]:
    model = make_model(size)
    vocab = model.config.vocab_size
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rows = []
    with WeightPublisher("127.0.0.1") as pub:
        full = WeightSubscriber("127.0.0.1", pub.pub_port, pub.fetch_port, fetch_timeout_s=600, deltas=False)
        delta = WeightSubscriber("127.0.0.1", pub.pub_port, pub.fetch_port, fetch_timeout_s=600)
        try:
            for version in range(1, steps + 2):
                if version > 1:  # one real optimizer step between versions
                    x = torch.randint(0, vocab, (1, tokens))
                    model(input_ids=x, labels=x).loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                want = snapshot(model, dtype)
                t0 = time.perf_counter()
                pub.publish(want, version, owned=True, wait=True)
                prepare = time.perf_counter() - t0
                full_s, got_full = timed_fetch(full, version)
                delta_s, got_delta = timed_fetch(delta, version)
                if not (same_bits(got_full, want) and same_bits(got_delta, want)):
                    raise RuntimeError(f"v{version}: a subscriber does not hold the learner's weights")
                served = pub._current
                if version > 1:
                    full_apply, delta_apply = apply_times(prev, served)
                    rows.append({"size": size, "lr": lr, "version": version, "full_bytes": served.manifest.size,
                                 "delta_bytes": served.delta.manifest.size if served.delta else None,
                                 "prepare_s": prepare, "full_s": full_s, "delta_s": delta_s,
                                 "full_apply": full_apply, "delta_apply": delta_apply,
                                 "used_delta": delta.stats["delta_fetches"] == version - 1})
                prev = served.buf.arr.copy()
                del got_full, got_delta, want
        finally:
            full.close()
            delta.close()
    return rows


def run_lora(size: str, lr: float, steps: int, dtype: torch.dtype, tokens: int, rank: int) -> list[dict]:
    """Adapter-only versions of a rank-``rank`` LoRA on ``size``: bytes, prepare, fetch and apply seconds."""
    from worldloop.common.contracts.config import LoraConfig
    from worldloop.common.lora import adapter_tensors, attach

    lora = LoraConfig(rank=rank, alpha=2.0 * rank)
    model = make_model(size)
    full_bytes = sum(t.numel() for t in model.state_dict().values()) * torch.finfo(dtype).bits // 8
    policy = attach(model, lora).get_base_model()
    actor = attach(make_model(size).to(dtype), lora).get_base_model()  # the actor's copy, in the wire dtype
    vocab = policy.config.vocab_size
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=lr)
    rows = []
    with WeightPublisher("127.0.0.1") as pub:
        sub = WeightSubscriber("127.0.0.1", pub.pub_port, pub.fetch_port, fetch_timeout_s=600, deltas=False)
        try:
            for version in range(1, steps + 2):
                if version > 1:
                    x = torch.randint(0, vocab, (1, tokens))
                    policy(input_ids=x, labels=x).loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                want = {k: v.to(dtype).clone() for k, v in adapter_tensors(policy).items()}
                t0 = time.perf_counter()
                pub.publish(want, version, owned=True, wait=True)
                prepare = time.perf_counter() - t0
                fetch_s, got = timed_fetch(sub, version)
                if not same_bits(got, want):
                    raise RuntimeError(f"v{version}: the subscriber does not hold the learner's adapters")
                own = actor.state_dict()

                def apply(got=got, own=own):
                    with torch.no_grad():
                        for k, t in got.items():
                            own[k].copy_(t)

                apply_s = best_of(apply)
                if version > 1:
                    rows.append({"size": size, "lr": lr, "version": version, "full_bytes": full_bytes,
                                 "lora_bytes": pub._current.manifest.size, "prepare_s": prepare, "fetch_s": fetch_s,
                                 "apply_s": apply_s, "tensors": len(want)})
                del got, want
        finally:
            sub.close()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="tiny,0.5b")
    ap.add_argument("--lrs", default="1e-6,1e-5")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps (versions after the first) per row group")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--tokens", type=int, default=32, help="tokens of the random batch of each step")
    ap.add_argument("--lora-rank", type=int, default=16, help="rank of the LoRA rows (0: no LoRA rows)")
    ap.add_argument("--no-full", action="store_true", help="only the LoRA rows")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"# bench/weights.py on {platform.node()} ({platform.processor() or platform.machine()}), torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d')}; weights in {args.dtype}")
    print(f"{'size':<5} {'lr':>6} {'v':>2} {'snapshot MB':>12} {'delta MB':>9} {'delta/snap':>10} {'prepare s':>9} "
          f"{'fetch s full':>12} {'fetch s delta':>13} {'apply s full':>12} {'apply s delta':>13} {'apply/full':>10}")
    for size in args.sizes.split(",") if not args.no_full else []:
        for lr in [float(x) for x in args.lrs.split(",")]:
            for r in run(size, lr, args.steps, dtype, args.tokens):
                d = r["delta_bytes"]
                ratio = f"{d / r['full_bytes']:.2%}" if d else "no delta"
                print(f"{size:<5} {lr:>6.0e} {r['version']:>2} {r['full_bytes'] / 1e6:>12.2f} "
                      f"{(d or 0) / 1e6:>9.3f} {ratio:>10} {r['prepare_s']:>9.3f} {r['full_s']:>12.3f} "
                      f"{r['delta_s']:>13.3f} {r['full_apply']:>12.3f} {r['delta_apply']:>13.3f} "
                      f"{r['delta_apply'] / r['full_apply']:>9.2f}x" + ("" if r["used_delta"] else "  (full)"))
    if args.lora_rank:
        print(f"\n{'size':<5} {'lr':>6} {'v':>2} {'rank':>4} {'snapshot MB':>12} {'lora MB':>8} {'lora/snap':>9} "
              f"{'tensors':>7} {'prepare s':>9} {'fetch s':>8} {'apply s':>8}")
        for size in args.sizes.split(","):
            for lr in [float(x) for x in args.lrs.split(",")]:
                for r in run_lora(size, lr, args.steps, dtype, args.tokens, args.lora_rank):
                    print(f"{size:<5} {lr:>6.0e} {r['version']:>2} {args.lora_rank:>4} {r['full_bytes'] / 1e6:>12.2f} "
                          f"{r['lora_bytes'] / 1e6:>8.3f} {r['lora_bytes'] / r['full_bytes']:>9.2%} {r['tensors']:>7} "
                          f"{r['prepare_s']:>9.4f} {r['fetch_s']:>8.4f} {r['apply_s']:>8.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
