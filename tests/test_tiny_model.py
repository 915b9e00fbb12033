"""The embedded tiny model: builds offline, deterministic, loads with the standard HF classes."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    PreTrainedTokenizerFast,
    Qwen2_5_VLForConditionalGeneration,
)

from worldloop.bootstrap.tiny_model import SPECIAL_TOKENS, copy_accuracy, make_tiny_model


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "vl", seed=0)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_vl_directory_loads_with_standard_classes(vl_dir: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        assert (vl_dir / name).is_file(), name
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(vl_dir, local_files_only=True)
    auto = AutoModelForImageTextToText.from_pretrained(vl_dir, local_files_only=True)
    assert type(auto) is Qwen2_5_VLForConditionalGeneration
    cfg = model.config
    text, vision = cfg.text_config, cfg.vision_config
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads) == (64, 2, 2, 1)
    head_dim = text.hidden_size // text.num_attention_heads
    assert head_dim == 32  # the smallest head size vLLM's CPU attention has a kernel for
    assert sum(text.rope_parameters["mrope_section"]) == head_dim // 2
    assert (vision.depth, vision.hidden_size, vision.patch_size, vision.spatial_merge_size) == (2, 64, 14, 2)
    tok = AutoTokenizer.from_pretrained(vl_dir, local_files_only=True)
    assert cfg.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert cfg.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    assert model.config.text_config.vocab_size >= len(tok)
    pre = json.loads((vl_dir / "preprocessor_config.json").read_text())
    assert (pre["patch_size"], pre["merge_size"], pre["max_pixels"]) == (14, 2, 224 * 224)


def test_same_seed_gives_identical_files_other_seed_differs(tmp_path: Path, vl_dir: Path) -> None:
    again = make_tiny_model(tmp_path / "again", seed=0)
    other = make_tiny_model(tmp_path / "other", seed=1)
    assert _sha(again / "model.safetensors") == _sha(vl_dir / "model.safetensors")
    assert _sha(again / "tokenizer.json") == _sha(vl_dir / "tokenizer.json")
    assert _sha(other / "model.safetensors") != _sha(vl_dir / "model.safetensors")


TEXTS = [
    "<|im_start|>user\nPush the box Up, then Left.<|im_end|>\n<|im_start|>assistant\n",
    "<think><observation>The box is above the player</observation></think><answer>Up,Down</answer>",
    "café vs cafe\u0301 — NFD and NFC; numbers 12345 and 3.14159\n\n  indented\ttab",
    "Ünïcödé 中文 emoji 🙂 and <image> placeholders #_OX√P",
]


def test_autotokenizer_and_fast_tokenizer_agree(vl_dir: Path) -> None:
    auto = AutoTokenizer.from_pretrained(vl_dir, local_files_only=True)
    fast = PreTrainedTokenizerFast.from_pretrained(vl_dir, local_files_only=True)
    assert type(auto).__name__ == "Qwen2Tokenizer"  # the class that re-installs Qwen's pre-tokenizer
    for text in TEXTS:
        ids = fast.encode(text, add_special_tokens=False)
        assert auto.encode(text, add_special_tokens=False) == ids, text
    # special tokens are single ids; the byte-level BPE decodes back to the NFC text
    assert fast.encode("<|im_end|>", add_special_tokens=False) == [fast.convert_tokens_to_ids("<|im_end|>")]
    assert fast.decode(fast.encode(TEXTS[2], add_special_tokens=False)) == "café vs café — NFD and NFC; numbers 12345 and 3.14159\n\n  indented\ttab"
    assert [fast.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))


def test_chat_template_renders_qwen_layout(vl_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(vl_dir, local_files_only=True)
    conv = [{"role": "user", "content": [{"type": "text", "text": "See "}, {"type": "image"}, {"type": "text", "text": " now"}]}]
    rendered = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nSee <|vision_start|><|image_pad|><|vision_end|> now<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_save_load_round_trip_keeps_outputs(vl_dir: Path, tmp_path: Path) -> None:
    model = AutoModelForImageTextToText.from_pretrained(vl_dir, local_files_only=True).eval()
    ids = torch.tensor([[1, 20, 30, 40, 2]])
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    model.save_pretrained(tmp_path / "copy")
    back = AutoModelForImageTextToText.from_pretrained(tmp_path / "copy", local_files_only=True).eval()
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, ref)


def test_text_arch_is_a_causal_lm(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "txt", arch="qwen2")
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert not (path / "preprocessor_config.json").exists()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 5, 6]])).logits
    assert logits.shape[:2] == (1, 3) and torch.isfinite(logits).all()


def test_existing_dir_reused_unless_forced(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "m", seed=0)
    first = _sha(path / "model.safetensors")
    assert make_tiny_model(path, seed=5) == path  # kept: a model already lives there
    assert _sha(path / "model.safetensors") == first
    make_tiny_model(path, seed=5, force=True)
    assert _sha(path / "model.safetensors") != first
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".m.build-")]  # no temp folder left


def test_custom_corpus_shapes_the_vocabulary(tmp_path: Path) -> None:
    corpus = ["zorblax quintessential zorblax"] * 50
    path = make_tiny_model(tmp_path / "c", arch="qwen2", corpus=corpus, vocab_size=300)
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    assert len(tok.encode(" zorblax", add_special_tokens=False)) == 1
    assert len(tok) <= 300


@pytest.mark.parametrize(
    "kwargs,why",
    [({"arch": "llama"}, "arch must be 'qwen2_5_vl' or 'qwen2', got 'llama'"),
     ({"vocab_size": 100}, "vocab_size must be >= 270 (bytes + special tokens), got 100"),
     ({"max_image_side": 100}, "max_image_side must be a positive multiple of 28, got 100"),
     ({"max_image_side": 0}, "max_image_side must be a positive multiple of 28, got 0"),
     ({"copy_pretrain_steps": -1}, "copy_pretrain_steps must be an int >= 0, got -1")],
)
def test_bad_arguments_raise(tmp_path: Path, kwargs: dict, why: str) -> None:
    with pytest.raises(ValueError, match=re.escape(why)):
        make_tiny_model(tmp_path / "bad", **kwargs)
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("preset", ["tiny-sokoban", "tiny-frozenlake"])
def test_presets_render_one_grid_cell_per_image_token(preset: str, vl_dir: Path) -> None:
    """The tiny presets draw each grid cell on exactly one merged 28x28 patch (one image token)."""
    import gymnasium
    import numpy as np

    from worldloop import envs  # noqa: F401  (registers worldloop/* ids)
    from worldloop.common.contracts.config import load_config
    from worldloop.common.contracts.modeling import MERGE, PATCH, ChatCodec, decode_png

    cfg = load_config(f"configs/{preset}.yaml")
    spec = cfg.actor.envs[0]
    env = gymnasium.make(spec.id, **spec.kwargs)
    try:
        obs, info = env.reset(seed=3)
        # Sokoban's crop_outer_wall draws the room without its outer ring of wall
        ring = 1 if spec.kwargs.get("crop_outer_wall") else 0
        cells = max(info["state"]["structured"]["grid_size"]) - 2 * ring
        player = tuple(info["state"]["structured"]["player_position"])
        pidx = (player[0] - ring) * cells + (player[1] - ring)
        if spec.kwargs.get("view") == "egocentric":  # FrozenLake: a 2n-1 window, the player in its middle
            cells = 2 * cells - 1
            pidx = (cells // 2) * cells + cells // 2
        image = obs["image"]
        assert image.shape == (cells * PATCH * MERGE, cells * PATCH * MERGE, 3)
        codec = ChatCodec(vl_dir, max_image_side=cfg.model.max_image_side)
        png = codec.prepare_image(image)
        assert np.array_equal(np.asarray(decode_png(png).convert("RGB")), image)  # not resized
        assert codec.image_pad_count(png) == cells * cells  # one token per cell
        # every cell is one sprite: the 28x28 blocks are the tiles, so block (r, c) is uniform in
        # kind: the player's block differs from all others
        blocks = image.reshape(cells, 28, cells, 28, 3).transpose(0, 2, 1, 3, 4).reshape(cells * cells, -1)
        assert all(not np.array_equal(blocks[pidx], blocks[i]) for i in range(cells * cells) if i != pidx)
    finally:
        env.close()


def test_copy_pretraining_gives_the_random_init_in_context_copying(tmp_path: Path, vl_dir: Path) -> None:
    """A random-init tiny model cannot continue a span it has seen earlier in its context; 300
    steps of copy pre-training (seconds) give it that, and the build records what it reached."""
    made = make_tiny_model(tmp_path / "copy", seed=0, copy_pretrain_steps=300)
    info = json.loads((made / "worldloop_tiny.json").read_text())
    assert info["copy_pretrain_steps"] == 300
    vocab = len(AutoTokenizer.from_pretrained(made))
    accs = {}
    for name, path in (("plain", vl_dir), ("copy", made)):
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        accs[name] = copy_accuracy(model, len(SPECIAL_TOKENS), vocab, torch.Generator().manual_seed(123))
    assert accs["plain"] < 0.05 and accs["copy"] > 0.9, accs
    assert abs(info["copy_accuracy"] - accs["copy"]) < 0.1  # fresh spans either way
    assert "copy_pretrain_steps" not in json.loads((vl_dir / "worldloop_tiny.json").read_text())
