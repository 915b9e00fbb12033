"""A copy of a tied-embedding model that, unmasked, samples a prompt-only token almost every time.

    favour_prompt_only(model_dir, out_dir, scale=200.0) -> (out_dir, favoured ids)

The tests of the prompt-only mask (``ChatCodec.prompt_only_ids``) need a model that really wants
those tokens, on every backend (transformers, in-process vLLM, inference servers), so the weights
on disk are changed, not a module in memory: the output rows of ``<|vision_pad|>`` and
``<|video_pad|>`` (tied to the input embeddings, and never in a prompt, so nothing else changes)
become ``+scale * n`` and ``-scale * n`` for a fixed unit direction ``n``. Their logits are then
``+-scale * (h . n)`` for the last hidden state ``h``: whichever sign ``h . n`` has, one of the two
beats every ordinary logit by tens of nats. Every other token's logit is unchanged, so under the
mask the distribution is the original model's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

FAVOURED = ("<|vision_pad|>", "<|video_pad|>")


def favour_prompt_only(model_dir: str | Path, out_dir: str | Path, scale: float = 200.0) -> tuple[Path, list[int]]:
    from safetensors.torch import load_file, save_file
    from transformers import PreTrainedTokenizerFast

    src, out = Path(model_dir), Path(out_dir)
    shutil.copytree(src, out)
    tok = PreTrainedTokenizerFast.from_pretrained(str(out), local_files_only=True)
    ids = [int(tok.convert_tokens_to_ids(t)) for t in FAVOURED]
    path = out / "model.safetensors"
    state = load_file(str(path))
    (key,) = [k for k in state if k.endswith("embed_tokens.weight")]
    emb = state[key]
    n = torch.nn.functional.normalize(torch.randn(emb.shape[1], generator=torch.Generator().manual_seed(0)), dim=0)
    emb[ids[0]] = (scale * n).to(emb.dtype)
    emb[ids[1]] = (-scale * n).to(emb.dtype)
    save_file(state, str(path), metadata={"format": "pt"})
    return out, ids
