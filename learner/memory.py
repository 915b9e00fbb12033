"""A memory model of one learner update: what parameters, gradients, optimizer state, activations
and logits take, for a model shape and an engine, before anything is allocated.

Public API::

    ModelShape(params, trainable, hidden, layers, heads, kv_heads, intermediate, vocab)
    shape_of(model) -> ModelShape                       # a built model (the meta device works: no memory)
    ENGINES                                             # "torch", "zero0" .. "zero3"
    state_bytes(shape, engine, *, bf16, world_size=1, offload=False) -> {"params", "grads", "grad_fp32", "optimizer", "host"}
    activation_bytes_per_token(shape, *, bf16, checkpointing, liger=False) -> float   # checkpointing full/selective/none
    logits_bytes(tokens, vocab, *, bf16, chunk=None) -> float   # chunk None: the full N x V computation
    Estimate; estimate(policy, engine, *, bf16, tokens, loss_tokens, ...) -> Estimate (.total, .rows())
    token_budget(free_bytes, per_token, fixed_bytes, *, headroom=0.85, multiple=8) -> int
    pending_state_bytes(engine) -> int                  # lazily allocated state not there yet (Adam moments, grads)
    auto_micro_batch_tokens(models, chunk, *, checkpointing, multiple, device) -> int   # trainer.micro_batch_tokens auto on CUDA
    zero_settings_that_fit(policy, gpu_bytes, *, bf16, tokens, loss_tokens, ...) -> (settings, Estimate)
        # the first ZeRO-2 setting (no offload, then offload_optimizer cpu) whose prediction fits

Every figure is in bytes; ``Estimate.rows()`` and everything printed are GiB (2**30 bytes).

Bytes per parameter by engine (P all parameters, T the trainable ones, w ranks, d = 2 in bf16, 4 in fp32):

============  =====================  ===============  ====================  ===========================
engine        parameters             gradients        fp32 gradient copy    optimizer (AdamW)
============  =====================  ===============  ====================  ===========================
torch         d P                    d T              -                     2 d T (moments in the params' dtype)
zero0         d P                    d T              4 T in bf16           8 T (+ 4 T fp32 master in bf16)
zero1         d P                    d T              4 T / w               12 T / w (fp32 master + moments)
zero2         d P                    d T / w          4 T / w               12 T / w
zero3         d P / w                d T / w          4 T / w               12 T / w
============  =====================  ===============  ====================  ===========================

The fp32 gradient copy is what DeepSpeed's ZeRO optimizer makes of its gradient partition at
each step (``single_partition_of_fp32_groups[i].grad``; ZeRO-0 bf16: its fp32 accumulators).
With ``offload=True`` (``trainer.offload_optimizer: cpu``, ZeRO 1-3) that copy, the fp32 master
and the moments live on the host: they leave the GPU's count and appear as ``host``.

(``torch`` is bench/learner.py's baseline engine; DeepSpeed's ZeRO-1/2 optimizer keeps an fp32
copy of its partition even when the parameters are fp32.) So on one GPU ZeRO-2 in bf16 costs
20 bytes per trainable parameter against the torch baseline's 8: Qwen2.5-VL-3B's 3.75 B (vision
tower included) need 69.9 GiB before any activation, and with a bf16 reference 76.9 GiB, which is the
out-of-memory of issue 30 (its 14 GiB allocation is the fp32 gradient partition, 4 x 3.75 B).

Activations per token and layer (what autograd keeps for the backward, HF's Qwen2 modules; h
hidden, I intermediate, d the activation dtype's bytes): each RMSNorm keeps its input in fp32,
the normalised fp32 values and, in bf16, their cast (8h + d h); attention keeps the projections'
input, q, k and v (GQA heads repeated to h), the SDPA output and the o_proj input (6 d h); the
SwiGLU MLP keeps its input, gate, SiLU(gate), up and their product (d h + 4 d I). Liger's RMSNorm
keeps its input and 1/rms (d h), its SwiGLU gate and up, recomputing SiLU (3 d I with the
product). With gradient checkpointing a layer keeps only its input (d h) and one layer at a time
is recomputed in the backward. The LM head's share is :func:`logits_bytes`: the full computation
keeps the head output, its fp32 copy, the log-softmax and the softmax for every loss token
(d + 16 bytes x V; measured on CPU in fp32: 16 x V in the learner's update, 20 x V with an entropy
term in the loss), the chunked one two fp32 [chunk, V] tensors in either pass (8 bytes x V per
row of one chunk; 10 counted). A 10 % allowance covers the backward's transient gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ENGINES = ("torch", "zero0", "zero1", "zero2", "zero3")
GIB = float(2**30)
CHECKPOINTING = ("full", "selective", "none")


@dataclass(frozen=True)
class ModelShape:
    params: int  # all parameters (tied weights once)
    trainable: int  # parameters with requires_grad
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int


def _numel(p: torch.nn.Parameter) -> int:
    return int(getattr(p, "ds_numel", p.numel()))  # a ZeRO-3 partitioned parameter's full size


def shape_of(model: torch.nn.Module) -> ModelShape:
    """The shape of a Hugging Face model (or a module holding one as ``.hf`` / ``.backbone``)."""
    inner = next((m for m in (getattr(model, "hf", None), getattr(model, "backbone", None)) if m is not None), model)
    text = inner.config.get_text_config()
    params = list(model.parameters())
    return ModelShape(
        params=sum(_numel(p) for p in params), trainable=sum(_numel(p) for p in params if p.requires_grad),
        hidden=int(text.hidden_size), layers=int(text.num_hidden_layers), heads=int(text.num_attention_heads),
        kv_heads=int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads),
        intermediate=int(text.intermediate_size), vocab=int(text.vocab_size),
    )


def state_bytes(shape: ModelShape, engine: str, *, bf16: bool, world_size: int = 1,
                offload: bool = False) -> dict[str, float]:
    """Bytes of parameters, gradients, DeepSpeed's fp32 gradient copy and AdamW state of one
    trainable model on one rank (module table); ``host``: what ``offload`` moves off the GPU."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    p, t, w = float(shape.params), float(shape.trainable), float(world_size)
    d = 2.0 if bf16 else 4.0
    if engine == "torch":
        return {"params": d * p, "grads": d * t, "grad_fp32": 0.0, "optimizer": 2 * d * t, "host": 0.0}
    if engine == "zero0":
        extra = 4.0 * t if bf16 else 0.0
        return {"params": d * p, "grads": d * t, "grad_fp32": extra, "optimizer": 8.0 * t + extra, "host": 0.0}
    out = {"params": d * p / (w if engine == "zero3" else 1.0), "grads": d * t / (1.0 if engine == "zero1" else w),
           "grad_fp32": 4.0 * t / w, "optimizer": 12.0 * t / w, "host": 0.0}
    if offload:
        out["host"] = out["grad_fp32"] + out["optimizer"]
        out["grad_fp32"] = out["optimizer"] = 0.0
    return out


def _mode(checkpointing: bool | str) -> str:
    mode = {True: "full", False: "none"}.get(checkpointing, checkpointing)
    if mode not in CHECKPOINTING:
        raise ValueError(f"checkpointing must be one of {', '.join(CHECKPOINTING)} (or a bool), got {checkpointing!r}")
    return mode


def activation_bytes_per_token(shape: ModelShape, *, bf16: bool, checkpointing: bool | str, liger: bool = False) -> float:
    """Bytes the backbone keeps per token of a micro-batch for the backward (module docstring),
    the recomputed block included. ``checkpointing``: ``full`` (or True) keeps each layer's input
    and recomputes one layer at a time; ``selective`` recomputes each layer's self-attention, which
    then keeps only its input (d h instead of 6 d h) plus one attention block alive in the
    backward; ``none`` (or False) keeps everything."""
    mode = _mode(checkpointing)
    h, i, d = float(shape.hidden), float(shape.intermediate), 2.0 if bf16 else 4.0
    norm = d * h if liger else 8.0 * h + (d * h if bf16 else 0.0)
    mlp = d * h + (3.0 if liger else 4.0) * d * i
    layer = 2 * norm + 6.0 * d * h + mlp
    if mode == "full":
        return 1.1 * (shape.layers * d * h + layer)
    if mode == "selective":
        return 1.1 * (shape.layers * (layer - 5.0 * d * h) + 6.0 * d * h + d * h)
    return 1.1 * (shape.layers * layer + d * h)


def logits_bytes(tokens: int, vocab: int, *, bf16: bool, chunk: int | None = None) -> float:
    """Bytes of the LM head's logits work for ``tokens`` loss tokens: all of them at once
    (``chunk`` None, autograd keeping them for the backward) or ``chunk`` rows at a time."""
    if chunk is None:
        return (16.0 + (2.0 if bf16 else 4.0)) * tokens * vocab
    return 10.0 * min(tokens, chunk) * vocab


@dataclass
class Estimate:
    params: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    others: float  # the reference's weights, the critic's state
    grad_fp32: float = 0.0  # DeepSpeed's fp32 gradient copy
    host: float = 0.0  # offloaded to the host (not in total)

    @property
    def total(self) -> float:
        """Bytes on the device."""
        return self.params + self.grads + self.grad_fp32 + self.optimizer + self.activations + self.logits + self.others

    def rows(self) -> dict[str, float]:
        """Each part and the total, in GiB."""
        parts = ("params", "grads", "grad_fp32", "optimizer", "activations", "logits", "others", "host")
        return {**{k: getattr(self, k) / GIB for k in parts}, "total": self.total / GIB}


def estimate(policy: ModelShape, engine: str, *, bf16: bool, tokens: int, loss_tokens: int, checkpointing: bool | str,
             chunk: int | None, world_size: int = 1, liger: bool = False, reference: ModelShape | None = None,
             critic: ModelShape | None = None, offload: bool = False) -> Estimate:
    """Peak bytes on one rank of an update whose largest micro-batch has ``tokens`` token slots and
    ``loss_tokens`` loss tokens. The critic's backward runs after the policy's, so only the larger of
    their activations counts; the reference keeps its weights (bf16 on a GPU, fp32 on CPU)."""
    s = state_bytes(policy, engine, bf16=bf16, world_size=world_size, offload=offload)
    act = activation_bytes_per_token(policy, bf16=bf16, checkpointing=checkpointing, liger=liger) * tokens
    others = 0.0
    if reference is not None:
        others += (2.0 if bf16 else 4.0) * reference.params
    host = s["host"]
    if critic is not None:
        c = state_bytes(critic, engine, bf16=bf16, world_size=world_size, offload=offload)
        others += sum(c.values()) - c["host"]
        host += c["host"]
    return Estimate(s["params"], s["grads"], s["optimizer"], act,
                    logits_bytes(loss_tokens, policy.vocab, bf16=bf16, chunk=chunk), others, s["grad_fp32"], host)


def zero_settings_that_fit(policy: ModelShape, gpu_bytes: float, *, bf16: bool, tokens: int, loss_tokens: int,
                           checkpointing: bool | str, chunk: int | None, reference: ModelShape | None = None,
                           critic: ModelShape | None = None, headroom: float = 0.9) -> tuple[dict, Estimate]:
    """The first ZeRO-2 setting whose predicted peak fits ``headroom`` of ``gpu_bytes``: as is,
    then ``offload_optimizer: cpu`` (fp32 master, moments and gradient copy on the host); the
    last one tried when none fits (``settings["fits"]`` False)."""
    for offload in (False, True):
        e = estimate(policy, "zero2", bf16=bf16, tokens=tokens, loss_tokens=loss_tokens, checkpointing=checkpointing,
                     chunk=chunk, reference=reference, critic=critic, offload=offload)
        if e.total <= headroom * gpu_bytes:
            break
    return {"zero_stage": 2, "offload_optimizer": "cpu" if offload else "none",
            "fits": e.total <= headroom * gpu_bytes}, e


def token_budget(free_bytes: float, per_token: float, fixed_bytes: float, *, headroom: float = 0.85,
                 multiple: int = 8) -> int:
    """Token slots per micro-batch that ``headroom`` of ``free_bytes`` holds after ``fixed_bytes``
    (state still to be allocated, the LM head's chunk), at ``per_token`` bytes each; a multiple of
    ``multiple``, at least one multiple."""
    room = headroom * free_bytes - fixed_bytes
    tokens = int(room // per_token) if per_token > 0 and room > 0 else 0
    return max(multiple, tokens // multiple * multiple)


def _innermost_optimizer(engine) -> torch.optim.Optimizer | None:
    """The torch optimizer inside an engine's wrappers (DeepSpeed's ZeRO optimizer holds it as ``.optimizer``)."""
    opt = getattr(engine, "optimizer", None)
    while opt is not None and not isinstance(opt, torch.optim.Optimizer):
        opt = getattr(opt, "optimizer", None)
    return opt


def pending_state_bytes(engine) -> int:
    """Bytes that the first backward and optimizer step will still allocate: the gradients of
    trainable parameters that have none yet, and AdamW's two moments of every optimised tensor
    without state (torch.optim allocates them lazily; DeepSpeed's ZeRO-1/2 at initialisation)."""
    n = sum(p.numel() * p.element_size() for p in engine.module.parameters() if p.requires_grad and p.grad is None)
    opt = _innermost_optimizer(engine)
    if opt is not None:
        for group in opt.param_groups:
            n += sum(2 * p.numel() * p.element_size() for p in group["params"] if not opt.state.get(p))
    return int(n)


def auto_micro_batch_tokens(models, chunk: int, *, checkpointing: bool, multiple: int, device: torch.device) -> int:
    """``trainer.micro_batch_tokens: auto`` on CUDA: the token budget the GPU's free memory holds,
    from the memory model's activations per token of the policy (the critic's backbone keeps no
    more), after the state the first step still allocates and one chunk of LM-head logits."""
    free, _total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # the allocator's own slack
    shape = shape_of(models.policy.module)
    pending = sum(pending_state_bytes(e) for e in (models.policy, models.critic) if e is not None)
    per_token = activation_bytes_per_token(shape, bf16=models.bf16, checkpointing=checkpointing, liger=models.liger)
    fixed = pending + logits_bytes(chunk, shape.vocab, bf16=models.bf16, chunk=chunk)
    return token_budget(free, per_token, fixed, multiple=multiple)


__all__ = ["CHECKPOINTING", "ENGINES", "Estimate", "GIB", "zero_settings_that_fit", "ModelShape", "activation_bytes_per_token", "auto_micro_batch_tokens", "estimate",
           "logits_bytes", "pending_state_bytes", "shape_of", "state_bytes", "token_budget"]
