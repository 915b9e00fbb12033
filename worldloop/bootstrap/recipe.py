"""The recipe of a warm start: what decides the model a run starts from, hashed, and recorded in
the model's ``recipe.json``.

Public API::

    BUILDER_VERSION: int                       # bump when the pipeline changes what it makes
    RECIPE_FILE = "recipe.json"
    recipe_keys(cfg) -> dict                   # the config values that decide the model
    recipe_hash(cfg) -> str                    # sha256 of BUILDER_VERSION and recipe_keys (16 hex)
    tokenizer_hash(model_dir) -> str           # the tokenizer's vocabulary, merges, special tokens, template
    data_fingerprint(cfg, model_dir) -> str    # the first grounding examples and demonstrations, tokenized
    code_fingerprint(cfg) -> dict              # {"tokenizer", "data"} as the code makes them now
    read_recipe(model_dir) -> dict | None

**The config keys.** :func:`recipe_keys` reads exactly what ``worldloop/bootstrap/pipeline.py``
hands to the tiny model, grounding pre-training and SFT: ``run.seed``,
``model.tiny_copy_pretrain_steps``; once the model is trained (grounding or SFT on):
``model.max_image_side``, ``model.freeze_vision`` and the ``id`` and ``kwargs`` of every env of
``actor.envs`` (after ``judge.rule_mode`` has set their ``relation_prompt``); with grounding
(``model.tiny_grounding_steps`` > 0) the ``model.tiny_grounding_*`` keys; with ``sft.enabled``
every ``sft.*`` key and ``actor.max_turns``. Keys that only change a report (the format probe's
``actor.temperature``/``top_p``/``max_new_tokens``) or what happens after the warm start (trainer,
judge, eval, ...) are left out: configs that differ only there share one model.

**The code.** What the code does with those keys is covered twice: :data:`BUILDER_VERSION`, which
a change to the pipeline's meaning bumps (it is part of the hash), and :func:`code_fingerprint`,
which catches the changes nobody bumped for: the tokenizer (trained on the envs' own prompts and
expert answers) and the tokens and pixels of the first :data:`FINGERPRINT_EXAMPLES` grounding
examples and demonstrations (the env prompts, the demonstrator, the answer style). The shipped
models' test compares all of them; a model cached on a user's machine is keyed by both
(:mod:`worldloop.bootstrap.store`).
"""

from __future__ import annotations

import hashlib
import io
import json
import tempfile
from pathlib import Path
from typing import Any

from worldloop.common.contracts.config import Config

BUILDER_VERSION = 1
RECIPE_FILE = "recipe.json"
FINGERPRINT_EXAMPLES = 4  # grounding examples (per prompt form) and demonstrations hashed into the data fingerprint
GROUNDING_KEYS = ("tiny_grounding_steps", "tiny_grounding_lr", "tiny_grounding_batch_size", "tiny_grounding_seed_start",
                  "tiny_grounding_agent_every", "tiny_grounding_agent_batch_size")


def _sha(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


_LATER_DEFAULTS = {("level_pool", 1)}


def recipe_keys(cfg: Config) -> dict:
    """The config values that decide the model (see the module docstring), by dotted key."""
    m, s = cfg.model, cfg.sft
    keys: dict[str, Any] = {"run.seed": cfg.run.seed, "model.tiny_copy_pretrain_steps": m.tiny_copy_pretrain_steps,
                            "model.tiny_grounding_steps": m.tiny_grounding_steps, "sft.enabled": s.enabled}
    if m.tiny_grounding_steps or s.enabled:
        keys["model.max_image_side"] = m.max_image_side
        keys["model.freeze_vision"] = m.freeze_vision
        keys["actor.envs"] = [{"id": e.id, "kwargs": dict(e.kwargs)} for e in cfg.actor.envs]
    if m.tiny_grounding_steps:
        keys.update({f"model.{k}": getattr(m, k) for k in GROUNDING_KEYS})
    if s.enabled:
        # keys added after a warm start was shipped enter the recipe only when set, so its hash stays
        keys.update({f"sft.{k}": v for k, v in s.model_dump().items() if (k, v) not in _LATER_DEFAULTS})
        keys["actor.max_turns"] = cfg.actor.max_turns
    return keys


def recipe_hash(cfg: Config) -> str:
    """16 hex digits of sha256 over :data:`BUILDER_VERSION` and :func:`recipe_keys` (canonical JSON)."""
    return _sha({"builder_version": BUILDER_VERSION, "keys": recipe_keys(cfg)})[:16]


def tokenizer_hash(model_dir: str | Path) -> str:
    """sha256 of the tokenizer's content (vocabulary, merges, added tokens, chat template), not of
    its files' bytes, which another ``tokenizers`` version may write differently."""
    model_dir = Path(model_dir)
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges") or []]
    added = sorted((t["id"], t["content"]) for t in tok.get("added_tokens") or [])
    template = json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template")
    return _sha({"vocab": sorted(tok["model"]["vocab"].items()), "merges": merges, "added": added, "template": template})


def _pixels(image: Any) -> bytes:
    """The decoded RGB pixels of a PNG (bytes) or PIL image: PNG bytes differ between zlib builds."""
    from PIL import Image

    img = Image.open(io.BytesIO(image)) if isinstance(image, (bytes, bytearray)) else image
    return img.convert("RGB").tobytes()


def _update(h, ids: list[int], images: list) -> None:
    h.update(json.dumps(list(ids)).encode())
    for im in images:
        h.update(hashlib.sha256(_pixels(im)).digest())


def data_fingerprint(cfg: Config, model_dir: str | Path) -> str:
    """sha256 of the tokens and image pixels of the first :data:`FINGERPRINT_EXAMPLES` grounding
    examples (in both prompt forms grounding pre-training uses) and demonstrations (every turn), made
    with the tokenizer in ``model_dir`` exactly as the pipeline makes them; "" when the recipe trains
    nothing."""
    from worldloop.bootstrap.grounding import grounding_examples
    from worldloop.bootstrap.pipeline import demonstrations, env_specs, grounds_outlook
    from worldloop.common.contracts.modeling import ChatCodec

    m = cfg.model
    if not (m.tiny_grounding_steps or cfg.sft.enabled):
        return ""
    codec = ChatCodec(model_dir, max_image_side=m.max_image_side)
    h = hashlib.sha256()
    if m.tiny_grounding_steps:
        for form in ("observation", "agent"):
            for ex in grounding_examples(env_specs(cfg), FINGERPRINT_EXAMPLES, m.tiny_grounding_seed_start, codec,
                                         prompt=form, outlook=grounds_outlook(cfg)):
                _update(h, ex.prompt_ids + ex.answer_ids, ex.images)
    if cfg.sft.enabled:
        for demo in demonstrations(cfg, codec, FINGERPRINT_EXAMPLES, cfg.sft.seed_start):
            for turn in demo.turns:
                _update(h, turn.obs_ids + turn.response_ids, turn.images)
    return h.hexdigest()


def code_fingerprint(cfg: Config) -> dict:
    """``{"tokenizer": tokenizer_hash, "data": data_fingerprint}`` of the tokenizer the code trains
    now (a fresh untrained tiny model in a temporary folder: seconds) and of the config's first
    examples made with it."""
    from worldloop.bootstrap.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="worldloop-fingerprint-") as tmp:
        model_dir = make_tiny_model(Path(tmp) / "m", seed=cfg.run.seed)
        return {"tokenizer": tokenizer_hash(model_dir), "data": data_fingerprint(cfg, model_dir)}


def read_recipe(model_dir: str | Path) -> dict | None:
    """The ``recipe.json`` of a model directory, or None when it has none (or an unreadable one)."""
    try:
        return json.loads((Path(model_dir) / RECIPE_FILE).read_text())
    except (OSError, ValueError):
        return None
