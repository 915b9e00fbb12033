"""The embedded default model: a tiny Qwen2.5-VL (or Qwen2 text-only) built offline in seconds.

Public API::

    make_tiny_model(path, *, arch="qwen2_5_vl", seed=0, corpus=None, vocab_size=2048,
                    force=False, max_image_side=224, copy_pretrain_steps=0, rope_theta=ROPE_THETA) -> Path
    default_corpus() -> list[str]          # env prompts + expert answers (or the built-in fallback)
    fallback_corpus() -> list[str]         # the built-in synthetic part alone (fixed, for tests)
    SPECIAL_TOKENS: list[str]              # Qwen's special tokens, ids 0..len-1 in the tiny vocab
    CHAT_TEMPLATE: str                     # Qwen2.5-VL-style chat template (jinja)

What is written to ``path`` (a normal Hugging Face model directory, nothing downloaded):

* ``tokenizer.json`` + ``tokenizer_config.json``: a byte-level BPE trained locally with
  ``tokenizers`` on :func:`default_corpus` (or ``corpus``), with NFC normalisation and Qwen's
  split regex + ByteLevel pre-tokenisation, so ``AutoTokenizer`` (which loads ``Qwen2Tokenizer``
  and re-installs exactly these components) and ``PreTrainedTokenizerFast`` give identical ids.
  The special tokens of Qwen2.5-VL occupy ids ``0..len(SPECIAL_TOKENS)-1``; ``<|im_end|>`` is the
  EOS of chat generation, ``<|endoftext|>`` the pad token.
* ``config.json`` + ``model.safetensors`` (+ ``generation_config.json``): for
  ``arch="qwen2_5_vl"`` a ``Qwen2_5_VLForConditionalGeneration`` with text hidden 64, 2 layers,
  2 query / 1 KV heads (head_dim 32: vLLM's CPU attention has kernels for head sizes 32, 64, 80, ...
  but not 16; ``mrope_section`` [4, 6, 6] sums to 16; RoPE base ``rope_theta`` 10, not Qwen's 1e6, so
  that one board cell turns the height/width sections by a visible angle), vision depth 2,
  hidden 64, patch 14, spatial merge 2; for ``arch="qwen2"`` a ``Qwen2ForCausalLM`` of the same
  text size. Weights are a random init under ``torch.manual_seed(seed)``: the same arguments give
  byte-identical weight files. Embeddings are tied.
* ``preprocessor_config.json`` (VL only): a ``Qwen2VLImageProcessor`` whose pixel bounds
  (``min_pixels`` 28*28, ``max_pixels`` ``max_image_side``**2) leave the codec's already-resized
  images (sides multiples of 28, <= ``max_image_side``) untouched.

The build is written to a temporary sibling folder and renamed into place, so several processes
calling ``make_tiny_model`` on the same path at once all end up with one complete directory. An
existing directory (one holding ``config.json``) is returned as is unless ``force=True``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Literal

from worldloop.common.contracts.modeling import DEFAULT_SYSTEM, MERGE, PATCH, TEMPORAL_PATCH

log = logging.getLogger(__name__)

Arch = Literal["qwen2_5_vl", "qwen2"]

SPECIAL_TOKENS: list[str] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]


# Qwen2.5-VL's template, reduced to what worldloop renders: string or list content, images as
# one <|image_pad|> each (the codec / processor expands it to the image's token count).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\n" + DEFAULT_SYSTEM + "<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TEXT_HIDDEN = 64
TEXT_LAYERS = 2
TEXT_HEADS = 2
TEXT_KV_HEADS = 1
TEXT_INTERMEDIATE = 128
MROPE_SECTION = [4, 6, 6]  # sums to head_dim / 2 = (64 / 2) / 2 = 16
# The text RoPE base. Qwen2.5-VL's 1e6 with a 32-dim head turns one image row into 0.03-0.001 rad and
# one column into < 2e-4 rad (M-RoPE gives height and width the lowest frequencies), so a tiny model
# trained from scratch cannot tell where on the board an image token is: it never learnt a relation
# such as "goal is above the player" (docs/learning-history.md "Why the tiny model could not see"). With base 10 a
# cell moves the height section by 0.56-0.27 rad and the width section by 0.24-0.12 rad.
ROPE_THETA = 10.0
VISION_DEPTH = 2
VISION_HIDDEN = 64
VISION_HEADS = 4
IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]
IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]


# --------------------------------------------------------------------------- corpus

_ACTIONS = ["Left", "Down", "Right", "Up"]
_SYMBOLS = "# _ O X P √ S".split()


def _fallback_system_prompt() -> str:
    return (
        "You are a Sokoban solver.\nSokoban Quick Guide\nGoal: Push all boxes onto targets.\n"
        "Symbols (If image is provided there are no symbols):\n"
        "# Wall | _ Floor | O Target | X Box | P You | √ Box on Target | S You on Target\n"
        "Rules:\n1. Push boxes (can't pull).\n2. Avoid walls.\n"
        "Actions you can take: Left, Down, Right, Up.\n"
        "You can take up to 3 action(s) at a time, separated by ,.\n"
        "You should first give the description of your observation, then your reasoning, then "
        "predict the next state, and finally your answer.\nYour response should be in the format of:\n"
        "<think><observation>...</observation><reasoning>...</reasoning><prediction>...</prediction>"
        "</think><answer>...</answer>"
    )


def _fallback_turns(rng_seed: int, n: int) -> list[str]:
    """Deterministic synthetic user prompts and expert-style answers in the VAGEN format."""
    import random

    rng = random.Random(rng_seed)
    dirs = ["above", "below", "left of", "right of", "at the upper-left of", "at the lower-right of"]
    out: list[str] = []
    for i in range(n):
        obj = rng.choice(["box", "target", "wall", "goal", "hole", "passenger"])
        rel = rng.choice(dirs)
        acts = ",".join(rng.choice(_ACTIONS) for _ in range(rng.randint(1, 3)))
        grid = "\n".join("".join(rng.choice(_SYMBOLS) for _ in range(6)) for _ in range(6))
        head = "[Initial Observation]:" if i % 3 == 0 else f"After your answer, the extracted valid action is {acts}.\n[Current Observation]:"
        out.append(
            f"{head}\n<image>\n{grid}\nDecide your next action(s).\n"
            "You can take up to 3 action(s) at a time, separated by ,."
        )
        out.append(
            f"<think><observation>The {obj} is {rel} the player.</observation>"
            f"<reasoning>I need to move {acts.replace(',', ' then ')} to get closer.</reasoning>"
            f"<prediction>The player will be {rng.choice(dirs)} the {obj}.</prediction></think>"
            f"<answer>{acts}</answer>"
        )
    return out


def _env_corpus(episodes_per_env: int = 4, turns: int = 3) -> list[str]:
    """Prompts and expert answers of the registered worldloop envs; [] when ``envs`` is absent."""
    try:
        import gymnasium
        from worldloop import envs  # noqa: F401  (registers worldloop/* ids)
    except Exception:  # envs not importable: the fallback corpus covers the format
        return []
    texts: list[str] = []
    ids = sorted(k for k in gymnasium.registry if k.startswith("worldloop/"))
    for env_id in ids:
        texts.extend(_play_for_corpus(env_id, episodes_per_env, turns))
    return texts


def _play_for_corpus(env_id: str, episodes: int, turns: int) -> list[str]:
    import gymnasium

    texts: list[str] = []
    env = None
    vision = {"render_mode": "vision", "prompt_format": "grounding_worldmodeling"}
    # renderers with a time limit (the SVG env's worker) get a generous one: under heavy load a 3 s
    # limit could cut the corpus short and so silently change the tokenizer, and the model with it
    for kwargs in ({**vision, "render_timeout_s": 120.0}, vision, {}):
        try:
            env = gymnasium.make(env_id, **kwargs)
            break
        except Exception as e:  # an env that cannot be built here contributes nothing
            log.debug("corpus: cannot make %s with %s: %s", env_id, kwargs, e)
    if env is None:
        return texts
    try:
        for ep in range(episodes):
            obs, _ = env.reset(seed=ep)
            texts.append(str(env.unwrapped.system_prompt()))
            for _ in range(turns):
                texts.append(str(obs["text"]) if isinstance(obs, dict) else str(obs))
                answer = str(env.unwrapped.expert_response())
                texts.append(answer)
                obs, _, term, trunc, _ = env.step(answer)
                if term or trunc:
                    break
    except Exception as e:
        log.warning("corpus: %s stopped early (the tokenizer is then not the usual one): %s", env_id, e)
    finally:
        env.close()
    return texts


def fallback_corpus() -> list[str]:
    """Synthetic VAGEN-format prompts and answers that need no env (fixed: tests pin it)."""
    return [_fallback_system_prompt()] + _fallback_turns(0, 200)


def default_corpus() -> list[str]:
    """The tokenizer's training corpus: env texts when ``envs`` imports, always the fallback too."""
    return _env_corpus() + fallback_corpus()


# --------------------------------------------------------------------------- tokenizer


def _train_tokenizer(corpus: list[str], vocab_size: int):
    """Byte-level BPE with Qwen2Tokenizer's normaliser / pre-tokeniser / decoder."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def _save_tokenizer(tok, out: Path, arch: Arch) -> int:
    """Wrap as PreTrainedTokenizerFast, save; return the vocabulary size."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in ("<|im_end|>", "<|endoftext|>")],
        model_max_length=32768,
        padding_side="left",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "Qwen2Tokenizer"
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return len(fast)


# --------------------------------------------------------------------------- model


def _token_ids(out: Path) -> dict[str, int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


def _text_kwargs(vocab: int, ids: dict[str, int]) -> dict:
    return dict(
        vocab_size=vocab,
        hidden_size=TEXT_HIDDEN,
        intermediate_size=TEXT_INTERMEDIATE,
        num_hidden_layers=TEXT_LAYERS,
        num_attention_heads=TEXT_HEADS,
        num_key_value_heads=TEXT_KV_HEADS,
        max_position_embeddings=4096,
        max_window_layers=TEXT_LAYERS,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=True,
    )


def _build_model(arch: Arch, vocab: int, ids: dict[str, int], rope_theta: float = ROPE_THETA):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Config, Qwen2ForCausalLM

    text = _text_kwargs(vocab, ids)
    if arch == "qwen2":
        cfg = Qwen2Config(**text, rope_parameters={"rope_type": "default", "rope_theta": rope_theta})
        return Qwen2ForCausalLM(cfg)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta, "mrope_section": MROPE_SECTION}
    vision = dict(
        depth=VISION_DEPTH,
        hidden_size=VISION_HIDDEN,
        intermediate_size=2 * VISION_HIDDEN,
        num_heads=VISION_HEADS,
        patch_size=PATCH,
        spatial_merge_size=MERGE,
        temporal_patch_size=TEMPORAL_PATCH,
        window_size=112,
        out_hidden_size=TEXT_HIDDEN,
        fullatt_block_indexes=[VISION_DEPTH - 1],
    )
    cfg = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    return Qwen2_5_VLForConditionalGeneration(cfg)


def _save_image_processor(out: Path, max_image_side: int) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    proc = Qwen2VLImageProcessorPil(
        size={"shortest_edge": PATCH * MERGE * PATCH * MERGE, "longest_edge": max_image_side * max_image_side},
        patch_size=PATCH,
        merge_size=MERGE,
        temporal_patch_size=TEMPORAL_PATCH,
        image_mean=IMAGE_MEAN,
        image_std=IMAGE_STD,
    )
    proc.save_pretrained(str(out))
    path = out / "preprocessor_config.json"
    data = json.loads(path.read_text())
    data["image_processor_type"] = "Qwen2VLImageProcessor"  # loaders pick their own backend
    data["min_pixels"] = PATCH * MERGE * PATCH * MERGE
    data["max_pixels"] = max_image_side * max_image_side
    data["max_image_side"] = max_image_side
    path.write_text(json.dumps(data, indent=2))


COPY_SPAN = 48  # tokens of a random span that copy pre-training repeats
COPY_BATCH = 32
COPY_LR = 3e-3


def _copy_task(model, n: int, low: int, high: int, generator):
    """``n`` random spans of ids in [low, high) repeated twice: the model's logits at the positions
    of the repeat that can be predicted from the first copy, and the tokens they should give."""
    import torch

    a = torch.randint(low, high, (n, COPY_SPAN), generator=generator)
    x = torch.cat([a, a], 1)
    return model(input_ids=x).logits[:, COPY_SPAN:-1], x[:, COPY_SPAN + 1 :]


def copy_accuracy(model, low: int, high: int, generator, n: int = 64) -> float:
    """Greedy next-token accuracy on the second copy of ``n`` random spans repeated twice."""
    import torch

    with torch.no_grad():
        logits, targets = _copy_task(model, n, low, high, generator)
    return float((logits.argmax(-1) == targets).float().mean())


def copy_pretrain(model, steps: int, low: int, high: int, generator) -> float:
    """Train ``model`` for ``steps`` AdamW steps to continue a random span of ordinary token ids
    (``low`` to ``high``) that repeats one seen before it, the in-context copying (induction) that
    any pretrained language model brings; return the copy accuracy on fresh spans afterwards.

    A random-init tiny model lacks it, and SFT on a few hundred demonstrations does not build it:
    see docs/learning-history.md "Why the tiny model could not see" for what it changes."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=COPY_LR)
    model.train()
    for _ in range(steps):
        logits, targets = _copy_task(model, COPY_BATCH, low, high, generator)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    return copy_accuracy(model, low, high, generator)


def _build_into(tmp: Path, arch: Arch, seed: int, corpus: list[str], vocab_size: int, max_image_side: int,
                copy_pretrain_steps: int = 0, rope_theta: float = ROPE_THETA) -> None:
    import torch

    tok = _train_tokenizer(corpus, vocab_size)
    vocab = _save_tokenizer(tok, tmp, arch)
    ids = _token_ids(tmp)
    # pad the embedding table to a multiple of 64 (ids >= len(tokenizer) are never produced by it)
    padded = (vocab + 63) // 64 * 64
    info: dict = {"arch": arch, "seed": seed, "vocab_size": vocab_size, "max_image_side": max_image_side}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _build_model(arch, padded, ids, rope_theta)
        if copy_pretrain_steps:
            gen = torch.Generator().manual_seed(seed)
            acc = copy_pretrain(model, copy_pretrain_steps, len(SPECIAL_TOKENS), vocab, gen)
            info.update(copy_pretrain_steps=copy_pretrain_steps, copy_accuracy=round(acc, 4))
            log.info("tiny model: copy pre-training, %d steps, copy accuracy %.3f", copy_pretrain_steps, acc)
    model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.generation_config.bos_token_id = ids["<|endoftext|>"]
    model.save_pretrained(str(tmp), safe_serialization=True)
    if arch == "qwen2_5_vl":
        _save_image_processor(tmp, max_image_side)
    (tmp / "worldloop_tiny.json").write_text(json.dumps(info))


def make_tiny_model(
    path: str | os.PathLike,
    *,
    arch: Arch = "qwen2_5_vl",
    seed: int = 0,
    corpus: list[str] | None = None,
    vocab_size: int = 2048,
    force: bool = False,
    max_image_side: int = 224,
    copy_pretrain_steps: int = 0,
    rope_theta: float = ROPE_THETA,
) -> Path:
    """Build (or reuse) the tiny model directory at ``path`` and return it.

    ``arch``: "qwen2_5_vl" (vision-language, default) or "qwen2" (text-only causal LM).
    ``corpus``: tokenizer training texts; default :func:`default_corpus`.
    ``vocab_size``: BPE vocabulary size incl. special tokens (the embedding table is padded to a
    multiple of 64). ``max_image_side`` must be a multiple of 28. ``copy_pretrain_steps``: steps of
    :func:`copy_pretrain` after the random init (0: none). Raises ValueError on bad args.
    """
    if arch not in ("qwen2_5_vl", "qwen2"):
        raise ValueError(f"arch must be 'qwen2_5_vl' or 'qwen2', got {arch!r}")
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} (bytes + special tokens), got {vocab_size}")
    if max_image_side < PATCH * MERGE or max_image_side % (PATCH * MERGE):
        raise ValueError(f"max_image_side must be a positive multiple of {PATCH * MERGE}, got {max_image_side}")
    if isinstance(copy_pretrain_steps, bool) or not isinstance(copy_pretrain_steps, int) or copy_pretrain_steps < 0:
        raise ValueError(f"copy_pretrain_steps must be an int >= 0, got {copy_pretrain_steps!r}")
    out = Path(path)
    if (out / "config.json").exists() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.build-", dir=out.parent))
    try:
        _build_into(tmp, arch, seed, corpus if corpus is not None else default_corpus(), vocab_size, max_image_side,
                    copy_pretrain_steps, rope_theta)
        _install(tmp, out, force)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("tiny %s model ready at %s", arch, out)
    return out


def _install(tmp: Path, out: Path, force: bool) -> None:
    """Move the finished build into place; a concurrent builder that won the race is kept."""
    if force and out.exists():
        shutil.rmtree(out)
    try:
        os.rename(tmp, out)
    except OSError:
        if not (out / "config.json").exists():
            raise
