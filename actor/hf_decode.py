"""The HF backend's own decode loop: the tokens and log-probs of ``transformers``' ``generate``, bit
for bit on the CPU, in about two thirds of its CPU time on the tiny presets.

    supports(model) -> bool                      # Qwen2.5-VL, SDPA, full attention, no extra processors
    decode(model, batch, pick, *, max_new_tokens, eos_token_ids, pad_token_id, masked_ids)
        -> (tokens [B, T], logits [B, T, V])     # T <= max_new_tokens; logits raw (before the mask)
    sampler(temperature, top_p, keys) -> pick    # pick(scores [B, V], step) -> next token ids [B]

Why: on a 2-layer, 64-wide model ``generate`` spends its time in Python, not in arithmetic
(``bench/generation.py``): each new token goes through the generation loop's processors and
stopping criteria, the model's output wrappers, a fresh causal mask, a cache that concatenates the
whole context once per layer, and the prefill attends through a boolean mask, which sends CPU SDPA
to a slower kernel than an additive one.

What it does, and why the result does not change:
* **Prefill** is the model's own forward over the left-padded batch, with the position ids
  ``generate`` builds (text positions from the attention mask, the 3D ones from
  ``get_rope_index``) and the causal-and-padding mask as an *additive* float mask (0 where a
  position may attend, the dtype's minimum where not) instead of a boolean one. Both select the
  same keys, and CPU SDPA gives the real rows the same bits (the padded query rows, which nothing
  reads, differ). With no padding the mask is left out, as ``generate`` does.
* **Each new token** runs the same modules (embedding, norms, projections, MLP; with LoRA their
  adapters), the same rotary embedding and ``apply_rotary_pos_emb``, and transformers' own
  ``sdpa_attention_forward`` with the boolean mask ``generate`` passes; keys and values are
  written into buffers sized for the whole response instead of concatenated each step.
* **Sampling** takes the raw logits, masks the prompt-only tokens with -inf, then ``pick``: the
  keyed Gumbel-max of :mod:`worldloop.actor.generation`, or the same temperature and top-p warpers
  and ``torch.multinomial`` as ``generate`` (same random stream), or greedy ``argmax``. Rows that
  have ended take the pad token, and the loop stops when every row has ended or after
  ``max_new_tokens``, as ``generate`` does.

``tests/test_hf_decode.py`` checks tokens and log-probs equal to ``generate``'s (compared with ``==``)
in every sampling mode, with and without padding, images and LoRA, on the CPU (it has not run
on a GPU, where SDPA picks other kernels). A model this loop does not know (another architecture,
eager attention, sliding windows, a generation config with a repetition penalty or another
processor of its own) keeps ``generate``. This is ``actor.hf_decode: loop``; ``cached`` (the default,
:mod:`worldloop.actor.hf_episode_kv`) runs the same token loop after a prefill of only what each
episode did not hold from its last turn.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

Pick = Callable[[torch.Tensor, int], torch.Tensor]


# generation_config.json settings that make ``generate`` add a logits processor of its own (value: the
# settings that add none). Released Qwen2.5-VL checkpoints set repetition_penalty 1.05: those keep
# ``generate``, whose samples then differ from the distribution the learner trains on, as before.
_NEUTRAL = {"repetition_penalty": (None, 1.0), "encoder_repetition_penalty": (None, 1.0), "no_repeat_ngram_size": (None, 0),
            "encoder_no_repeat_ngram_size": (None, 0), "bad_words_ids": (None,), "min_length": (None, 0),
            "min_new_tokens": (None, 0), "suppress_tokens": (None,), "begin_suppress_tokens": (None,),
            "forced_bos_token_id": (None,), "forced_eos_token_id": (None,), "sequence_bias": (None,),
            "exponential_decay_length_penalty": (None,), "renormalize_logits": (None, False), "typical_p": (None, 1.0),
            "min_p": (None,), "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0), "guidance_scale": (None, 1.0),
            "watermarking_config": (None,), "top_h": (None,)}


def supports(model: torch.nn.Module) -> bool:
    """Whether :func:`decode` reproduces ``generate`` for ``model``: a Qwen2.5-VL model with SDPA,
    full attention in every layer, and a generation config that adds no logits processor."""
    try:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
    except ImportError:  # pragma: no cover - transformers without Qwen2.5-VL
        return False
    if not isinstance(model, Qwen2_5_VLForConditionalGeneration):
        return False
    text = model.config.get_text_config()
    gen = getattr(model, "generation_config", None)
    if gen is not None and any(getattr(gen, k, None) not in neutral for k, neutral in _NEUTRAL.items()):
        return False
    return (getattr(text, "_attn_implementation", None) == "sdpa" and not getattr(text, "use_sliding_window", False)
            and set(getattr(text, "layer_types", None) or ["full_attention"]) == {"full_attention"})


def sampler(temperature: float, top_p: float, keys: Sequence[int | None] | None = None) -> Pick:
    """How the next token is drawn from the masked logits: as ``generate`` draws it."""
    if temperature <= 0:
        return lambda scores, step: torch.argmax(scores, dim=-1)
    if keys is not None and all(k is not None for k in keys):
        from worldloop.actor.generation import keyed_gumbel_scores

        return lambda scores, step: torch.argmax(keyed_gumbel_scores(scores, list(keys), step, temperature, top_p), dim=-1)
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    warpers = [TemperatureLogitsWarper(float(temperature))] if float(temperature) != 1.0 else []
    if float(top_p) < 1.0:
        warpers.append(TopPLogitsWarper(float(top_p)))

    def pick(scores: torch.Tensor, step: int) -> torch.Tensor:
        for w in warpers:
            scores = w(None, scores)
        return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)

    return pick


def _positions(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[4, B, L]: the text positions, then the three rotary ones (``generate``'s position ids)."""
    am = batch["attention_mask"]
    text = (am.long().cumsum(-1) - 1).masked_fill(am == 0, 0)
    if batch.get("mm_token_type_ids") is not None and batch.get("image_grid_thw") is not None:
        rope, _ = model.model.get_rope_index(batch["input_ids"], mm_token_type_ids=batch["mm_token_type_ids"],
                                             image_grid_thw=batch["image_grid_thw"], attention_mask=am)
    else:
        rope = text.unsqueeze(0).expand(3, -1, -1)
    return torch.cat([text.unsqueeze(0), rope.to(text.dtype)], dim=0)


def vision_batch(codec, ids: torch.Tensor, images, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``mm_token_type_ids`` for the token ids ``ids`` and, with images, their ``pixel_values`` (in
    ``dtype``) and ``image_grid_thw``; ValueError unless the ids hold exactly the images' image tokens."""
    found = int((ids == codec.image_token_id).sum())
    vis = codec.vision_inputs(images)
    expected = int(vis["image_grid_thw"].prod(-1).sum()) // 4 if vis else 0
    if found != expected:
        raise ValueError(f"prompts hold {found} image tokens but their {len(images)} image(s) need {expected}")
    out = {"mm_token_type_ids": (ids == codec.image_token_id).long()}
    if vis:
        out["pixel_values"] = vis["pixel_values"].to(dtype)
        out["image_grid_thw"] = vis["image_grid_thw"]
    return out


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask as an additive one: 0 where allowed, the dtype's minimum where not."""
    return torch.where(allowed, torch.tensor(0.0, dtype=dtype, device=allowed.device),
                       torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=allowed.device))


def _prefill_mask(am: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The causal-and-padding mask as an additive [B, 1, L, L] (None without padding)."""
    if bool(am.all()):
        return None
    width = am.shape[1]
    return additive_mask(torch.ones(width, width, dtype=torch.bool, device=am.device).tril()[None, None]
                         & am.bool()[:, None, None, :], dtype)


class _KV:
    """Per layer, keys and values in buffers with room for the whole response."""

    def __init__(self, cache, extra: int):
        self.keys, self.values = [], []
        for layer in cache.layers:
            for src, dst in ((layer.keys, self.keys), (layer.values, self.values)):
                b, h, n, d = src.shape
                buf = src.new_empty(b, h, n + extra, d)
                buf[:, :, :n] = src
                dst.append(buf)
        self.length = cache.layers[0].keys.shape[2]

    @classmethod
    def right_aligned(cls, caches: list, extra: int) -> tuple["_KV", torch.Tensor]:
        """One row per single-row cache, each right-aligned to the longest (zeros before), and the
        [B, length] mask of the positions that hold a key."""
        lengths = [c.layers[0].keys.shape[2] for c in caches]
        width = max(lengths)
        kv = cls.__new__(cls)
        kv.keys, kv.values, kv.length = [], [], width
        for layer in range(len(caches[0].layers)):
            for name, dst in (("keys", kv.keys), ("values", kv.values)):
                ref = getattr(caches[0].layers[layer], name)
                buf = ref.new_zeros(len(caches), ref.shape[1], width + extra, ref.shape[3])
                for i, c in enumerate(caches):
                    buf[i, :, width - lengths[i] : width] = getattr(c.layers[layer], name)[0]
                dst.append(buf)
        real = torch.zeros(len(caches), width, dtype=torch.bool, device=kv.keys[0].device)
        for i, n in enumerate(lengths):
            real[i, width - n :] = True
        return kv, real

    def append(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.length
        self.keys[i][:, :, n : n + 1] = k
        self.values[i][:, :, n : n + 1] = v
        return self.keys[i][:, :, : n + 1], self.values[i][:, :, : n + 1]


def _step(model, tok: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None, kv: _KV) -> torch.Tensor:
    """The logits [B, V] after one more token per row (``pos``: its [3, B, 1] rotary position ids)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb

    lm = model.model.language_model
    h = lm.embed_tokens(tok.unsqueeze(1))
    cos, sin = lm.rotary_emb(h, pos)
    b = h.shape[0]
    for i, layer in enumerate(lm.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = attn.q_proj(x).view(b, 1, -1, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, 1, -1, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(b, 1, -1, attn.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys, values = kv.append(i, k, v)
        out, _ = sdpa_attention_forward(attn, q, keys, values, mask, dropout=0.0, scaling=attn.scaling)
        h = h + attn.o_proj(out.reshape(b, 1, -1).contiguous())
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    kv.length += 1
    return model.lm_head(lm.norm(h))[:, -1, :]


def _sample(model, logits: torch.Tensor, pos: torch.Tensor, keys_real: torch.Tensor | None, kv: _KV, pick: Pick, *,
            max_new_tokens: int, eos_token_ids: Sequence[int], pad_token_id: int,
            masked_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The token loop after a prefill: ``logits`` [B, V] of each row's last prompt token, ``pos`` its
    [3, B, 1] rotary positions, ``keys_real`` [B, kv.length] the cached positions a row may attend
    to (None: all of them)."""
    rows = logits.shape[0]
    eos = torch.tensor(list(eos_token_ids), device=logits.device)
    masked = list(masked_ids)
    finished = torch.zeros(rows, dtype=torch.bool, device=logits.device)
    mask = None if keys_real is None else torch.cat([keys_real, keys_real.new_ones(rows, max_new_tokens)], 1)
    tokens, raw = [], []
    for step in range(max_new_tokens):
        step_logits = logits.to(dtype=torch.float32, copy=True)
        raw.append(step_logits)
        scores = step_logits.clone()
        if masked:
            scores[:, masked] = float("-inf")
        tok = pick(scores, step)
        tok = torch.where(finished, torch.full_like(tok, pad_token_id), tok)
        tokens.append(tok)
        finished |= torch.isin(tok, eos)
        if bool(finished.all()) or step == max_new_tokens - 1:
            break
        pos = pos + 1
        step_mask = None if mask is None else mask[:, None, None, : kv.length + 1]
        logits = _step(model, tok, pos, step_mask, kv)
    return torch.stack(tokens, dim=1), torch.stack(raw, dim=1)


@torch.no_grad()
def decode(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    pick: Pick,
    *,
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    masked_ids: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generate up to ``max_new_tokens`` per row of the left-padded ``batch`` (``input_ids``,
    ``attention_mask``, and for images ``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids``).

    Returns the new tokens [B, T] (pad after a row's EOS) and each step's raw logits [B, T, V].
    """
    from transformers import DynamicCache

    am = batch["attention_mask"]
    pos = _positions(model, batch)
    cache = DynamicCache(config=model.config)
    vision = {k: batch[k] for k in ("pixel_values", "image_grid_thw", "mm_token_type_ids") if batch.get(k) is not None}
    out = model(input_ids=batch["input_ids"], attention_mask={"full_attention": _prefill_mask(am, model.dtype)},
                position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1, **vision)
    kv = _KV(cache, max_new_tokens)
    return _sample(model, out.logits[:, -1, :], pos[1:, :, -1:], None if bool(am.all()) else am.bool(), kv, pick,
                   max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
                   masked_ids=masked_ids)
