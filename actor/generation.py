"""The generation contract of actors: what every backend (``hf_backend``, ``vllm_backend``,
``server.client``) takes, returns and checks. Implementations live in their own modules;
``backends.make_backend`` picks one.

Public API::

    GenRequest(prompt_ids: list[int], images: list[bytes], sample_key=None, session=None)
        # whole context so far + all its PNGs; sample_key: the request's own random stream;
        # session: the episode it belongs to (a server backend keeps an episode on one server)
    GenResult(response_ids, logprobs, text, truncated, version=None, error=None, token_versions=None)
        # truncated: hit max_new_tokens w/o EOS; version: the weights that produced it when the
        # backend knows per response (servers), None = the backend's .version at the call;
        # error: this request failed for good (its episode is dropped), the other fields empty
    class GenerationBackend(Protocol):
        version: int
        def generate(self, requests, *, temperature, top_p, max_new_tokens, seed=None) -> list[GenResult]
        def update_weights(self, tensors: dict[str, Tensor], version: int) -> None
        def close(self) -> None
    validate_requests(requests, max_new_tokens, vocab)           # the checks every backend makes
    cut_at_eos(ids, eos_token_ids) -> (ids up to the first EOS, truncated)
    check_state_dict(model, tensors)                             # WeightUpdateError unless tensors cover the model
    check_finite(tensors)                                        # WeightUpdateError naming a tensor with NaN/inf
    resolve_device(name: str) -> str                             # "auto" -> "cuda" if available else "cpu"
    keyed_gumbel_scores(logits, keys, step, temperature, top_p) -> Tensor  # argmax of it = a keyed sample
    WeightUpdateError(ValueError)

Conventions every backend follows (see also ``worldloop.common.contracts.modeling``):

* ``prompt_ids`` are built with :class:`worldloop.common.contracts.modeling.ChatCodec` (token-in/token-out); the
  ``<|image_pad|>`` tokens in them must match the images' grids (ValueError otherwise).
* ``response_ids`` stop at (and include) the first EOS token (``<|im_end|>`` or
  ``<|endoftext|>``); ``text`` is their decoding without special tokens.
* ``logprobs[i]`` = ``log_softmax(logits / temperature)[response_ids[i]]`` over the full
  vocabulary, *before* top-p filtering (no renormalisation). ``temperature == 0`` means greedy
  decoding, and its log-probs are taken at temperature 1.
* **Prompt-only tokens** (``ChatCodec.prompt_only_ids``: ``<|im_start|>`` and the image tokens)
  are never sampled: their logits are -inf before temperature, top-p and keyed sampling, and
  ``logits`` above means the logits under that mask, which the learner applies too
  (``token_logprobs(masked_ids=...)``).
* **Keyed sampling.** When every request of a call has a ``sample_key``, each request's tokens are
  drawn from its own random stream, seeded by (key, token position) alone: a request's response
  depends on its key, the model and its prompt, never on which other requests share the batch or
  on ``seed``. Two models given the same key draw the same noise (common random numbers), so a
  paired comparison of two models on the same seeds differs only where the models differ. The HF
  backend samples by the Gumbel-max trick (:func:`keyed_gumbel_scores`), vLLM by its per-request
  seed. Without keys (the actors' training rollouts) a call samples from one stream seeded by ``seed``.
* ``update_weights`` takes tensors named as in the learner policy's ``state_dict()``; every name
  must be known and every parameter covered (tied aliases count as covered), shapes must match,
  no floating-point tensor may hold NaN or an infinity, and nothing is changed unless the whole
  set is valid.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

@dataclass
class GenRequest:
    prompt_ids: list[int]
    images: list[bytes] = field(default_factory=list)
    sample_key: int | None = None  # the request's own random stream (see "Keyed sampling"), 0 <= key < 2**63
    session: str | None = None  # the episode (trajectory id): the server backend's affinity key


@dataclass
class GenResult:
    response_ids: list[int]
    logprobs: list[float]
    text: str
    truncated: bool
    version: int | None = None  # the weight version that produced it (None: the backend's .version)
    error: str | None = None  # set when the request failed for good (server backend): drop its episode
    # per response token, the version that sampled it, when the tokens came from more than one
    # (a server that loaded a version mid-request, actor.weight_update=interrupt); version = the oldest
    token_versions: list[int] | None = None


@runtime_checkable
class GenerationBackend(Protocol):
    version: int

    def generate(
        self,
        requests: list[GenRequest],
        *,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        seed: int | None = None,
    ) -> list[GenResult]: ...

    def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None: ...

    def close(self) -> None: ...


class WeightUpdateError(ValueError):
    """A weight update does not fit the model (unknown/missing names, wrong shapes)."""


def validate_requests(requests: list[GenRequest], max_new_tokens: int, vocab: int) -> None:
    """The checks every backend makes before generating (ValueError naming the request)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    for i, r in enumerate(requests):
        if not r.prompt_ids:
            raise ValueError(f"request {i}: empty prompt_ids")
        bad = [t for t in r.prompt_ids if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"request {i}: token id(s) {bad[:5]} outside the vocabulary [0, {vocab})")


def cut_at_eos(ids: list[int], eos_token_ids: list[int]) -> tuple[list[int], bool]:
    """``ids`` up to and including the first EOS token, and whether there was none (truncated)."""
    eos = set(eos_token_ids)
    end = next((i + 1 for i, t in enumerate(ids) if t in eos), None)
    return (ids[:end], False) if end is not None else (ids, True)


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def check_finite(tensors: dict[str, torch.Tensor]) -> None:
    """Raise WeightUpdateError naming the first floating-point tensor that holds NaN or +-inf (a
    diverged update must not reach the actors' sampling)."""
    for k, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise WeightUpdateError(f"tensor {k}: holds NaN or infinite values")


def check_state_dict(model: torch.nn.Module, tensors: dict[str, torch.Tensor], own: dict | None = None) -> None:
    """Raise WeightUpdateError unless ``tensors`` exactly covers ``model.state_dict()`` (or ``own``,
    a part of it: a LoRA model's adapter tensors)."""
    own = model.state_dict() if own is None else own
    unknown = sorted(set(tensors) - set(own))
    if unknown:
        raise WeightUpdateError(f"unknown tensor name(s) {unknown[:5]}{' ...' if len(unknown) > 5 else ''} ({len(unknown)} in all)")
    given_ptrs = {own[k].data_ptr() for k in tensors}
    missing = sorted(k for k in set(own) - set(tensors) if own[k].data_ptr() not in given_ptrs)
    if missing:
        raise WeightUpdateError(f"missing tensor name(s) {missing[:5]}{' ...' if len(missing) > 5 else ''} ({len(missing)} in all)")
    for k, t in tensors.items():
        if tuple(t.shape) != tuple(own[k].shape):
            raise WeightUpdateError(f"tensor {k}: shape {tuple(t.shape)} does not match the model's {tuple(own[k].shape)}")


_MIX = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: spreads consecutive positions over the seed space


def _stream_seed(key: int, step: int) -> int:
    return ((int(key) * 0x100000001B3) ^ ((int(step) + 1) * _MIX)) & (2**63 - 1)


def keyed_gumbel_scores(logits: torch.Tensor, keys: list[int], step: int, temperature: float, top_p: float) -> torch.Tensor:
    """``logits / temperature`` (top-p filtered) plus Gumbel noise drawn from each row's own stream.

    Row ``i``'s noise is seeded by ``(keys[i], step)`` alone, so its argmax is a sample of token
    ``step`` from ``softmax(logits[i] / temperature)`` restricted to the top-p nucleus (the
    Gumbel-max trick: ``argmax(z + G)`` with ``G = -log(-log(U))``, ``U ~ Uniform(0, 1)`` i.i.d.,
    is distributed as ``softmax(z)``), independent of every other row. The nucleus is the smallest
    set of the most likely tokens whose probability reaches ``top_p`` (always at least one token).
    """
    if temperature <= 0:
        raise ValueError(f"keyed sampling needs temperature > 0, got {temperature}")
    if len(keys) != logits.shape[0]:
        raise ValueError(f"{len(keys)} keys for {logits.shape[0]} rows")
    z = logits.float() / float(temperature)
    if top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # probability of the tokens ranked above each
        drop_sorted = before >= float(top_p)
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    noise = torch.empty_like(z)
    gen = torch.Generator(device=z.device)  # drawn where the logits are (a CUDA stream differs from the CPU's)
    for i, key in enumerate(keys):
        gen.manual_seed(_stream_seed(key, step))
        u = torch.rand(z.shape[-1], generator=gen, device=z.device, dtype=torch.float64).clamp_(min=1e-300, max=1.0 - 1e-16)
        noise[i] = (-torch.log(-torch.log(u))).to(z.dtype)
    return z + noise
