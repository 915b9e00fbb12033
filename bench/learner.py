"""Learner throughput: tokens/s and model FLOPs utilisation of one PPO update, DeepSpeed vs plain torch.

    python bench/learner.py --size tiny                       # CPU smoke run (a minute)
    python bench/learner.py --size 0.5b --size 3b             # on a GPU (bf16)
        [--engines torch,zero2,zero3] [--steps 3] [--peak-tflops 989] [--json out.json]

What one update is: ``learner.trainer.PPOTrainer.update`` exactly as the learner runs it, on
``train_batch_size`` synthetic trajectories (3 turns, long observations): no-grad proximal,
reference and critic forwards, then one epoch of PPO mini-batches (policy forward + backward,
critic forward + backward), optimizer steps. Data comes from memory (no Redis); the weight publish
(gather + encode into the ZeroMQ publisher) is timed once after the update steps.

Models: randomly initialised from the architecture's config, built in memory on the device.

* ``tiny``: the embedded tiny Qwen2.5-VL (with images), fp32 on CPU;
* ``0.5b``: Qwen2.5-0.5B shape (Qwen2ForCausalLM: hidden 896, 24 layers, 14/2 heads, vocab
  151936), bilevel_gae with critic and reference, micro-batch 4;
* ``3b``: Qwen2.5-VL-3B shape (text hidden 2048, 36 layers, 16/2 heads; vision tower depth 32),
  text-only trajectories, GRPO (no critic: policy and critic with full fp32 Adam states would not
  fit next to each other on one GPU), reference on, gradient checkpointing, micro-batch 2.

Engines, each in its own subprocess (clean memory, one failure does not end the table):
``torch`` = the baseline, the same trainer with a plain-torch engine (bf16 parameters, fused
torch AdamW, no DeepSpeed); ``zero2`` / ``zero3`` = DeepSpeed with a client torch AdamW, bf16
(fp32 master weights in the optimizer).

Model FLOPs (the MFU numerator, PaLM convention): a forward over a sequence of s tokens costs
2*N*s + 4*n_layers*d_attn*s^2, a backward twice that; N counts the parameters the text path uses
(embedding/LM head once, vision tower excluded: the trajectories have no images), the critic's
N excludes the LM head. Per update: 3 forwards (proximal, reference, values) + ppo_epochs x
(policy fwd+bwd + critic fwd+bwd). Gradient-checkpointing recompute is not counted. MFU = model
FLOPs / step time / peak; the peak is --peak-tflops, else 989 TFLOP/s (bf16 dense spec) on an
H100/H200; on CPU no MFU is printed. tokens/s counts the non-padding tokens of the batch.

Measured on one NVIDIA H200 (PyTorch 2.11 + CUDA 13, transformers 5.17, DeepSpeed 0.19.8,
``python3 bench/learner.py --size 3b --size 0.5b --engines torch,zero2,zero3 --steps 4``; 16
trajectories of 3 turns, 17,728 tokens per update, median of 4 updates after one warm-up; MFU
against 989 TFLOP/s; publish = gather + encode + hash of the full policy for the weight channel):

| size | engine | s/update | tokens/s | vs torch | MFU | peak GB | publish s |
|---|---|---|---|---|---|---|---|
| 3b (GRPO, grad. ckpt) | torch (bf16 AdamW) | 2.87 | 6,182 | 1.00 | 0.203 | 36.4 | 8.72 |
| 3b (GRPO, grad. ckpt) | ZeRO-2 | 3.42 | 5,183 | 0.84 | 0.170 | 87.9 | 7.39 |
| 3b (GRPO, grad. ckpt) | ZeRO-3 | 7.94 | 2,233 | 0.36 | 0.073 | 74.1 | 10.53 |
| 0.5b (critic + ref) | torch (bf16 AdamW) | 1.13 | 15,678 | 1.00 | 0.137 | 22.3 | 1.03 |
| 0.5b (critic + ref) | ZeRO-2 | 1.46 | 12,119 | 0.77 | 0.106 | 29.6 | 0.95 |
| 0.5b (critic + ref) | ZeRO-3 | 4.00 | 4,434 | 0.28 | 0.039 | 31.5 | 1.40 |

(An earlier run, --steps 3, also had ZeRO-0 bf16 at 0.5b: 12,251 tokens/s, 0.93 x torch, MFU 0.107.)
The torch baseline keeps bf16 parameters and bf16 Adam states; DeepSpeed keeps fp32 master
weights and fp32 Adam states (hence its memory), which is what the learner needs for lr 1e-6.
ZeRO-3 on one GPU only costs (parameter gathers per module, no memory to save on one device);
it pays off across ranks. At 3B the weight publish takes longer than the update itself.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                  tie_word_embeddings=True, rms_norm_eps=1e-6)
QWEN25_VL_3B_TEXT = dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                         num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=128000,
                         tie_word_embeddings=True, rms_norm_eps=1e-6)
QWEN25_VL_3B_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=112, out_hidden_size=2048,
                           fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu")

SIZES = {
    # trainer overrides, trajectory shape
    "tiny": dict(trainer=dict(train_batch_size=8, ppo_mini_batch_size=4, micro_batch_size=2, estimator="bilevel_gae"),
                 turns=2, filler=0, response=24, images=True),
    "0.5b": dict(trainer=dict(train_batch_size=16, ppo_mini_batch_size=8, micro_batch_size=4, estimator="bilevel_gae"),
                 turns=3, filler=220, response=110, images=False),
    "3b": dict(trainer=dict(train_batch_size=16, ppo_mini_batch_size=8, micro_batch_size=2, estimator="grpo",
                            use_critic=False, gradient_checkpointing=True),
               turns=3, filler=220, response=110, images=False),
}


# --------------------------------------------------------------------------- baseline engine


class TorchEngine:
    """The part of DeepSpeed's engine API the trainer uses, on plain torch (the baseline)."""

    def __init__(self, module: torch.nn.Module, lr: float, conf: dict, device: torch.device, dtype: torch.dtype):
        self.module = module.to(device=device, dtype=dtype)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=lr, weight_decay=0.0, fused=device.type == "cuda")
        self.gas = int(conf["gradient_accumulation_steps"])
        self.clip = float(conf["gradient_clipping"])
        self.micro = 0
        self.norm = None

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def gradient_accumulation_steps(self) -> int:
        return self.gas

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro + 1) % self.gas == 0

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.gas).backward()

    def step(self) -> None:
        if self.is_gradient_accumulation_boundary():
            self.norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.clip))
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        self.micro += 1

    def get_global_grad_norm(self):
        return self.norm


# --------------------------------------------------------------------------- one variant


def _models_for(size: str, tiny_dir: Path, device: torch.device, dtype: torch.dtype):
    """(policy, critic backbone, reference) built in memory, and the parameter counts for FLOPs."""
    from transformers import AutoModel, Qwen2_5_VLConfig, Qwen2Config

    from common.modeling import load_policy
    from learner.engine import load_backbone

    if size == "tiny":
        return load_policy(tiny_dir, dtype=dtype), load_backbone(tiny_dir), load_policy(tiny_dir, dtype=dtype)
    if size == "0.5b":
        config = Qwen2Config(**QWEN25_05B, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
        from transformers import Qwen2ForCausalLM as cls
    else:
        text = dict(QWEN25_VL_3B_TEXT, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0,
                                                       "mrope_section": [16, 24, 24]})
        config = Qwen2_5_VLConfig(text_config=text, vision_config=QWEN25_VL_3B_VISION, image_token_id=151655,
                                  video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
                                  tie_word_embeddings=True)
        from transformers import Qwen2_5_VLForConditionalGeneration as cls
    config._attn_implementation = "sdpa"
    with torch.device(device):
        torch.manual_seed(0)
        policy = cls._from_config(config, dtype=dtype)
        reference = cls._from_config(config, dtype=dtype)
        backbone = AutoModel.from_config(config, dtype=dtype) if SIZES[size]["trainer"].get("use_critic", True) else None
    return policy, backbone, reference


def _text_params(model: torch.nn.Module) -> tuple[int, int, int, int]:
    """(N of the text path incl. the tied LM head once, LM head params, layers, attention width)."""
    n = sum(p.numel() for name, p in model.named_parameters() if "visual" not in name)
    text = model.config.get_text_config()
    head = text.vocab_size * text.hidden_size
    heads = text.num_attention_heads
    return n, head, text.num_hidden_layers, heads * (text.hidden_size // heads)


def update_flops(lengths: list[int], n_policy: int, n_head: int, layers: int, d_attn: int, critic: bool, epochs: int) -> float:
    fwd_p = sum(2 * n_policy * s + 4 * layers * d_attn * s * s for s in lengths)
    fwd_c = sum(2 * (n_policy - n_head) * s + 4 * layers * d_attn * s * s for s in lengths) if critic else 0.0
    return 2 * fwd_p + fwd_c + epochs * 3 * (fwd_p + fwd_c)


def run_variant(size: str, engine: str, steps: int, out: Path) -> dict:
    from common.config import config_from_dict
    from common.modeling import ChatCodec
    from common.tiny_model import make_tiny_model
    from common.weights import WeightPublisher
    from learner.engine import DistInfo, assemble_models, gather_policy_weights, init_distributed
    from learner.synthetic import synthetic_trajectory
    from learner.trainer import PPOTrainer

    spec = SIZES[size]
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    tmp = Path(tempfile.mkdtemp(prefix="bench-learner-"))
    # the tokenizer (and, for "tiny", the model); text-only trajectories for the large shapes
    tiny_dir = make_tiny_model(tmp / "tiny", arch="qwen2_5_vl" if spec["images"] else "qwen2", max_image_side=112)
    trainer = dict(spec["trainer"], zero_stage=3 if engine == "zero3" else 2 if engine == "zero2" else 0,
                   total_steps=steps, kl_coef=0.001, device="cuda" if cuda else "cpu")
    cfg = config_from_dict({"model": {"path": str(tiny_dir), "max_image_side": 112, "max_model_len": 8192},
                            "trainer": trainer})
    codec = ChatCodec(tiny_dir, max_image_side=112)
    if engine == "torch":
        dist = DistInfo(0, 1, 0, device, "none")
        make = lambda module, lr, conf: TorchEngine(module, lr, conf, device, dtype)  # noqa: E731
    else:
        dist = init_distributed(cfg)
        make = None
    policy, backbone, reference = _models_for(size, tiny_dir, device, dtype)
    n_policy, n_head, layers, d_attn = _text_params(policy)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    models = assemble_models(cfg, dist, codec, policy, backbone, reference, engine_fn=make)
    ppo = PPOTrainer(cfg, models, seed=0)
    batch_size = cfg.trainer.train_batch_size
    results = []
    for step in range(steps + 1):  # the first update warms up (allocator, kernels) and is not counted
        trajs = [synthetic_trajectory(codec, trajectory_id=f"b{step}-{i}", seed=step * 1000 + i, turns=spec["turns"],
                                      response_tokens=spec["response"], filler_tokens=spec["filler"],
                                      group_id=f"g{i // 4}", env_reward=float(i % 3)) for i in range(batch_size)]
        lengths = [sum(len(t["obs_ids"]) + len(t["response_ids"]) for t in x["turns"]) for x in trajs]
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        stats = ppo.update(trajs, step)
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        flops = update_flops(lengths, n_policy, n_head, layers, d_attn, models.critic is not None, cfg.trainer.ppo_epochs)
        results.append({"seconds": dt, "tokens": sum(lengths), "flops": flops, "forward": stats["forward_seconds"],
                        "backward": stats["backward_seconds"], "loss": stats.get("policy_loss")})
        print(f"  {size} {engine} update {step}: {dt:.2f}s, {sum(lengths) / dt:,.0f} tok/s", flush=True)
    pub = WeightPublisher("127.0.0.1", 0, 0)
    t0 = time.perf_counter()
    weights = gather_policy_weights(models)
    pub.publish(weights, 1)
    publish_s = time.perf_counter() - t0
    pub.close()
    timed = results[1:]
    row = {
        "size": size, "engine": engine, "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "params_text": n_policy, "tokens_per_update": timed[0]["tokens"],
        "seconds": statistics.median(r["seconds"] for r in timed),
        "tokens_per_s": statistics.median(r["tokens"] for r in timed) / statistics.median(r["seconds"] for r in timed),
        "flops_per_s": statistics.median(r["flops"] for r in timed) / statistics.median(r["seconds"] for r in timed),
        "forward_s": statistics.median(r["forward"] for r in timed),
        "backward_s": statistics.median(r["backward"] for r in timed),
        "publish_s": publish_s,
        "peak_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    }
    out.write_text(json.dumps(row))
    del models, ppo, policy, backbone, reference, weights
    gc.collect()
    return row


# --------------------------------------------------------------------------- table


def peak_flops(arg: float | None) -> float | None:
    if arg:
        return arg * 1e12
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        if "H100" in name or "H200" in name:
            return 989e12
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", action="append", choices=sorted(SIZES), help="model size (repeatable); default tiny")
    ap.add_argument("--engines", default="torch,zero2,zero3")
    ap.add_argument("--steps", type=int, default=3, help="timed updates per variant (after one warm-up)")
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--json", default=None, help="write all rows here")
    ap.add_argument("--one", nargs=3, metavar=("SIZE", "ENGINE", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        run_variant(args.one[0], args.one[1], args.steps, Path(args.one[2]))
        return 0
    sizes = args.size or ["tiny"]
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    peak = peak_flops(args.peak_tflops)
    rows = []
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".torch_extensions"))
    env.setdefault("PYTHONUNBUFFERED", "1")
    with tempfile.TemporaryDirectory() as d:
        for size in sizes:
            for engine in engines:
                out = Path(d) / f"{size}-{engine}.json"
                t0 = time.monotonic()
                proc = subprocess.run([sys.executable, __file__, "--one", size, engine, str(out), "--steps", str(args.steps)],
                                      env=env, cwd=ROOT)
                if proc.returncode != 0 or not out.exists():
                    print(f"{size} {engine}: failed (exit {proc.returncode})", flush=True)
                    rows.append({"size": size, "engine": engine, "failed": proc.returncode})
                    continue
                row = json.loads(out.read_text())
                row["wall_s"] = time.monotonic() - t0
                rows.append(row)
                if args.json:  # after every variant, so a run cut short keeps what it measured
                    Path(args.json).write_text(json.dumps(rows, indent=2))
    print()
    print(f"| size | engine | tokens/update | s/update | tokens/s | vs torch | MFU | fwd s | bwd s | publish s | peak GB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "failed" in r:
            print(f"| {r['size']} | {r['engine']} | failed (exit {r['failed']}) |||||||||")
            continue
        base = next((b for b in rows if b.get("size") == r["size"] and b.get("engine") == "torch" and "failed" not in b), None)
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "-"
        mfu = f"{r['flops_per_s'] / peak:.3f}" if peak else "-"
        peak_gb = f"{r['peak_gb']:.1f}" if r.get("peak_gb") is not None else "-"
        print(f"| {r['size']} | {r['engine']} | {r['tokens_per_update']:,} | {r['seconds']:.2f} | {r['tokens_per_s']:,.0f} | "
              f"{ratio} | {mfu} | {r['forward_s']:.2f} | {r['backward_s']:.2f} | {r['publish_s']:.2f} | {peak_gb} |")
    if peak:
        print(f"\nMFU against {peak / 1e12:.0f} TFLOP/s (bf16 dense peak); model FLOPs as in the module docstring.")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
