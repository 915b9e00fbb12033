"""A memory model of one learner update: what parameters, gradients, optimizer state, activations
and logits take, for a model shape and an engine, before anything is allocated.

Public API::

    ModelShape(params, trainable, hidden, layers, heads, kv_heads, intermediate, vocab)
    shape_of(model) -> ModelShape                       # a built model (the meta device works: no memory)
    ENGINES                                             # "torch", "zero0" .. "zero3"
    state_bytes(shape, engine, *, bf16, world_size=1) -> {"params", "grads", "optimizer"}
    activation_bytes_per_token(shape, *, bf16, checkpointing, liger=False) -> float
    logits_bytes(tokens, vocab, *, bf16, chunk=None) -> float   # chunk None: the full N x V computation
    Estimate; estimate(policy, engine, *, bf16, tokens, loss_tokens, ...) -> Estimate (.total, .rows())
    token_budget(free_bytes, per_token, fixed_bytes, *, headroom=0.85, multiple=8) -> int
    pending_state_bytes(engine) -> int                  # lazily allocated state not there yet (Adam moments, grads)
    auto_micro_batch_tokens(models, chunk, *, checkpointing, multiple, device) -> int   # trainer.micro_batch_tokens auto on CUDA

Bytes per parameter by engine (P all parameters, T the trainable ones, w ranks, d = 2 in bf16, 4 in fp32):

============  =====================  ================================  ===========================
engine        parameters             gradients                         optimizer (AdamW)
============  =====================  ================================  ===========================
torch         d P                    d T                               2 d T (moments in the params' dtype)
zero0         d P                    d T (+ 4 T fp32 accumulators      8 T (+ 4 T fp32 master in bf16)
                                     in bf16)
zero1         d P                    d T + 4 T / w (fp32 partition)    12 T / w (fp32 master + moments)
zero2         d P                    (d + 4) T / w                     12 T / w
zero3         d P / w                (d + 4) T / w                     12 T / w
============  =====================  ================================  ===========================

(``torch`` is bench/learner.py's baseline engine; DeepSpeed's ZeRO-1/2 optimizer keeps an fp32
copy of its partition even when the parameters are fp32.) So on one GPU ZeRO-2 in bf16 costs
20 bytes per trainable parameter against the torch baseline's 8: Qwen2.5-VL-3B's 3.75 B (vision
tower included) need 75 GB before any activation, and with a bf16 reference 83 GB, which is the
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
GB = 1e9


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


def state_bytes(shape: ModelShape, engine: str, *, bf16: bool, world_size: int = 1) -> dict[str, float]:
    """Bytes of parameters, gradients and AdamW state of one trainable model on one rank (module table)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    p, t, w = float(shape.params), float(shape.trainable), float(world_size)
    d = 2.0 if bf16 else 4.0
    if engine == "torch":
        return {"params": d * p, "grads": d * t, "optimizer": 2 * d * t}
    if engine == "zero0":
        extra = 4.0 * t if bf16 else 0.0
        return {"params": d * p, "grads": d * t + extra, "optimizer": 8.0 * t + extra}
    grads = d * t + 4.0 * t / w if engine == "zero1" else (d + 4.0) * t / w
    return {"params": d * p / (w if engine == "zero3" else 1.0), "grads": grads, "optimizer": 12.0 * t / w}


def activation_bytes_per_token(shape: ModelShape, *, bf16: bool, checkpointing: bool, liger: bool = False) -> float:
    """Bytes the backbone keeps per token of a micro-batch for the backward (module docstring),
    gradient checkpointing's recomputed layer included."""
    h, i, d = float(shape.hidden), float(shape.intermediate), 2.0 if bf16 else 4.0
    norm = d * h if liger else 8.0 * h + (d * h if bf16 else 0.0)
    mlp = d * h + (3.0 if liger else 4.0) * d * i
    layer = 2 * norm + 6.0 * d * h + mlp
    if checkpointing:
        return 1.1 * (shape.layers * d * h + layer)
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

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.logits + self.others

    def rows(self) -> dict[str, float]:
        """Each part and the total, in GB."""
        parts = ("params", "grads", "optimizer", "activations", "logits", "others")
        return {**{k: getattr(self, k) / GB for k in parts}, "total": self.total / GB}


def estimate(policy: ModelShape, engine: str, *, bf16: bool, tokens: int, loss_tokens: int, checkpointing: bool,
             chunk: int | None, world_size: int = 1, liger: bool = False, reference: ModelShape | None = None,
             critic: ModelShape | None = None) -> Estimate:
    """Peak bytes on one rank of an update whose largest micro-batch has ``tokens`` token slots and
    ``loss_tokens`` loss tokens. The critic's backward runs after the policy's, so only the larger of
    their activations counts; the reference keeps its weights (bf16 on a GPU, fp32 on CPU)."""
    s = state_bytes(policy, engine, bf16=bf16, world_size=world_size)
    act = activation_bytes_per_token(policy, bf16=bf16, checkpointing=checkpointing, liger=liger) * tokens
    others = 0.0
    if reference is not None:
        others += (2.0 if bf16 else 4.0) * reference.params
    if critic is not None:
        others += sum(state_bytes(critic, engine, bf16=bf16, world_size=world_size).values())
    return Estimate(s["params"], s["grads"], s["optimizer"], act,
                    logits_bytes(loss_tokens, policy.vocab, bf16=bf16, chunk=chunk), others)


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


__all__ = ["ENGINES", "Estimate", "ModelShape", "activation_bytes_per_token", "auto_micro_batch_tokens", "estimate",
           "logits_bytes", "pending_state_bytes", "shape_of", "state_bytes", "token_budget"]
