"""Learner throughput: tokens/s and model FLOPs utilisation of one PPO update, DeepSpeed vs plain torch.

    python bench/learner.py --size tiny --packing on,off --lengths varied    # CPU: packed vs padded rows
    python bench/learner.py --size tiny --preset tiny-frozenlake --packing on,off --lengths varied   # as the preset trains
    python bench/learner.py --size 0.5b --size 3b                             # on a GPU (bf16)
        [--engines torch,zero2,zero3] [--steps 3] [--peak-tflops 989] [--json out.json]
        [--lengths fixed|varied] [--micro-tokens 0,auto,4096] [--batch TRAIN,MINI,MICRO]
        [--packing on,off] [--checkpointing default,full,selective,none] [--offload none,cpu] [--vision-cache on,off]
        [--proximal first,whole] [--group-start own,shared] [--preset NAME|YAML]
        [--logprobs chunked,full] [--logprob-chunk 512]
    python bench/learner.py --size tiny-bigvocab --engines torch --logprobs chunked,full --steps 1   # CPU, 3 min

Every comma list runs one variant per value (their product), each in its own subprocess (clean
memory; one failure does not end the table). Measured tables, commands, machines and dates are in
docs/benchmarks.md (Learner).

What one update is: ``worldloop.learner.trainer.PPOTrainer.update`` exactly as the learner runs it, on
``train_batch_size`` synthetic trajectories: no-grad proximal, reference and critic forwards, then
one epoch of PPO mini-batches (policy forward + backward, critic forward + backward), optimizer
steps. Data comes from memory (no Redis); the weight publish (gather + encode into the ZeroMQ
publisher) is timed once after the update steps. ``--lengths varied`` draws each trajectory's
turns (1 to the size's turns, x2.5 for tiny) and response length (1/4 to 1x) from a seeded RNG;
the batch is the same for every variant.

``--preset`` takes a preset's ``trainer`` section (batch sizes, ``micro_batch_tokens``, epochs,
estimator, critic, ``kl_coef``; not ``total_steps``) and its GRPO group size
(``actor.n_samples_per_seed``) over the size's own, so one update is shaped as that preset's learner
runs it; ``--batch`` and ``--micro-tokens`` still override it.

Variants: ``--packing`` on = ``trainer.packing`` (whole trajectories packed into one row per
micro-batch, learner/microbatch.py), off = padded rows; ``--micro-tokens`` (default: the preset's,
else 0) 0 = micro_batch_size trajectories per micro-batch, N = a token budget, auto = the
trainer's (CPU: micro_batch_size x the longest; CUDA: the memory model's); ``--checkpointing`` = ``trainer.activation_checkpointing``
(default: the size's own); ``--offload cpu`` = ZeRO's ``offload_optimizer`` on the host
(``trainer.offload_optimizer``); ``--vision-cache off`` = every pass runs the frozen vision tower
(``trainer.vision_cache``, learner/vision.py); ``--proximal whole`` = the no-grad proximal pass over every
row (``trainer.proximal_from_first_pass: false``; ``first``, the default, leaves the first mini-batch's to its
training forward where the trainer allows it); ``--group-start shared`` = each GRPO group's trajectories
start from one observation (the same first image and tokens, as a group of one level does: its PNG is
processed and run through the tower once per update); ``--logprobs full`` = the counterfactual of the chunked LM head
(the whole [N, V] logits with autograd, patched into the variant's process only). Below the table, a
line per variant whose ``--proximal`` or ``--group-start`` is not the baseline's gives its CPU seconds
per update against that twin's.

Columns: ``pad`` the share of the computed token slots (all forwards of the update) that are
padding; ``micro`` micro-batches per update; ``cpu s`` the process's CPU time per update (steadier
than wall time on a shared machine); ``peak GB`` the CUDA peak (GiB) on a GPU, the process's peak
RSS on CPU (VmHWM reset after the models are built); ``model GB`` the memory model's prediction
(``worldloop.learner.memory``, GiB) beside it. A variant the memory model says does not fit (the
GPU's memory, or the machine's available memory) is skipped before any model is built.

Models: randomly initialised from the architecture's config, built in memory on the device.
``tiny``: the embedded tiny Qwen2.5-VL (with images), fp32 on CPU; ``0.5b``: Qwen2.5-0.5B shape,
bilevel_gae with critic and reference; ``3b``: Qwen2.5-VL-3B shape (vision tower depth 32),
text-only trajectories, GRPO (no critic), reference on, gradient checkpointing, the vision tower
frozen unless ``--train-vision`` (then it carries optimizer state, as ``model.freeze_vision:
false`` does); ``tiny-bigvocab``: the tiny body with Qwen's 151,936-token vocabulary.
Engines: ``torch`` = the baseline, the same trainer on a plain-torch engine (bf16 parameters,
fused torch AdamW, no DeepSpeed); ``zero2`` / ``zero3`` = DeepSpeed with a client torch AdamW,
bf16 (fp32 master weights in the optimizer).

Model FLOPs (the MFU numerator, PaLM convention): a forward over a sequence of s tokens with l
loss tokens costs 2*(N - N_head)*s + 2*N_head*l + 4*n_layers*d_attn*s^2 (the LM head runs on the
loss tokens only, common/contracts/logprobs.py), a backward twice that; N counts the parameters of the text
path (embedding once, vision tower excluded), the critic's N excludes the LM head. Per update: up to 3
forwards (proximal, then reference and values where the update has them) + ppo_epochs x (policy
fwd+bwd + critic fwd+bwd). Recompute is not counted. MFU = model FLOPs / step time / peak
(--peak-tflops, else 989 TFLOP/s on an H100/H200; none on CPU). tokens/s counts the non-padding tokens of the batch.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
try:  # an installed worldloop (editable, or the GPU script's source tree on PYTHONPATH) comes first
    import worldloop.common  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/_learner_table.py, also when loaded by path
from _learner_table import peak_flops, print_table  # noqa: E402

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
    # the tower frozen as in the tiny presets (configs/tiny-*.yaml model.freeze_vision)
    "tiny": dict(trainer=dict(train_batch_size=8, ppo_mini_batch_size=4, micro_batch_size=2, estimator="bilevel_gae"),
                 turns=2, filler=0, response=24, images=True, model=dict(freeze_vision=True)),
    "0.5b": dict(trainer=dict(train_batch_size=16, ppo_mini_batch_size=8, micro_batch_size=4, estimator="bilevel_gae"),
                 turns=3, filler=220, response=110, images=False),
    # the trajectories are text-only, so the vision tower gets no gradient: frozen, its 0.67 B
    # parameters carry no optimizer state (ZeRO-2: 12.5 GiB less; model.freeze_vision; --train-vision trains it)
    "3b": dict(trainer=dict(train_batch_size=16, ppo_mini_batch_size=8, micro_batch_size=2, estimator="grpo",
                            use_critic=False, gradient_checkpointing=True),
               turns=3, filler=220, response=110, images=False, model=dict(freeze_vision=True)),
    # the tiny model's body (hidden 64, 2 layers, tied head) with Qwen's 151,936-token vocabulary:
    # long responses and 2 rows per micro-batch (about 1,800 loss tokens), so the LM head's logits
    # are most of an update's memory on CPU; GRPO without a critic, reference on
    "tiny-bigvocab": dict(trainer=dict(train_batch_size=4, ppo_mini_batch_size=4, micro_batch_size=2, estimator="grpo",
                                       use_critic=False),
                          turns=3, filler=0, response=300, images=False, vocab=151936),
}


# --------------------------------------------------------------------------- baseline engine


class TorchEngine:
    """The part of DeepSpeed's engine API the trainer uses, on plain torch (the baseline)."""

    def __init__(self, module: torch.nn.Module, lr: float, conf: dict, device: torch.device, dtype: torch.dtype):
        self.module = module.to(device=device, dtype=dtype)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=lr, weight_decay=0.0, fused=device.type == "cuda")
        self.optimizer = self.opt  # where the memory model looks for the optimizer's state
        self.gas = int(conf["gradient_accumulation_steps"])
        self.clip = float(conf["gradient_clipping"])
        self.micro = 0
        self.norm = None
        self.boundary: bool | None = None  # set by the trainer per micro-batch (None: count to gas)

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def gradient_accumulation_steps(self) -> int:
        return self.gas

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro + 1) % self.gas == 0 if self.boundary is None else self.boundary

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self.boundary = is_boundary

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


def _config_for(size: str, tiny_dir: Path):
    """(model class, config) of a size's randomly initialised model (every size but "tiny")."""
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen2_5_VLConfig, Qwen2Config

    if size == "tiny-bigvocab":
        config = AutoConfig.from_pretrained(str(tiny_dir), local_files_only=True)
        config.vocab_size = SIZES[size]["vocab"]
        cls = AutoModelForCausalLM
    elif size == "0.5b":
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
    return cls, config


def _build(cls, config, dtype: torch.dtype):
    return cls.from_config(config, dtype=dtype) if hasattr(cls, "from_config") else cls._from_config(config, dtype=dtype)


def _models_for(size: str, tiny_dir: Path, device: torch.device, dtype: torch.dtype, trainer):
    """(policy, critic backbone or None, reference or None) built in memory (on the meta device:
    shapes only); a critic and a reference only where ``trainer`` has them, as the learner's
    ``build_models`` decides (``use_critic``; ``kl_coef`` > 0)."""
    from transformers import AutoModel

    from worldloop.common.contracts.modeling import load_policy
    from worldloop.learner.engine import load_backbone

    critic, ref = trainer.use_critic, trainer.kl_coef > 0
    if size == "tiny":
        return (load_policy(tiny_dir, dtype=dtype), load_backbone(tiny_dir) if critic else None,
                load_policy(tiny_dir, dtype=dtype) if ref else None)
    cls, config = _config_for(size, tiny_dir)
    with torch.device(device):
        torch.manual_seed(0)
        policy = _build(cls, config, dtype)
        reference = _build(cls, config, dtype) if ref else None
        backbone = AutoModel.from_config(config, dtype=dtype) if critic else None
    return policy, backbone, reference


def model_estimate(size: str, engine: str, cfg, tiny_dir: Path, lengths: list[int], response: int, cuda: bool, full: bool):
    """The memory model's Estimate of a variant (learner/memory.py), from shapes on the meta device:
    its largest micro-batch is micro_batch_size rows of the longest trajectory (or the token budget)."""
    from worldloop.common.contracts.modeling import freeze_vision_tower
    from worldloop.learner.kernels import checkpointing_mode, use_liger
    from worldloop.learner.memory import estimate, shape_of

    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    policy, backbone, reference = _models_for(size, tiny_dir, torch.device("meta") if size != "tiny" else device,
                                              torch.bfloat16 if cuda else torch.float32, cfg.trainer)
    for m in (policy, backbone) if cfg.model.freeze_vision else ():
        if m is not None:
            freeze_vision_tower(m)
    t = cfg.trainer
    slots = t.micro_batch_size * (-(-max(lengths) // 8) * 8)
    tokens = min(slots, t.micro_batch_tokens) if isinstance(t.micro_batch_tokens, int) and t.micro_batch_tokens > 0 else slots
    loss_tokens = int(tokens * response / max(sum(lengths), 1))
    return estimate(shape_of(policy), "torch" if engine == "torch" else engine, bf16=cuda, tokens=tokens,
                    loss_tokens=loss_tokens, checkpointing=checkpointing_mode(t),
                    offload=getattr(t, "offload_optimizer", "none") == "cpu",
                    chunk=None if full else t.logprob_chunk_tokens, liger=use_liger(cfg, device),
                    reference=shape_of(reference) if reference is not None else None,
                    critic=shape_of(backbone) if backbone is not None else None)


def _memory_limit(cuda: bool) -> float:
    """Bytes a variant may use: the GPU's memory, or the machine's available memory on CPU."""
    if cuda:
        return float(torch.cuda.mem_get_info()[1])
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return float(fields["MemAvailable"].split()[0]) * 1024


def use_full_logprobs() -> None:
    """The counterfactual of ``--logprobs full``: the LM head's log-probs and entropies computed over
    the whole [N, V] logits with autograd (as before chunking), in this process only."""
    import worldloop.common.contracts.logprobs as lp

    def full(hidden, head, targets, temperature=1.0, chunk_size=512, return_entropy=False, fused=False):
        logp, ent = lp.full_linear_logprobs(hidden, head, targets, temperature)
        return logp, (ent if return_entropy else None)

    lp.linear_logprobs = full


def _text_params(model: torch.nn.Module) -> tuple[int, int, int, int]:
    """(N of the text path incl. the tied LM head once, LM head params, layers, attention width)."""
    n = sum(p.numel() for name, p in model.named_parameters() if "visual" not in name)
    text = model.config.get_text_config()
    head = text.vocab_size * text.hidden_size
    heads = text.num_attention_heads
    return n, head, text.num_hidden_layers, heads * (text.hidden_size // heads)


def update_flops(lengths: list[int], n_policy: int, n_head: int, layers: int, d_attn: int, critic: bool, epochs: int,
                 loss_tokens: list[int] | None = None, reference: bool = True) -> float:
    """Model FLOPs of one update (module docstring); the LM head on ``loss_tokens`` only (all
    tokens when None); the reference's forward only when there is one."""
    loss_tokens = lengths if loss_tokens is None else loss_tokens
    fwd_p = sum(2 * (n_policy - n_head) * s + 2 * n_head * n + 4 * layers * d_attn * s * s
                for s, n in zip(lengths, loss_tokens))
    fwd_c = sum(2 * (n_policy - n_head) * s + 4 * layers * d_attn * s * s for s in lengths) if critic else 0.0
    return (2 if reference else 1) * fwd_p + fwd_c + epochs * 3 * (fwd_p + fwd_c)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> None:
    """Restart the kernel's peak-RSS count (VmHWM) here, so model building's transients do not count."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _shapes(size: str, lengths: str, step: int, n: int) -> list[tuple[int, int, int]]:
    """(turns, response tokens, filler tokens) of each trajectory of update ``step``."""
    spec = SIZES[size]
    if lengths == "fixed":
        return [(spec["turns"], spec["response"], spec["filler"])] * n
    rng = random.Random(step * 7919 + 17)
    max_turns = spec["turns"] * 5 // 2 if size == "tiny" else spec["turns"]
    return [(rng.randint(1, max_turns), rng.randint(max(1, spec["response"] // 4), spec["response"]), spec["filler"])
            for _ in range(n)]


# trainer keys of a preset that do not shape an update: the bench sets its own number of updates
_RUN_KEYS = ("total_steps",)


def preset_trainer(name: str) -> tuple[dict, int]:
    """The ``trainer`` section of a preset (a name under configs/ or a YAML path), read as
    ``worldloop up`` reads it, less :data:`_RUN_KEYS` (the update's batch sizes, micro-batch budget,
    epochs, estimator, critic and KL, as that preset's learner runs them: ``--preset``), and its
    ``actor.n_samples_per_seed`` (the GRPO group size the synthetic batch's groups take)."""
    from worldloop.common.contracts.config_load import read_config_file

    data, _ = read_config_file(name)
    trainer = {k: v for k, v in (data.get("trainer") or {}).items() if k not in _RUN_KEYS}
    return trainer, int((data.get("actor") or {}).get("n_samples_per_seed", 4))


def _trainer_overrides(v: dict) -> dict:
    """The trainer keys of a variant's flags (``--packing``, ``--checkpointing``, ``--offload``)."""
    out = {"packing": v.get("packing", "on") == "on", "vision_cache": v.get("vision_cache", "on") == "on",
           "proximal_from_first_pass": v.get("proximal", "first") == "first"}
    if v.get("checkpointing", "default") != "default":
        out["activation_checkpointing"] = v["checkpointing"]
    if v.get("offload", "none") != "none":
        out["offload_optimizer"] = v["offload"]
    return out


def run_variant(size: str, engine: str, steps: int, out: Path, lengths: str = "fixed", micro_tokens: str = "0",
                batch_sizes: str = "", logprobs: str = "chunked", chunk: int = 0, variant: dict | None = None) -> dict:
    from worldloop.common.contracts.config import config_from_dict
    from worldloop.common.contracts.modeling import ChatCodec
    from worldloop.bootstrap.tiny_model import make_tiny_model
    from worldloop.common.transport.weights import WeightPublisher
    from worldloop.learner.engine import DistInfo, assemble_models, gather_policy_weights, init_distributed
    from worldloop.testing.trajectories import synthetic_trajectory
    from worldloop.learner.trainer import PPOTrainer

    spec = dict(SIZES[size])
    group = 4  # trajectories per GRPO group (actor.n_samples_per_seed)
    if (variant or {}).get("preset"):  # the preset's trainer over the size's (kl_coef included)
        preset, group = preset_trainer(variant["preset"])
        spec["trainer"] = dict(spec["trainer"], **preset)
    if batch_sizes:
        train, mini, micro = (int(x) for x in batch_sizes.split(","))
        spec["trainer"] = dict(spec["trainer"], train_batch_size=train, ppo_mini_batch_size=mini, micro_batch_size=micro)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    tmp = Path(tempfile.mkdtemp(prefix="bench-learner-"))
    # the tokenizer (and, for "tiny", the model); text-only trajectories for the large shapes
    tiny_dir = make_tiny_model(tmp / "tiny", arch="qwen2_5_vl" if spec["images"] else "qwen2", max_image_side=112)
    codec = ChatCodec(tiny_dir, max_image_side=112)
    batch_size = spec["trainer"]["train_batch_size"]

    def batch(step: int):
        shared = (variant or {}).get("group_start", "own") == "shared"  # a group's episodes start from one observation
        return [synthetic_trajectory(codec, trajectory_id=f"b{step}-{i}", seed=step * 1000 + (i // group if shared else i), turns=turns,
                                     response_tokens=response, filler_tokens=filler, group_id=f"g{i // group}",
                                     env_reward=float(i % 3))
                for i, (turns, response, filler) in enumerate(_shapes(size, lengths, step, batch_size))]

    batches = [batch(step) for step in range(steps + 1)]
    if micro_tokens == "":  # --micro-tokens not given: the preset's budget, else a fixed count
        micro_tokens = str(spec["trainer"].get("micro_batch_tokens", 0))
    budget = micro_tokens if micro_tokens == "auto" else int(micro_tokens)
    trainer = dict({"kl_coef": 0.001, **spec["trainer"]}, zero_stage=3 if engine == "zero3" else 2 if engine == "zero2" else 0,
                   total_steps=steps, device="cuda" if cuda else "cpu", micro_batch_tokens=budget,
                   **({"logprob_chunk_tokens": chunk} if chunk else {}), **_trainer_overrides(variant or {}))
    model = dict(spec.get("model", {}), **({"freeze_vision": False} if (variant or {}).get("train_vision") else {}))
    cfg = config_from_dict({"model": {"path": str(tiny_dir), "max_image_side": 112, "max_model_len": 8192, **model},
                            "actor": {"n_samples_per_seed": group}, "trainer": trainer})
    first = [sum(len(t.obs_ids) + len(t.response_ids) for t in x.turns) for x in batches[0]]
    est = model_estimate(size, engine, cfg, tiny_dir, first, sum(len(t.response_ids) for x in batches[0] for t in x.turns),
                         cuda, logprobs == "full")
    limit = _memory_limit(cuda)
    head = {"size": size, "engine": engine, "budget": micro_tokens, "logprobs": logprobs, "model": est.rows(),
            **(variant or {})}
    if est.total > limit:  # before any model is built
        row = dict(head, skipped=f"does not fit: model says {est.total / 2**30:.1f} GiB > {limit / 2**30:.1f} GiB")
        print(f"  {size} {engine} {logprobs} log-probs: {row['skipped']}", flush=True)
        out.write_text(json.dumps(row))
        return row
    if logprobs == "full":
        use_full_logprobs()
    if engine == "torch":
        dist = DistInfo(0, 1, 0, device, "none")
        make = lambda module, lr, conf: TorchEngine(module, lr, conf, device, dtype)  # noqa: E731
    else:
        dist = init_distributed(cfg)
        make = None
    policy, backbone, reference = _models_for(size, tiny_dir, device, dtype, cfg.trainer)
    n_policy, n_head, layers, d_attn = _text_params(policy)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    models = assemble_models(cfg, dist, codec, policy, backbone, reference, engine_fn=make)
    ppo = PPOTrainer(cfg, models, seed=0)
    pub = WeightPublisher("127.0.0.1", 0, 0)
    pub.reserve(gather_policy_weights(models))  # as the learner does at start: no publish allocates
    results = []
    rss0 = _rss_bytes()
    _reset_peak_rss()
    for step in range(steps + 1):  # the first update warms up (allocator, kernels) and is not counted
        trajs = batches[step]
        lengths = [sum(len(t.obs_ids) + len(t.response_ids) for t in x.turns) for x in trajs]
        loss_tokens = [sum(len(t.response_ids) for t in x.turns) for x in trajs]
        if cuda:
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        stats = ppo.update(trajs, step)
        if cuda:
            torch.cuda.synchronize()
        dt, cpu_s = time.perf_counter() - t0, time.process_time() - c0
        flops = update_flops(lengths, n_policy, n_head, layers, d_attn, models.critic is not None, cfg.trainer.ppo_epochs,
                             loss_tokens, reference=models.reference is not None)
        results.append({"seconds": dt, "tokens": sum(lengths), "flops": flops, "forward": stats["forward_seconds"],
                        "backward": stats["backward_seconds"], "loss": stats.get("policy_loss"),
                        "pad": stats["padding_fraction"], "micro": stats["micro_batches"], "cpu": cpu_s})
        print(f"  {size} {engine} {logprobs} micro_batch_tokens={budget} update {step}: {dt:.2f}s ({cpu_s:.1f} cpu s), "
              f"{sum(lengths) / dt:,.0f} tok/s, "
              f"padding {stats['padding_fraction']:.3f}, {stats['micro_batches']} micro-batches, "
              f"policy loss {stats.get('policy_loss')}", flush=True)
    peak_rss = _peak_rss_bytes()
    t0 = time.perf_counter()
    weights = gather_policy_weights(models)
    pub.publish(weights, 1)
    publish_s = time.perf_counter() - t0
    pub.close()
    timed = results[1:]
    row = {
        **head, "device": torch.cuda.get_device_name(0) if cuda else "cpu", "lengths": lengths,
        "micro_batch_tokens": ppo._budget(lengths), "micro_batch_size": cfg.trainer.micro_batch_size,
        "logprob_chunk": cfg.trainer.logprob_chunk_tokens, "liger": models.liger,
        "model_growth_mb": (est.grads + est.optimizer + est.activations + est.logits) / 2**20,
        "padding_fraction": statistics.median(r["pad"] for r in timed),
        "micro_batches": statistics.median(r["micro"] for r in timed),
        "cpu_s": statistics.median(r["cpu"] for r in timed),
        "losses": [r["loss"] for r in results],
        "peak_rss_gb": peak_rss / 2**30, "rss_growth_mb": max(0, peak_rss - rss0) / 2**20,
        "params_text": n_policy, "tokens_per_update": int(statistics.median(r["tokens"] for r in timed)),
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


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", action="append", choices=sorted(SIZES), help="model size (repeatable); default tiny")
    ap.add_argument("--engines", default="torch,zero2,zero3")
    ap.add_argument("--steps", type=int, default=3, help="timed updates per variant (after one warm-up)")
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--json", default=None, help="write all rows here")
    ap.add_argument("--lengths", choices=("fixed", "varied"), default="fixed",
                    help="trajectory lengths: the size's fixed shape, or varied several-fold (seeded)")
    ap.add_argument("--micro-tokens", default="",
                    help="comma list of trainer.micro_batch_tokens values, one variant each: 0 = fixed count, "
                         "N = token budget, auto = the trainer's auto (CPU: micro_batch_size x longest; CUDA: memory model); "
                         "default: the --preset's value, else 0")
    ap.add_argument("--preset", default="",
                    help="take the trainer section of this preset (name or YAML: batch sizes, micro_batch_tokens, "
                         "epochs, estimator, critic, kl_coef) over the size's own; --batch and --micro-tokens still win")
    ap.add_argument("--packing", default="on", help="comma list of on/off (trainer.packing), one variant each")
    ap.add_argument("--checkpointing", default="default",
                    help="comma list of default/full/selective/none (trainer.activation_checkpointing)")
    ap.add_argument("--offload", default="none", help="comma list of none/cpu (trainer.offload_optimizer, ZeRO only)")
    ap.add_argument("--vision-cache", default="on", help="comma list of on/off (trainer.vision_cache), one variant each")
    ap.add_argument("--proximal", default="first",
                    help="comma list of first/whole (trainer.proximal_from_first_pass true/false), one variant each")
    ap.add_argument("--group-start", default="own",
                    help="comma list of own/shared: shared = a GRPO group's trajectories start from one observation "
                         "(the same first image and tokens, as a group of one level does), one variant each")
    ap.add_argument("--train-vision", action="store_true", help="3b: train the vision tower (model.freeze_vision false)")
    ap.add_argument("--logprobs", default="chunked",
                    help="comma list, one variant each: chunked (the learner's) or full (all [N, V] logits with autograd)")
    ap.add_argument("--logprob-chunk", type=int, default=0, help="trainer.logprob_chunk_tokens (0: the config default)")
    ap.add_argument("--batch", default="", metavar="TRAIN,MINI,MICRO",
                    help="override train_batch_size, ppo_mini_batch_size, micro_batch_size of the size")
    ap.add_argument("--timeout", type=float, default=0, help="seconds per variant before it is killed (0: none)")
    ap.add_argument("--one", nargs=7, metavar=("SIZE", "ENGINE", "OUT", "LENGTHS", "MICRO_TOKENS", "LOGPROBS", "FLAGS"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.batch and len(args.batch.split(",")) != 3:
        ap.error("--batch takes TRAIN,MINI,MICRO")
    if args.one:
        run_variant(args.one[0], args.one[1], args.steps, Path(args.one[2]), args.one[3], args.one[4], args.batch,
                    args.one[5], args.logprob_chunk, json.loads(args.one[6]))
        return 0
    variants = itertools.product(args.size or ["tiny"], _split(args.engines), _split(args.micro_tokens) or [""],
                                 _split(args.logprobs), _split(args.packing), _split(args.checkpointing),
                                 _split(args.offload), _split(args.vision_cache), _split(args.proximal),
                                 _split(args.group_start))
    rows = []
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".torch_extensions"))
    env.setdefault("PYTHONUNBUFFERED", "1")
    with tempfile.TemporaryDirectory() as d:
        for size, engine, budget, logprobs, packing, ckpt, offload, vcache, proximal, start in variants:
            if offload != "none" and engine in ("torch", "zero0"):
                continue  # optimizer offload is ZeRO's
            flags = {"packing": packing, "checkpointing": ckpt, "offload": offload, "vision_cache": vcache,
                     "proximal": proximal, "group_start": start, "train_vision": args.train_vision, "preset": args.preset}
            rows.append(_run_one(args, size, engine, budget, logprobs, flags, Path(d), env))
            if args.json:  # after every variant, so a run cut short keeps what it measured
                Path(args.json).write_text(json.dumps(rows, indent=2))
    print_table(rows, args.lengths, peak_flops(args.peak_tflops))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def _run_one(args, size: str, engine: str, budget: str, logprobs: str, flags: dict, d: Path, env: dict) -> dict:
    """One variant in its own subprocess; its row (or a failed row)."""
    name = "-".join([size, engine, budget, logprobs, *(str(v) for v in flags.values())]).replace("/", "_")
    out = d / f"{name}.json"
    t0 = time.monotonic()
    cmd = [sys.executable, __file__, "--one", size, engine, str(out), args.lengths, budget, logprobs, json.dumps(flags),
           "--steps", str(args.steps), "--batch", args.batch, "--logprob-chunk", str(args.logprob_chunk)]
    try:
        code = subprocess.run(cmd, env=env, cwd=ROOT, timeout=args.timeout or None).returncode
    except subprocess.TimeoutExpired:
        code = 124
    if code != 0 or not out.exists():
        print(f"{name}: failed (exit {code})", flush=True)
        return {"size": size, "engine": engine, "budget": budget, "logprobs": logprobs, "failed": code, **flags}
    row = json.loads(out.read_text())
    row["wall_s"] = time.monotonic() - t0
    return row


if __name__ == "__main__":
    sys.exit(main())
