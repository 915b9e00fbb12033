"""LoRA in the learner (``model.lora.rank`` > 0): adapters on policy and critic, the reference
without a copy, adapter-only versions, checkpoints and the merged export.

Public API::

    attach_models(cfg, hf, backbone) -> (peft policy, policy base, critic base or None)
    AdapterOffReference(policy_module, peft_model)  # the reference: the policy with its adapters disabled
    save_adapter(models, out)                       # adapter/ of a checkpoint (peft's format)
    merged_weights(models) -> dict[str, Tensor]     # the policy with its adapters folded in (the hf/ export)
    export_merged(base_dir, adapter_dir, out) -> Path   # base + adapter -> a plain HF model directory

What trains. Every base weight of the policy is frozen; only the adapters
(``common/lora.py``: ``model.lora.target_modules`` of the language model, and of the vision tower
too with ``model.lora.vision``) get gradients and AdamW state. The critic is its own backbone
(``AutoModel`` from ``model.path``, as without LoRA) with its own adapters of the same shape,
frozen base, and its zero-initialised value head, which trains in full.

The reference. With LoRA the reference is the base model, which is the policy with its adapters
switched off (peft's ``disable_adapter()``): no second copy of the weights is loaded. Its log-probs
are those of ``model.path`` exactly (tests/test_lora.py).

Weights. ``gather_policy_weights`` returns the adapter tensors only (``learner/engine.py``): the
learner publishes those on the weight channel (same protocol, checksums, versions and CURVE), and
the HF actor backend, built with the same ``model.lora``, copies them into its own adapters. A
checkpoint holds the DeepSpeed state without the frozen base weights (adapters, value head and
their optimizer state), ``adapter/`` in peft's format, and ``hf/``, the merged policy, which
``worldloop eval --model`` loads as before.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from worldloop.common import lora as common_lora

log = logging.getLogger(__name__)

ADAPTER_DIR = "adapter"


def attach_models(cfg: Any, hf: torch.nn.Module, backbone: torch.nn.Module | None):
    """Adapters on the policy (and on the critic's backbone); returns (policy ``PeftModel``, the
    policy's injected base model, the critic's injected backbone or None)."""
    lora = cfg.model.lora
    pm = common_lora.attach(hf, lora)
    critic = None
    if backbone is not None:
        critic = common_lora.attach(backbone, lora).get_base_model()
    n_train = sum(p.numel() for p in hf.parameters() if p.requires_grad)
    n_all = sum(p.numel() for p in hf.parameters())
    log.info("LoRA rank %d (alpha %g, dropout %g) on %s%s: %d of %d policy parameters train (%.2f%%)",
             lora.rank, lora.alpha, lora.dropout, ",".join(lora.target_modules),
             " (vision tower too)" if lora.vision else " (vision tower frozen)", n_train, n_all, 100.0 * n_train / n_all)
    return pm, pm.get_base_model(), critic


class AdapterOffReference:
    """The reference policy of a LoRA run: ``policy_module``'s forward with the adapters disabled.

    Called like the ``PolicyModule`` it stands for (``ref(batch, temperature=...)``), under
    ``torch.no_grad`` (the trainer's proximal pass). Not an ``nn.Module``: it owns no weights, and
    ``.eval()`` on it must not switch the policy out of training mode."""

    def __init__(self, policy_module: torch.nn.Module, peft_model: Any):
        self.policy_module = policy_module
        self.peft_model = peft_model

    @torch.no_grad()
    def __call__(self, batch: dict, temperature: float = 1.0, return_entropy: bool = False):
        with self.peft_model.disable_adapter():
            return self.policy_module(batch, temperature=temperature, return_entropy=return_entropy)


def save_adapter(models: Any, out: Path) -> None:
    """The policy's adapter in peft's format (``adapter_config.json``, ``adapter_model.safetensors``)."""
    models.lora.save_pretrained(str(out))


def merged_weights(models: Any) -> dict[str, torch.Tensor]:
    """The policy's full weights with the adapters folded in, under the plain HF names."""
    return common_lora.merged_state_dict(models.policy_hf)


_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def export_merged(base_dir: str | Path, adapter_dir: str | Path, out: str | Path) -> Path:
    """Base model + peft adapter -> a plain Hugging Face model directory at ``out`` (the adapters
    folded into the weights with peft's ``merge_and_unload``; the tokenizer and image-processor
    files of ``base_dir`` copied beside them). ``transformers`` loads it without peft."""
    from peft import PeftModel

    from worldloop.common.contracts.modeling import load_policy

    base_dir, out = Path(base_dir), Path(out)
    base = load_policy(base_dir, dtype="float32", device="cpu")
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    out.mkdir(parents=True, exist_ok=True)
    for f in base_dir.iterdir():
        if f.is_file() and f.name not in _WEIGHT_FILES and not f.name.endswith(".safetensors"):
            shutil.copy2(f, out / f.name)
    merged.save_pretrained(str(out), safe_serialization=True)
    return out
