"""The generation interface of actors, and its Hugging Face transformers implementation.

Public API::

    GenRequest(prompt_ids: list[int], images: list[bytes])      # whole context so far + all its PNGs
    GenResult(response_ids, logprobs, text, truncated)           # truncated: hit max_new_tokens w/o EOS
    class GenerationBackend(Protocol):
        version: int
        def generate(self, requests, *, temperature, top_p, max_new_tokens, seed=None) -> list[GenResult]
        def update_weights(self, tensors: dict[str, Tensor], version: int) -> None
        def close(self) -> None
    HFBackend(model_dir, device="cpu", dtype="auto", codec=None, max_image_side=224)
    validate_requests(requests, max_new_tokens, vocab)           # the checks every backend makes
    cut_at_eos(ids, eos_token_ids) -> (ids up to the first EOS, truncated)
    make_backend(cfg: Config, model_dir: str | None = None) -> GenerationBackend
    resolve_device(name: str) -> str                             # "auto" -> "cuda" if available else "cpu"
    WeightUpdateError(ValueError)

Conventions every backend follows (see also ``common.modeling``):

* ``prompt_ids`` are built with :class:`common.modeling.ChatCodec` (token-in/token-out); the
  ``<|image_pad|>`` tokens in them must match the images' grids (ValueError otherwise).
* ``response_ids`` stop at (and include) the first EOS token (``<|im_end|>`` or
  ``<|endoftext|>``); ``text`` is their decoding without special tokens.
* ``logprobs[i]`` = ``log_softmax(logits / temperature)[response_ids[i]]`` over the full
  vocabulary, *before* top-p filtering (no renormalisation). ``temperature == 0`` means greedy
  decoding, and its log-probs are taken at temperature 1.
* ``update_weights`` takes tensors named as in the learner policy's ``state_dict()``; every name
  must be known and every parameter covered (tied aliases count as covered), shapes must match,
  and nothing is changed unless the whole set is valid.

``make_backend`` picks ``cfg.actor.backend``: ``"hf"`` -> :class:`HFBackend`; ``"vllm"`` ->
``actor.vllm_backend.VLLMBackend`` (imported lazily), built with ``VLLMBackend.from_config(cfg,
model_dir)`` when that classmethod exists, else ``VLLMBackend(model_dir, cfg=cfg)``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from common.modeling import ChatCodec, load_policy

if TYPE_CHECKING:
    from common.config import Config

log = logging.getLogger(__name__)


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


class HFBackend:
    """Batched sampling with ``transformers`` ``generate`` (CPU or one GPU)."""

    def __init__(
        self,
        model_dir: str | Path,
        device: str = "cpu",
        dtype: str = "auto",
        codec: ChatCodec | None = None,
        max_image_side: int = 224,
    ):
        self.device = resolve_device(device)
        self.codec = codec or ChatCodec(model_dir, max_image_side=max_image_side)
        self.model = load_policy(model_dir, dtype=dtype, device=self.device)
        self.version = 0
        self._vocab = self.model.get_input_embeddings().num_embeddings

    # -- generation
    def _batch(self, requests: list[GenRequest]) -> dict[str, torch.Tensor]:
        """Left-padded input_ids/attention_mask (+ vision inputs) for all requests."""
        width = max(len(r.prompt_ids) for r in requests)
        ids = torch.full((len(requests), width), self.codec.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(requests), width), dtype=torch.long)
        for i, r in enumerate(requests):
            ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids, dtype=torch.long)
            mask[i, width - len(r.prompt_ids) :] = 1
        batch = {"input_ids": ids, "attention_mask": mask}
        if self.codec.is_vision:
            batch.update(self._vision(requests, ids))
        return {k: v.to(self.device) for k, v in batch.items()}

    def _vision(self, requests: list[GenRequest], ids: torch.Tensor) -> dict[str, torch.Tensor]:
        images = [png for r in requests for png in r.images]
        found = int((ids == self.codec.image_token_id).sum())
        vis = self.codec.vision_inputs(images)
        expected = int(vis["image_grid_thw"].prod(-1).sum()) // 4 if vis else 0
        if found != expected:
            raise ValueError(f"prompts hold {found} image tokens but their {len(images)} image(s) need {expected}")
        out = {"mm_token_type_ids": (ids == self.codec.image_token_id).long()}
        if vis:
            out["pixel_values"] = vis["pixel_values"].to(self.model.dtype)
            out["image_grid_thw"] = vis["image_grid_thw"]
        return out

    @torch.no_grad()
    def generate(
        self,
        requests: list[GenRequest],
        *,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        seed: int | None = None,
    ) -> list[GenResult]:
        """Sample one response per request in one batched ``generate`` call."""
        if not requests:
            return []
        validate_requests(requests, max_new_tokens, self._vocab)
        batch = self._batch(requests)
        sample = temperature > 0
        kwargs = dict(do_sample=True, temperature=float(temperature), top_p=float(top_p), top_k=0) if sample else dict(do_sample=False)
        with torch.random.fork_rng(devices=[self.device] if self.device.startswith("cuda") else []):
            if seed is not None:
                torch.manual_seed(seed)
            out = self.model.generate(
                **batch,
                **kwargs,
                max_new_tokens=int(max_new_tokens),
                eos_token_id=self.codec.eos_token_ids,
                pad_token_id=self.codec.pad_token_id,
                output_logits=True,
                return_dict_in_generate=True,
                use_cache=True,
            )
        new = out.sequences[:, batch["input_ids"].shape[1] :].cpu()
        logits = torch.stack(out.logits, dim=1).float().cpu()  # [B, T, V], raw (pre-processing)
        logp = torch.log_softmax(logits / (temperature if sample else 1.0), dim=-1)
        token_lp = logp.gather(-1, new[:, : logits.shape[1]].unsqueeze(-1)).squeeze(-1)
        return [self._result(new[i], token_lp[i]) for i in range(len(requests))]

    def _result(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> GenResult:
        keep, truncated = cut_at_eos(tokens.tolist(), self.codec.eos_token_ids)
        return GenResult(
            response_ids=keep,
            logprobs=[float(x) for x in logprobs[: len(keep)]],
            text=self.codec.decode(keep),
            truncated=truncated,
        )

    # -- weights
    @torch.no_grad()
    def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Copy a full state dict into the model in place (all-or-nothing), then set ``version``."""
        check_state_dict(self.model, tensors)
        own = self.model.state_dict()
        for k, t in tensors.items():
            own[k].copy_(t.to(device=own[k].device, dtype=own[k].dtype))
        self.version = int(version)

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()


def make_backend(cfg: "Config", model_dir: str | None = None) -> GenerationBackend:
    """The backend named by ``cfg.actor.backend`` for ``model_dir`` (default ``cfg.model.path``)."""
    path = str(model_dir or cfg.model.path)
    if cfg.actor.backend == "hf":
        return HFBackend(path, device=resolve_device(cfg.actor.device), dtype=cfg.model.dtype, max_image_side=cfg.model.max_image_side)
    if cfg.actor.backend == "vllm":
        try:
            from actor.vllm_backend import VLLMBackend
        except ImportError as e:
            raise RuntimeError(f"actor.backend=vllm but the vLLM backend cannot be imported: {e}") from e
        if hasattr(VLLMBackend, "from_config"):
            return VLLMBackend.from_config(cfg, path)
        return VLLMBackend(path, cfg=cfg)
    raise ValueError(f"unknown actor.backend {cfg.actor.backend!r} (known: hf, vllm)")
