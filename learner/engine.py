"""Policy, critic and reference models of the learner, wrapped in DeepSpeed engines.

Public API::

    DistInfo(rank, world_size, local_rank, device, backend)
    init_distributed(cfg) -> DistInfo          # env defaults for one process; gloo on CPU, nccl on GPU
    ds_config(cfg, dist, *, bf16) -> dict      # the DeepSpeed config of one engine (policy or critic)
    PolicyModule(hf_model, chunk_size=512, fused=False, masked_ids=())  # forward(batch, temperature, return_entropy) -> (logprobs, entropy)
    CriticModule(backbone)                     # forward(batch) -> values [B, L] (fp32)
    Models                                     # .policy, .critic (engines or None), .reference, .codec, ...
    build_models(cfg, dist) -> Models          # from cfg.model.path
    assemble_models(cfg, dist, codec, hf, backbone, reference, engine_fn=None) -> Models
    check_batch_geometry(cfg, world_size)      # ConfigError unless batches split evenly over ranks
    gather_policy_weights(models) -> dict[str, Tensor]   # HF state_dict names; full tensors (LoRA: the adapters) on rank 0
    broadcast_bytes(data, dist) -> bytes       # rank 0's bytes on every rank (no pickle)
    all_reduce_sum(values, dist) / all_reduce_max(values, dist) -> list[float]; barrier(dist)

Design notes
------------
* Both trainable models are plain ``torch.nn.Module`` wrappers whose ``forward`` computes what the
  loss needs, so every training forward goes through ``engine(...)`` (DeepSpeed's gradient
  accumulation bookkeeping and ZeRO-3 hooks run as designed). The policy wraps the Hugging Face
  model as ``.hf``; weights are published under the HF model's own ``state_dict()`` names.
* The policy's log-probs come from :func:`worldloop.common.contracts.logprobs.token_logprobs` (one backbone pass,
  then LM head + fp32 log-softmax ``trainer.logprob_chunk_tokens`` loss tokens at a time, forward
  and backward: no full-vocabulary logits), so position ``i`` holds ``log p(token_i | tokens < i)``
  at the actors' sampling temperature. On a GPU with ``trainer.liger`` the models get Liger's
  RMSNorm / RoPE / SwiGLU and the no-entropy passes its fused linear log-prob
  (``worldloop.learner.kernels``); SDPA attention runs without its cuDNN backend there.
* The critic is the same backbone (``AutoModel`` from the same directory, so it starts from the
  policy's weights) plus a zero-initialised ``Linear(hidden, 1)`` value head. Its values are
  aligned like the log-probs: ``values[:, i]`` is read from the hidden state of position ``i - 1``,
  i.e. the value of the prefix *before* token ``i`` (``V(tau_<i)`` of VAGEN Alg. 1); position 0
  gets 0.
* The reference is a frozen copy of the initial policy (``model.path``), not wrapped in DeepSpeed:
  fp32 on CPU, bf16 on GPU. It is skipped when ``trainer.kl_coef`` is 0. With LoRA
  (``model.lora.rank`` > 0, ``learner/lora.py``) only adapters train, on policy and critic, and the
  reference is the policy with its adapters disabled: no second copy.
* Optimiser: a client ``torch.optim.AdamW`` handed to ``deepspeed.initialize`` (no JIT-compiled
  fused/CPU Adam). ``zero_stage`` 0-3 by config; bf16 when ``trainer.precision`` resolves to it.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from worldloop.common.contracts.config import Config, ConfigError
from worldloop.common.lora import adapter_tensors
from worldloop.common.lora import enabled as lora_enabled
from worldloop.common.contracts.logprobs import model_inputs, token_logprobs
from worldloop.common.contracts.modeling import ChatCodec, freeze_vision_tower, load_policy
from worldloop.learner.varlen import use_varlen
from worldloop.learner.kernels import (apply_checkpointing, apply_liger, checkpointing_mode, configure_attention,
                                       kernel_report, use_liger)

log = logging.getLogger(__name__)

# gather at most this many elements at once when collecting ZeRO-3 shards for publishing
_GATHER_NUMEL = 64 * 1024 * 1024


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(cfg: Config, local_rank: int) -> torch.device:
    want = cfg.trainer.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device", "is cuda but no CUDA device is visible")
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(cfg: Config) -> DistInfo:
    """Join (or create) the process group. A bare ``python`` start becomes a world of one.

    Under ``torchrun``/``deepspeed`` the launcher's RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* are used.
    """
    import deepspeed
    import torch.distributed as tdist

    added: list[str] = []
    if "RANK" not in os.environ:
        # MASTER_PORT 0: the store of a world of one binds a port the OS hands it (no rank has to find it);
        # a port picked free and bound later can be taken in between by another process's client socket
        single = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}
        added = [k for k in single if k not in os.environ]
        os.environ.update({k: single[k] for k in added})
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(cfg, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        if not tdist.is_initialized():
            # DeepSpeed keeps a clone of the world group across engines; a world torn down since (an
            # in-process vLLM engine destroys torch.distributed's at shutdown) leaves it dangling
            from deepspeed.utils import groups

            groups._WORLD_GROUP = None
            skip_unused_comm_ops()
            # rank 0 waits on actors between batches; the other ranks wait in a broadcast meanwhile
            deepspeed.init_distributed(dist_backend=backend, timeout=datetime.timedelta(hours=2), verbose=False)
    finally:
        # a world of one made up here must not leak into child processes (their MASTER_PORT is
        # ours); LOCAL_RANK stays, DeepSpeed's engine reads it
        for k in added:
            if k != "LOCAL_RANK":
                os.environ.pop(k, None)
    return DistInfo(tdist.get_rank(), tdist.get_world_size(), local_rank, device, backend)


def skip_unused_comm_ops() -> None:
    """Keep DeepSpeed from JIT-compiling ops that training never calls.

    Creating DeepSpeed's torch communication backend on the CPU accelerator builds the
    ``deepspeed_shm_comm`` extension (about a minute on 2 cores) under torch's file lock
    ``$TORCH_EXTENSIONS_DIR/deepspeed_shm_comm/lock``. That lock is a plain file: a Ctrl-C or a
    supervisor stop during the build leaves it behind, and every later start then waits on it for
    good. The op only serves ``inference_all_reduce`` (tensor-parallel inference kernels); the
    learner's collectives go through ``torch.distributed`` (gloo/nccl). So it is marked
    unavailable before the backend is made, and nothing is compiled or locked.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.ops.__compatible_ops__["deepspeed_ccl_comm"] = False


def use_bf16(cfg: Config, device: torch.device) -> bool:
    p = cfg.trainer.precision
    return p == "bf16" or (p == "auto" and device.type == "cuda")


def ds_config(cfg: Config, dist: DistInfo, *, bf16: bool) -> dict:
    """DeepSpeed config: one optimizer step per PPO mini-batch, micro-batches accumulated."""
    t = cfg.trainer
    per_rank_mini = t.ppo_mini_batch_size // dist.world_size
    return {
        "train_batch_size": t.ppo_mini_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": per_rank_mini // t.micro_batch_size,
        "gradient_clipping": t.max_grad_norm,
        "zero_optimization": {"stage": t.zero_stage, **_offload(t)},
        "bf16": {"enabled": bool(bf16)},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def _offload(t) -> dict:
    """ZeRO's optimizer offload (``trainer.offload_optimizer``); the client torch AdamW then steps on
    the host copies, so DeepSpeed must not insist on its compiled CPU Adam."""
    if t.offload_optimizer == "none" or t.zero_stage == 0:
        return {}
    return {"offload_optimizer": {"device": "cpu", "pin_memory": True}}


def check_batch_geometry(cfg: Config, world_size: int) -> None:
    """Every rank gets the same whole number of micro-batches per mini-batch (ConfigError otherwise)."""
    t = cfg.trainer
    for key, value in (("trainer.train_batch_size", t.train_batch_size), ("trainer.ppo_mini_batch_size", t.ppo_mini_batch_size)):
        if value % world_size:
            raise ConfigError(key, f"must be divisible by the number of ranks ({world_size}), got {value}")
    per_rank_mini = t.ppo_mini_batch_size // world_size
    if per_rank_mini % t.micro_batch_size:
        raise ConfigError(
            "trainer.micro_batch_size",
            f"must divide the per-rank mini-batch (ppo_mini_batch_size / ranks = {per_rank_mini}), got {t.micro_batch_size}",
        )


# --------------------------------------------------------------------------- modules


class PolicyModule(torch.nn.Module):
    """The HF policy; ``forward`` returns per-position log-probs (and entropies): at every position,
    or, when the batch holds a ``logprob_mask``, at its nonzero positions only (0 elsewhere). The LM
    head runs ``chunk_size`` tokens at a time; ``fused``: Liger's fused linear log-prob when no
    entropy is asked for; ``masked_ids``: the prompt-only tokens the actors never sample
    (``ChatCodec.prompt_only_ids``), masked out of every distribution here too."""

    def __init__(self, hf: torch.nn.Module, chunk_size: int = 512, fused: bool = False, masked_ids=()):
        super().__init__()
        self.hf = hf
        self.chunk_size = int(chunk_size)
        self.fused = bool(fused)
        self.masked_ids = tuple(int(i) for i in masked_ids)

    def forward(self, batch: dict[str, torch.Tensor], temperature: float = 1.0, return_entropy: bool = False):
        at = (batch["logprob_rows"], batch["logprob_cols"]) if "logprob_rows" in batch else None
        return token_logprobs(self.hf, batch, temperature=temperature, chunk_size=self.chunk_size,
                              return_entropy=return_entropy, only=batch.get("logprob_mask"), fused=self.fused,
                              positions=at, masked_ids=self.masked_ids)


class CriticModule(torch.nn.Module):
    """Backbone + scalar value head; ``forward`` returns values [B, L] aligned with the log-probs."""

    def __init__(self, backbone: torch.nn.Module):
        super().__init__()
        self.backbone = backbone
        hidden = backbone.config.get_text_config().hidden_size
        self.value_head = torch.nn.Linear(hidden, 1)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        p = next(self.backbone.parameters())
        out = self.backbone(**model_inputs(batch, p.device, p.dtype, owner=self.backbone), use_cache=False)
        v = self.value_head(out.last_hidden_state).squeeze(-1).float()
        v = torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], dim=1)
        if "seq_start" in batch:  # a packed row: no value from the previous sequence's last token
            v = v * (1.0 - batch["seq_start"].to(v.device))
        return v


def load_backbone(model_dir: str | Path) -> torch.nn.Module:
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True)


@dataclass
class Models:
    policy: Any  # DeepSpeedEngine around PolicyModule
    critic: Any | None  # DeepSpeedEngine around CriticModule, None without a critic
    reference: PolicyModule | None
    codec: ChatCodec
    dist: DistInfo
    bf16: bool
    zero_stage: int
    vocab_size: int
    liger: bool = False  # Liger Kernel patched in (trainer.liger)
    lora: Any | None = None  # the policy's peft.PeftModel with model.lora (learner/lora.py), else None

    @property
    def policy_hf(self) -> torch.nn.Module:
        return self.policy.module.hf


def _engine(module: torch.nn.Module, lr: float, config: dict):
    import deepspeed

    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=opt, model_parameters=params, config=config)
    return engine


def build_models(cfg: Config, dist: DistInfo) -> Models:
    """Policy + critic engines and the frozen reference, all from ``cfg.model.path``."""
    t = cfg.trainer
    path = Path(cfg.model.path)
    if not (path / "config.json").exists():
        raise ConfigError("model.path", f"{str(path)!r} has no config.json")
    check_batch_geometry(cfg, dist.world_size)
    use_liger(cfg, dist.device)  # trainer.liger that cannot be honoured fails here, before minutes of loading
    codec = ChatCodec(path, max_image_side=cfg.model.max_image_side)
    hf = load_policy(path, dtype="float32", device="cpu")
    backbone = load_backbone(path) if t.use_critic else None
    reference = None
    if t.kl_coef > 0 and not lora_enabled(cfg.model.lora):  # LoRA: the policy with its adapters off
        ref_dtype = torch.bfloat16 if dist.device.type == "cuda" else torch.float32
        reference = load_policy(path, dtype=ref_dtype, device=str(dist.device))
    return assemble_models(cfg, dist, codec, hf, backbone, reference)


def assemble_models(cfg: Config, dist: DistInfo, codec: ChatCodec, hf: torch.nn.Module,
                    backbone: torch.nn.Module | None, reference: torch.nn.Module | None, engine_fn=None) -> Models:
    """Wrap already-built modules: ``hf`` (the policy), ``backbone`` (critic, or None) and
    ``reference`` (frozen, or None) into engines (``engine_fn(module, lr, ds_config)``, default
    DeepSpeed with a client AdamW). ``bench/learner.py`` builds random models in memory with it."""
    t = cfg.trainer
    check_batch_geometry(cfg, dist.world_size)
    liger = use_liger(cfg, dist.device)
    configure_attention(dist.device)
    bf16 = use_bf16(cfg, dist.device)
    conf = ds_config(cfg, dist, bf16=bf16)
    make = engine_fn or _engine
    for m in (hf, backbone, reference):
        if m is not None:
            if liger:
                apply_liger(m)
            if t.packing:  # packed rows attend within each trajectory, with no mask (learner/varlen.py)
                use_varlen(m)
    hf.train()
    if cfg.model.freeze_vision:
        freeze_vision_tower(hf)
        if backbone is not None:
            freeze_vision_tower(backbone)
    vocab = hf.get_input_embeddings().num_embeddings
    peft_model = None
    if lora_enabled(cfg.model.lora):
        from worldloop.learner.lora import attach_models

        peft_model, hf, backbone = attach_models(cfg, hf, backbone)
    ckpt = checkpointing_mode(t)
    apply_checkpointing(hf, ckpt)
    policy = make(PolicyModule(hf, t.logprob_chunk_tokens, fused=liger, masked_ids=codec.prompt_only_ids), t.actor_lr, conf)
    critic = None
    if backbone is not None:
        backbone.train()
        apply_checkpointing(backbone, ckpt)
        critic = make(CriticModule(backbone), t.critic_lr, conf)
    ref = None
    if peft_model is not None:
        if t.kl_coef > 0:
            from worldloop.learner.lora import AdapterOffReference

            ref = AdapterOffReference(policy.module, peft_model)
    elif reference is not None:
        ref = PolicyModule(reference, t.logprob_chunk_tokens, fused=liger, masked_ids=codec.prompt_only_ids).eval()
        ref.requires_grad_(False)
    log.info(
        "models ready: policy%s%s, zero stage %d, %s, %s, %d rank(s)%s",
        " + critic" if critic is not None else "", " + reference" if ref is not None else "",
        t.zero_stage, "bf16" if bf16 else "fp32", dist.device, dist.world_size, ", Liger Kernel" if liger else "",
    )
    if dist.is_main:
        log.info("%s", kernel_report(cfg, dist.device, liger))
    return Models(policy, critic, ref, codec, dist, bf16, t.zero_stage, vocab, liger, peft_model)


# --------------------------------------------------------------------------- weights


def _weight_groups(named: list[tuple[str, torch.nn.Parameter]]) -> list[list[tuple[str, torch.nn.Parameter]]]:
    groups, cur, size = [], [], 0
    for name, p in named:
        n = int(getattr(p, "ds_numel", p.numel()))
        if cur and size + n > _GATHER_NUMEL:
            groups.append(cur)
            cur, size = [], 0
        cur.append((name, p))
        size += n
    if cur:
        groups.append(cur)
    return groups


def gather_policy_weights(models: Models) -> dict[str, torch.Tensor]:
    """Full policy tensors named as the HF model's ``state_dict()`` keys, on rank 0 (others: ``{}``).

    Tied weights appear once (``named_parameters`` drops aliases; the actors' check accepts that).
    Below ZeRO-3 the tensors are the live parameters (detached; copy them before the next
    optimizer step). Under ZeRO-3 every rank must call this: shards are gathered group by group
    (at most ``_GATHER_NUMEL`` elements at a time) and rank 0 keeps CPU copies.
    """
    hf = models.policy_hf
    if models.lora is not None:  # LoRA (ZeRO 0-2): the adapters alone are the version
        return adapter_tensors(hf) if models.dist.is_main else {}
    named = list(hf.named_parameters())
    out: dict[str, torch.Tensor] = {}
    if models.zero_stage == 3:
        import deepspeed

        for group in _weight_groups(named):
            with deepspeed.zero.GatheredParameters([p for _, p in group], modifier_rank=None):
                if models.dist.is_main:
                    for name, p in group:
                        out[name] = p.detach().to("cpu", copy=True)
    elif models.dist.is_main:
        out = {name: p.detach() for name, p in named}  # the publisher copies from the device itself
    if models.dist.is_main:
        persistent = set(hf.state_dict(keep_vars=True))
        for name, b in hf.named_buffers():
            if name in persistent:
                out[name] = b.detach()
    return out


# --------------------------------------------------------------------------- collectives


def _comm_device(dist: DistInfo) -> torch.device:
    return dist.device if dist.backend == "nccl" else torch.device("cpu")


def broadcast_bytes(data: bytes | None, dist: DistInfo) -> bytes:
    """Rank 0's ``data`` on every rank, as a uint8 tensor (length first, then the bytes)."""
    if dist.world_size == 1:
        return data or b""
    import torch.distributed as tdist

    dev = _comm_device(dist)
    n = torch.tensor([len(data or b"") if dist.is_main else 0], dtype=torch.long, device=dev)
    tdist.broadcast(n, 0)
    if int(n) == 0:
        return b""
    if dist.is_main:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
    else:
        buf = torch.empty(int(n), dtype=torch.uint8, device=dev)
    tdist.broadcast(buf, 0)
    return data if dist.is_main else bytes(buf.cpu().numpy().tobytes())


def all_reduce_sum(values: list[float], dist: DistInfo) -> list[float]:
    if dist.world_size == 1:
        return [float(v) for v in values]
    import torch.distributed as tdist

    t = torch.tensor(values, dtype=torch.float64, device=_comm_device(dist))
    tdist.all_reduce(t)
    return [float(v) for v in t.cpu()]


def all_reduce_max(values: list[float], dist: DistInfo) -> list[float]:
    if dist.world_size == 1:
        return [float(v) for v in values]
    import torch.distributed as tdist

    t = torch.tensor(values, dtype=torch.float64, device=_comm_device(dist))
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return [float(v) for v in t.cpu()]


def barrier(dist: DistInfo) -> None:
    if dist.world_size > 1:
        import torch.distributed as tdist

        tdist.barrier()
