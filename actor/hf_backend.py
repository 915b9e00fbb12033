"""The Hugging Face transformers generation backend (CPU or one GPU); the contract is
``worldloop.actor.generation``. The codec's prompt-only tokens (``ChatCodec.prompt_only_ids``) are
never sampled: their logits are -inf before every other processor (temperature, top-p, keyed
sampling), and the reported log-probs are taken from the logits under the same mask.

    HFBackend(model_dir, device="cpu", dtype="auto", codec=None, max_image_side=224, lora=None, decode="loop")
        .decode_mode                             # what it uses: "loop", "cached" or "generate"

``decode`` (the config's ``actor.hf_decode``): ``loop``, :mod:`worldloop.actor.hf_decode`, a decode
loop that gives ``generate``'s tokens and log-probs bit for bit in less CPU time; ``cached``, the
same loop with each episode's keys and values kept between its turns
(:mod:`worldloop.actor.hf_episode_kv`: only the new tokens are prefilled; ``generate``'s
distribution, not its bits; the store is emptied by every weight update); ``generate``,
transformers' own. Models the loop does not support, and GPUs for ``cached``, use ``generate``
and ``loop`` respectively.

With ``lora`` (the config's ``model.lora``, rank > 0) the model gets the same peft adapters as the
learner's policy (``common/lora.py``, ``B`` = 0: the base model until the first version) and
``update_weights`` takes adapter-only versions: exactly the adapter tensors, copied into the
adapters in place; the base weights stay those of ``model_dir``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from worldloop.actor import hf_decode, hf_episode_kv
from worldloop.actor.generation import (GenRequest, GenResult, check_finite, check_state_dict, cut_at_eos, keyed_gumbel_scores,
                                        resolve_device, validate_requests)
from worldloop.common import lora as common_lora
from worldloop.common.contracts.modeling import ChatCodec, load_policy

log = logging.getLogger(__name__)


class HFBackend:
    """Batched sampling with ``transformers`` ``generate`` (CPU or one GPU)."""

    def __init__(
        self,
        model_dir: str | Path,
        device: str = "cpu",
        dtype: str = "auto",
        codec: ChatCodec | None = None,
        max_image_side: int = 224,
        lora=None,
        decode: str = "loop",
    ):
        self.device = resolve_device(device)
        self.codec = codec or ChatCodec(model_dir, max_image_side=max_image_side)
        self.model = load_policy(model_dir, dtype=dtype, device=self.device)
        self.lora = common_lora.enabled(lora)
        if self.lora:  # generate with the injected base model (the learner's names); no dropout here
            self.model = common_lora.attach(self.model, lora).get_base_model().eval()
        self.version = 0
        self._vocab = self.model.get_input_embeddings().num_embeddings
        self._masked = list(self.codec.prompt_only_ids)
        if decode not in ("loop", "cached", "generate"):
            raise ValueError(f"decode must be loop, cached or generate, got {decode!r}")
        if decode != "generate" and not hf_decode.supports(self.model):
            decode = "generate"
        if decode == "cached" and not self.device.startswith("cpu"):
            decode = "loop"  # the episode store keeps its tensors on the CPU
        self.decode_mode = decode
        self.episode_kv = hf_episode_kv.EpisodeKV() if decode == "cached" else None

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
        return hf_decode.vision_batch(self.codec, ids, [png for r in requests for png in r.images], self.model.dtype)

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
        """Sample one response per request in one batched call (the decode loop or ``generate``).

        With a ``sample_key`` on every request, each row samples from its own stream (Gumbel-max
        over the processed logits, then greedy decoding): see "Keyed sampling" in
        :mod:`worldloop.actor.generation`.
        """
        if not requests:
            return []
        validate_requests(requests, max_new_tokens, self._vocab)
        keys = [r.sample_key for r in requests]
        pick = hf_decode.sampler(temperature, top_p, keys)
        with torch.random.fork_rng(devices=[self.device] if self.device.startswith("cuda") else []):
            if seed is not None:
                torch.manual_seed(seed)
            if self.decode_mode == "cached":
                new, logits = hf_episode_kv.decode_cached(self.model, self.codec, requests, pick, self.episode_kv,
                                                          max_new_tokens=int(max_new_tokens), masked_ids=self._masked)
            elif self.decode_mode == "loop":
                new, logits = hf_decode.decode(self.model, self._batch(requests), pick, max_new_tokens=int(max_new_tokens),
                                               eos_token_ids=self.codec.eos_token_ids, pad_token_id=self.codec.pad_token_id,
                                               masked_ids=self._masked)
            else:
                new, logits = self._generate(self._batch(requests), keys, temperature, top_p, max_new_tokens)
        new, logits = new.cpu(), logits.float().cpu()  # logits: [B, T, V], raw (pre-processing)
        logits[..., self._masked] = float("-inf")  # the distribution sampled from: prompt-only tokens masked
        sample = temperature > 0
        logp = torch.log_softmax(logits / (temperature if sample else 1.0), dim=-1)
        token_lp = logp.gather(-1, new[:, : logits.shape[1]].unsqueeze(-1)).squeeze(-1)
        return [self._result(new[i], token_lp[i]) for i in range(len(requests))]

    def _generate(self, batch: dict[str, torch.Tensor], keys: list, temperature: float, top_p: float,
                  max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``transformers``' ``generate``: the new tokens [B, T] and the raw logits [B, T, V]."""
        sample = temperature > 0
        if sample and all(k is not None for k in keys):
            from transformers import LogitsProcessorList

            width = batch["input_ids"].shape[1]

            def keyed(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                return keyed_gumbel_scores(scores, keys, input_ids.shape[1] - width, temperature, top_p)

            kwargs = dict(do_sample=False, logits_processor=LogitsProcessorList([keyed]))
        elif sample:
            kwargs = dict(do_sample=True, temperature=float(temperature), top_p=float(top_p), top_k=0)
        else:
            kwargs = dict(do_sample=False)
        out = self.model.generate(
            **batch,
            **kwargs,
            max_new_tokens=int(max_new_tokens),
            eos_token_id=self.codec.eos_token_ids,
            pad_token_id=self.codec.pad_token_id,
            bad_words_ids=[[i] for i in self._masked] or None,  # prompt-only tokens: -inf, first
            output_logits=True,
            return_dict_in_generate=True,
            use_cache=True,
        )
        return out.sequences[:, batch["input_ids"].shape[1] :], torch.stack(out.logits, dim=1)

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
        """Copy a full state dict (with LoRA: exactly the adapter tensors) into the model in place
        (all-or-nothing), then set ``version``. A set whose names or shapes do not fit, or with a
        NaN/inf anywhere, raises WeightUpdateError and changes nothing (as the vLLM backend)."""
        own = self.model.state_dict()
        if self.lora:
            own = {k: v for k, v in own.items() if common_lora.is_adapter_name(k)}
        check_state_dict(self.model, tensors, own)
        check_finite(tensors)
        for k, t in tensors.items():
            own[k].copy_(t.to(device=own[k].device, dtype=own[k].dtype))
        if self.episode_kv is not None:
            self.episode_kv.clear()  # keys and values of the old weights
        self.version = int(version)

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()
