"""The generation contract of actors: what every backend (``hf_backend``, ``vllm_backend``) takes,
returns and checks. Implementations live in their own modules; ``backends.make_backend`` picks one.

Public API::

    GenRequest(prompt_ids: list[int], images: list[bytes])      # whole context so far + all its PNGs
    GenResult(response_ids, logprobs, text, truncated)           # truncated: hit max_new_tokens w/o EOS
    class GenerationBackend(Protocol):
        version: int
        def generate(self, requests, *, temperature, top_p, max_new_tokens, seed=None) -> list[GenResult]
        def update_weights(self, tensors: dict[str, Tensor], version: int) -> None
        def close(self) -> None
    validate_requests(requests, max_new_tokens, vocab)           # the checks every backend makes
    cut_at_eos(ids, eos_token_ids) -> (ids up to the first EOS, truncated)
    check_state_dict(model, tensors)                             # WeightUpdateError unless tensors cover the model
    resolve_device(name: str) -> str                             # "auto" -> "cuda" if available else "cpu"
    WeightUpdateError(ValueError)

Conventions every backend follows (see also ``worldloop.common.modeling``):

* ``prompt_ids`` are built with :class:`worldloop.common.modeling.ChatCodec` (token-in/token-out); the
  ``<|image_pad|>`` tokens in them must match the images' grids (ValueError otherwise).
* ``response_ids`` stop at (and include) the first EOS token (``<|im_end|>`` or
  ``<|endoftext|>``); ``text`` is their decoding without special tokens.
* ``logprobs[i]`` = ``log_softmax(logits / temperature)[response_ids[i]]`` over the full
  vocabulary, *before* top-p filtering (no renormalisation). ``temperature == 0`` means greedy
  decoding, and its log-probs are taken at temperature 1.
* ``update_weights`` takes tensors named as in the learner policy's ``state_dict()``; every name
  must be known and every parameter covered (tied aliases count as covered), shapes must match,
  and nothing is changed unless the whole set is valid.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

@dataclass
class GenRequest:
    prompt_ids: list[int]
    images: list[bytes] = field(default_factory=list)


@dataclass
class GenResult:
    response_ids: list[int]
    logprobs: list[float]
    text: str
    truncated: bool


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


def check_state_dict(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Raise WeightUpdateError unless ``tensors`` exactly covers ``model.state_dict()``."""
    own = model.state_dict()
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
