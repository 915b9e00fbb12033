"""LoRA adapters (peft) on a Hugging Face policy: what the learner trains and the actors apply alike.

Public API::

    enabled(lora) -> bool                       # model.lora.rank > 0
    peft_config(lora) -> peft.LoraConfig        # from the config section model.lora
    attach(model, lora) -> peft.PeftModel       # adapters injected into ``model`` in place, the rest frozen
    is_adapter_name(name) -> bool               # a tensor of an adapter (".lora_A." / ".lora_B.")
    adapter_tensors(model) -> dict[str, Tensor] # the adapter tensors of an injected model, by state_dict name
    merged_state_dict(model) -> dict[str, Tensor]   # base + scale * B @ A under the plain HF names
    load_adapter_dir(path) -> dict[str, Tensor]     # a peft adapter directory's tensors under those names
    write_adapter_dir(tensors, lora, out)           # the inverse: an adapter-only version as a peft directory

Names. :func:`attach` returns peft's wrapper, whose ``get_base_model()`` is ``model`` itself with
every targeted ``nn.Linear`` replaced by a LoRA layer. The learner wraps that base model (not the
``PeftModel``) in its ``PolicyModule``, and the HF actor backend generates with it, so the tensor
names are the base model's ``state_dict()`` names on both sides, e.g.
``model.language_model.layers.0.self_attn.q_proj.lora_A.default.weight``. An adapter-only weight
version holds exactly the tensors :func:`adapter_tensors` returns; learner and actor build their
adapters from the same ``model.lora`` section, so the names and shapes agree.

Vision. ``model.lora.vision`` false keeps every module under a ``visual`` submodule (the Qwen2.5-VL
vision tower and its merger) out of the adapters (peft's ``exclude_modules``): the tower stays at
its base weights, like every other base weight.
"""

from __future__ import annotations

from typing import Any

import torch

ADAPTER = "default"  # peft's adapter name: one adapter per model
# any module under a submodule named "visual" (the policy: model.visual..., the critic's bare backbone: visual...)
VISION_MODULES = r"(.*\.)?visual(\..*)?"


def enabled(lora: Any) -> bool:
    return lora is not None and int(lora.rank) > 0


def peft_config(lora: Any):
    from peft import LoraConfig

    return LoraConfig(r=int(lora.rank), lora_alpha=float(lora.alpha), lora_dropout=float(lora.dropout),
                      target_modules=list(lora.target_modules), exclude_modules=None if lora.vision else VISION_MODULES,
                      bias="none")


def attach(model: torch.nn.Module, lora: Any):
    """Inject LoRA adapters into ``model`` (in place) and freeze every base weight; return the
    ``PeftModel`` (for ``disable_adapter()`` and saving). ``ValueError`` when no module matches
    ``model.lora.target_modules``."""
    from peft import get_peft_model

    config = peft_config(lora)
    if not any(name == "visual" or name.endswith(".visual") for name, _ in model.named_modules()):
        config.exclude_modules = None  # a text-only model: nothing to keep out (and no warning from peft)
    try:
        pm = get_peft_model(model, config)
    except ValueError as e:
        raise ValueError(f"model.lora.target_modules {list(lora.target_modules)} match no layer of the model: {e}") from e
    return pm


def is_adapter_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapter_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors of an injected model (detached, live), by ``state_dict`` name."""
    return {n: p.detach() for n, p in model.named_parameters() if is_adapter_name(n)}


@torch.no_grad()
def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The injected ``model``'s weights with the adapters folded in (``W + alpha / r * B @ A``),
    under the plain HF names (``...q_proj.weight``): what ``save_pretrained`` writes as a model
    ``transformers`` loads without peft. ``model`` is left as it is (nothing merged in place)."""
    from peft.tuners.lora import LoraLayer

    deltas = {}
    for name, m in model.named_modules():
        if isinstance(m, LoraLayer) and ADAPTER in m.lora_A:
            deltas[f"{name}.base_layer.weight"] = m.get_delta_weight(ADAPTER)
    out = {}
    for name, t in model.state_dict().items():
        if is_adapter_name(name):
            continue
        if name in deltas:
            t = (t.float() + deltas[name].float()).to(t.dtype)
        out[name.replace(".base_layer.", ".")] = t.detach()
    return out


_PEFT_PREFIX = "base_model.model."


def load_adapter_dir(path) -> dict[str, torch.Tensor]:
    """The tensors of a peft adapter directory (``adapter_model.safetensors``, as ``save_pretrained``
    writes it: ``base_model.model.<name>.lora_A.weight``) under the injected model's names
    (``<name>.lora_A.default.weight``), as an adapter-only version holds them."""
    from pathlib import Path

    from safetensors.torch import load_file

    out = {}
    for name, t in load_file(str(Path(path) / "adapter_model.safetensors")).items():
        name = name.removeprefix(_PEFT_PREFIX)
        for part in (".lora_A.", ".lora_B."):
            name = name.replace(part, f"{part}{ADAPTER}.")
        out[name] = t
    return out


def write_adapter_dir(tensors: dict[str, torch.Tensor], lora: Any, out) -> None:
    """An adapter-only version (the injected model's names) as a peft adapter directory at ``out``
    (``adapter_config.json`` + ``adapter_model.safetensors``), which vLLM's ``LoRARequest`` loads."""
    from pathlib import Path

    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    peft_config(lora).save_pretrained(str(out))
    named = {}
    for name, t in tensors.items():
        for part in (".lora_A.", ".lora_B."):
            name = name.replace(f"{part}{ADAPTER}.", part)
        named[_PEFT_PREFIX + name] = t.detach().to("cpu").contiguous()
    save_file(named, str(out / "adapter_model.safetensors"))
