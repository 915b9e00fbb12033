"""The token layout contract shared by actors and the learner (token-in / token-out).

Public API::

    Segment(ids: list[int], images: list[bytes])
    ChatCodec(model_dir, max_image_side=224)
        .encode_obs(user_text, images, *, system, first, prev_response_ended=True) -> Segment
        .encode_response(text, *, eos=True) -> list[int]       # assistant text (+ <|im_end|>) as ids
        .prepare_image(image) -> bytes                          # resize + PNG-encode one image
        .image_pad_count(png: bytes) -> int                     # <|image_pad|> tokens for that image
        .vision_inputs(images: list[bytes]) -> dict             # pixel_values, image_grid_thw
        .decode(ids, skip_special_tokens=True) -> str
        .eos_token_ids, .pad_token_id, .image_token_id, .im_end_id, .is_vision, .tokenizer
        .prompt_only_tokens, .prompt_only_ids                   # special tokens no response may hold
    load_policy(model_dir, dtype="auto", device="cpu") -> torch.nn.Module
    freeze_vision_tower(model) -> int                          # requires_grad False on the vision tower
    build_sequence(traj: dict) -> SequenceLayout
    collate(layouts, codec, pad_to_multiple=8) -> dict[str, Tensor]
    token_logprobs(model, batch, temperature=1.0, chunk_size=512, return_entropy=False, only=None, fused=False,
                   masked_ids=None)
        -> (logprobs [B, L], entropy [B, L] | None)     # from worldloop.common.contracts.logprobs (chunked LM head)
    model_inputs(batch, device, dtype, owner=None) -> dict   # from worldloop.common.contracts.logprobs

Layout of a multi-turn episode
------------------------------
The full model input of an episode is the concatenation over turns ``t`` of ``obs_ids[t]`` and
``response_ids[t]`` (the fields of a ``worldloop.trajectory/1`` turn, see ``common/contracts/schemas.py``):

* ``obs_ids[0]`` = ``<|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n{user_0}<|im_end|>\\n
  <|im_start|>assistant\\n`` (``system=None`` gives Qwen's default system prompt, exactly as the chat
  template does when a conversation has no system message);
* ``obs_ids[t>0]`` = the end of the previous assistant message that was not sampled, then
  ``<|im_start|>user\\n{user_t}<|im_end|>\\n<|im_start|>assistant\\n``. If the previous response
  ended with the ``<|im_end|>`` token (``prev_response_ended=True``) that end is just ``\\n``;
  otherwise (it was truncated at ``max_new_tokens``) it is ``<|im_end|>\\n``;
* ``response_ids[t]`` = exactly the tokens the model sampled, including the final ``<|im_end|>``
  when it stopped on it.

So the concatenation equals the chat-template rendering of the same conversation (assistant
contents tokenized as sampled). In the user text each ``<image>`` placeholder becomes
``<|vision_start|>`` + n x ``<|image_pad|>`` + ``<|vision_end|>`` where n = (H/28)*(W/28) for the
resized image (H, W multiples of 28, both <= ``max_image_side``; patch 14, spatial merge 2). The
images are returned PNG-encoded in placeholder order. Placeholders and images must match in number
(ValueError otherwise). Text-only models (``is_vision`` False) drop the placeholders and ignore
the images. User text is tokenized as plain text: a literal ``<|im_end|>`` inside it is *not* a
special token, so env text cannot forge turn boundaries.

Log-prob convention (shared with the actors' backends)
------------------------------------------------------
The behaviour log-prob of a sampled token is ``log_softmax(logits / temperature)[token]`` of the
full distribution, *without* top-p renormalisation; ``token_logprobs`` computes the same quantity
for every position (position i: log p(token_i | tokens < i); position 0 gets 0).

Prompt-only tokens
------------------
``ChatCodec.prompt_only_ids`` are the special tokens that only the prompt may carry
(:data:`PROMPT_ONLY_TOKENS` that the tokenizer has): ``<|im_start|>``, which the chat template
writes, and the image tokens an ``<image>`` placeholder becomes (``<|vision_start|>``,
``<|image_pad|>``, ``<|vision_end|>``, and Qwen's ``<|vision_pad|>``, ``<|video_pad|>``). A response
holding one cannot be trained (the learner places images by these tokens) or forges a turn, and
an untrained model samples them often: its tied embeddings make the hidden state after a prompt
that is mostly ``<|image_pad|>`` lean towards ``<|image_pad|>`` itself. So every backend forbids
them (their logits are -inf before sampling and in the reported log-probs), and the learner
computes its log-probs and entropies under the same mask (``token_logprobs(masked_ids=...)``):
the behaviour and the training distributions are the same distribution.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from worldloop.common.contracts.logprobs import MODEL_KEYS, model_inputs, token_logprobs  # noqa: F401  (re-exported)

if TYPE_CHECKING:
    from worldloop.common.contracts.schemas import Trajectory

# Qwen2.5-VL's vision token geometry (every model of the family, the tiny one included): 14-px
# patches, 2x2 of them merged into one image token, 2 frames per temporal patch.
PATCH = 14
MERGE = 2
TEMPORAL_PATCH = 2
DEFAULT_SYSTEM = "You are a helpful assistant."  # the chat template's system turn when none is given

IMAGE_PLACEHOLDER = "<image>"
# special tokens only a prompt may carry (module docstring, "Prompt-only tokens"); those the
# tokenizer lacks are left out, except the three image tokens, which every ChatCodec needs
PROMPT_ONLY_TOKENS = ("<|im_start|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
                      "<|video_pad|>")
_FACTOR = PATCH * MERGE  # 28: image sides are multiples of this
MAX_DECODED_PIXELS = 4096 * 4096  # a PNG from the network larger than this is refused


@dataclass
class Segment:
    """Token ids fed to the model before a response, and the PNG images they reference."""

    ids: list[int]
    images: list[bytes] = field(default_factory=list)


# --------------------------------------------------------------------------- images


def _to_pil(image: Any):
    """np.ndarray (HxW, HxWx3/4, uint8 or float in [0,1]), PIL image or encoded bytes -> RGB PIL."""
    from PIL import Image

    if isinstance(image, (bytes, bytearray, memoryview)):
        return decode_png(bytes(image))
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    arr = np.asarray(image)
    if arr.ndim not in (2, 3) or (arr.ndim == 3 and arr.shape[2] not in (1, 3, 4)) or arr.size == 0:
        raise ValueError(f"image must be HxW or HxWxC (C in 1,3,4), got shape {arr.shape}")
    if arr.dtype != np.uint8:
        scale = 255.0 if arr.dtype.kind == "f" and float(np.nanmax(arr)) <= 1.0 else 1.0
        arr = np.clip(np.nan_to_num(arr.astype(np.float64) * scale), 0, 255).astype(np.uint8)
    if arr.ndim == 3 and arr.shape[2] == 1:
        arr = arr[:, :, 0]
    return Image.fromarray(arr).convert("RGB")


def decode_png(data: bytes):
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(data))
        if img.width * img.height > MAX_DECODED_PIXELS:
            raise ValueError(f"image of {img.width}x{img.height} pixels is too large")
        return img.convert("RGB")
    except ValueError:
        raise
    except Exception as e:  # PIL raises many types on corrupt input
        raise ValueError(f"image bytes do not decode: {type(e).__name__}: {e}") from None


def target_size(height: int, width: int, max_side: int) -> tuple[int, int]:
    """(H, W) keeping aspect: multiples of 28, each in [28, floor(max_side / 28) * 28]."""
    cap = max(_FACTOR, max_side // _FACTOR * _FACTOR)
    scale = min(1.0, max_side / max(height, width))

    def side(x: int) -> int:
        return int(min(cap, max(_FACTOR, round(x * scale / _FACTOR) * _FACTOR)))

    return side(height), side(width)


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


# --------------------------------------------------------------------------- codec


class ChatCodec:
    """Tokenizer + image settings of a local model directory; see the module docstring."""

    def __init__(self, model_dir: str | Path, max_image_side: int = 224):
        from transformers import AutoConfig, PreTrainedTokenizerFast

        self.model_dir = Path(model_dir)
        if not (self.model_dir / "tokenizer.json").exists():
            raise FileNotFoundError(f"no tokenizer.json in model directory {self.model_dir}")
        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(str(self.model_dir), local_files_only=True)
        self._text_tok = self.tokenizer.backend_tokenizer.__class__.from_str(self.tokenizer.backend_tokenizer.to_str())
        self._text_tok.encode_special_tokens = True  # user/assistant text never yields special tokens
        config = AutoConfig.from_pretrained(str(self.model_dir), local_files_only=True)
        self.is_vision = getattr(config, "vision_config", None) is not None
        self.max_image_side = int(max_image_side)
        self.im_start_id = self._special_id("<|im_start|>")
        self.im_end_id = self._special_id("<|im_end|>")
        self.endoftext_id = self._special_id("<|endoftext|>")
        self.image_token_id = self._special_id("<|image_pad|>")
        self.vision_start_id = self._special_id("<|vision_start|>")
        self.vision_end_id = self._special_id("<|vision_end|>")
        self.eos_token_ids: list[int] = [self.im_end_id, self.endoftext_id]
        self.pad_token_id: int = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.endoftext_id
        vocab = self.tokenizer.get_vocab()
        self.prompt_only_tokens: tuple[str, ...] = tuple(t for t in PROMPT_ONLY_TOKENS if t in vocab)
        self.prompt_only_ids: tuple[int, ...] = tuple(sorted(self._special_id(t) for t in self.prompt_only_tokens))
        self._processor = None

    def _special_id(self, token: str) -> int:
        tid = self.tokenizer.convert_tokens_to_ids(token)
        if tid is None or tid == self.tokenizer.unk_token_id:
            raise ValueError(f"tokenizer in {self.model_dir} has no special token {token}")
        return int(tid)

    # -- text
    def _text(self, text: str) -> list[int]:
        return list(self._text_tok.encode(text, add_special_tokens=False).ids)

    def _render(self, parts: list[int | str]) -> list[int]:
        """Concatenate special-token ids and text pieces (adjacent texts are tokenized together)."""
        ids: list[int] = []
        buf: list[str] = []
        for p in parts:
            if isinstance(p, str):
                buf.append(p)
                continue
            if buf:
                ids += self._text("".join(buf))
                buf = []
            ids.append(p)
        if buf:
            ids += self._text("".join(buf))
        return ids

    def encode_obs(
        self,
        user_text: str,
        images: Sequence[Any] = (),
        *,
        system: str | None,
        first: bool,
        prev_response_ended: bool = True,
    ) -> Segment:
        """The ``obs_ids`` of one turn (see the module docstring) and its PNG images."""
        if not isinstance(user_text, str):
            raise ValueError(f"user_text must be a str, got {type(user_text).__name__}")
        user_parts, pngs = self._user_parts(user_text, list(images))
        parts: list[int | str] = []
        if first:
            parts += [self.im_start_id, "system\n" + (DEFAULT_SYSTEM if system is None else system), self.im_end_id, "\n"]
        elif not prev_response_ended:
            parts += [self.im_end_id, "\n"]
        else:
            parts += ["\n"]
        parts += [self.im_start_id, "user\n", *user_parts, self.im_end_id, "\n", self.im_start_id, "assistant\n"]
        return Segment(ids=self._render(parts), images=pngs)

    def _user_parts(self, text: str, images: list[Any]) -> tuple[list[int | str], list[bytes]]:
        pieces = text.split(IMAGE_PLACEHOLDER)
        if not self.is_vision:
            return ["".join(pieces)], []
        if len(pieces) - 1 != len(images):
            raise ValueError(f"user text has {len(pieces) - 1} {IMAGE_PLACEHOLDER} placeholder(s) but {len(images)} image(s) were given")
        parts: list[int | str] = [pieces[0]]
        pngs: list[bytes] = []
        for image, after in zip(images, pieces[1:]):
            png = self.prepare_image(image)
            pngs.append(png)
            parts += [self.vision_start_id, *([self.image_token_id] * self.image_pad_count(png)), self.vision_end_id, after]
        return parts, pngs

    def encode_response(self, text: str, *, eos: bool = True) -> list[int]:
        """Assistant text as the ids a model would sample (+ ``<|im_end|>`` when ``eos``)."""
        return self._text(text) + ([self.im_end_id] if eos else [])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # -- images
    def prepare_image(self, image: Any) -> bytes:
        """Resize (aspect kept, sides multiples of 28, <= max_image_side) and PNG-encode."""
        from PIL import Image

        img = _to_pil(image)
        h, w = target_size(img.height, img.width, self.max_image_side)
        if (h, w) != (img.height, img.width):
            img = img.resize((w, h), Image.Resampling.BICUBIC)
        return _png(img)

    def image_pad_count(self, png: bytes) -> int:
        img = decode_png(png)
        h, w = target_size(img.height, img.width, self.max_image_side)
        return (h // _FACTOR) * (w // _FACTOR)

    def _image_processor(self):
        if self._processor is None:
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

            cfg = json.loads((self.model_dir / "preprocessor_config.json").read_text()) if (self.model_dir / "preprocessor_config.json").exists() else {}
            self._processor = Qwen2VLImageProcessorPil(
                size={"shortest_edge": _FACTOR * _FACTOR, "longest_edge": self.max_image_side**2},
                patch_size=PATCH,
                merge_size=MERGE,
                temporal_patch_size=int(cfg.get("temporal_patch_size", 2)),
                image_mean=cfg.get("image_mean"),
                image_std=cfg.get("image_std"),
            )
        return self._processor

    def vision_inputs(self, images: Sequence[bytes]) -> dict[str, torch.Tensor]:
        """``pixel_values`` [sum(t*h*w), C*T*14*14] and ``image_grid_thw`` [N, 3] for the PNGs ({} if none).

        Each image is first brought to the codec's size (a no-op for images from
        :meth:`encode_obs`), so grid_h * grid_w / 4 equals :meth:`image_pad_count`.
        """
        if not images:
            return {}
        from PIL import Image

        pil = []
        for png in images:
            img = decode_png(bytes(png))
            h, w = target_size(img.height, img.width, self.max_image_side)
            pil.append(img if (h, w) == (img.height, img.width) else img.resize((w, h), Image.Resampling.BICUBIC))
        out = self._image_processor()(images=pil, return_tensors="pt")
        return {"pixel_values": out["pixel_values"].float(), "image_grid_thw": out["image_grid_thw"].long()}


# --------------------------------------------------------------------------- model loading


def resolve_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16}
    if dtype not in table:
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    return table[dtype]


def load_policy(model_dir: str | Path, dtype: str | torch.dtype = "auto", device: str = "cpu") -> torch.nn.Module:
    """A Qwen2.5-VL (or any image-text-to-text) or causal LM from a local dir, in eval mode.

    ``dtype="auto"``: float32 on CPU, bfloat16 on CUDA. Never downloads (``local_files_only``).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    path = Path(model_dir)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no config.json in model directory {path}")
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    cls = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    model = cls.from_pretrained(str(path), dtype=resolve_dtype(dtype, device), local_files_only=True)
    return model.to(device).eval()


def freeze_vision_tower(model: torch.nn.Module) -> int:
    """Stop gradients into the vision tower (every parameter under a submodule named ``visual``:
    Qwen2-VL / Qwen2.5-VL, as the policy or as a bare backbone); return how many tensors it froze
    (0 for a text-only model). The vision-language merger is part of the tower and is frozen too.

    Why the tiny presets do it: trained from scratch at the tiny model's learning rates the tower
    collapses within tens of steps (every image token the same vector), while its random-init
    features already tell every tile apart (docs/learning-history.md, "Why the tiny model could
    not see")."""
    frozen = 0
    for name, p in model.named_parameters():
        if ".visual." in f".{name}" and p.requires_grad:
            p.requires_grad_(False)
            frozen += 1
    return frozen


# --------------------------------------------------------------------------- sequences


@dataclass
class SequenceLayout:
    """One trajectory as a flat token sequence (all tensors 1-D, length L, CPU).

    ``response_mask``/``turn_end_mask`` are float 0/1; ``turn_index`` and ``policy_version`` are
    -1 outside responses (``policy_version``: the version that sampled each response token, a turn's
    ``token_versions`` when it has them, else its ``policy_version``; ``turn_policy_version``: each
    turn's ``policy_version``, its oldest token's); ``behaviour_logprobs`` is 0 outside responses. ``turn_spans[t]`` =
    (start, end) positions of turn t's response tokens (end exclusive).
    """

    input_ids: torch.Tensor
    response_mask: torch.Tensor
    turn_end_mask: torch.Tensor
    turn_index: torch.Tensor
    behaviour_logprobs: torch.Tensor
    policy_version: torch.Tensor
    turn_policy_version: list[int]
    turn_spans: list[tuple[int, int]]
    images: list[bytes]

    def __len__(self) -> int:
        return int(self.input_ids.numel())


def build_sequence(traj: Trajectory) -> SequenceLayout:
    """Flatten a trajectory message (:class:`worldloop.common.contracts.schemas.Trajectory`) into a :class:`SequenceLayout`."""
    ids: list[int] = []
    resp: list[float] = []
    tindex: list[int] = []
    lps: list[float] = []
    spans: list[tuple[int, int]] = []
    images: list[bytes] = []
    versions = [int(t.policy_version) for t in traj.turns]
    for t, turn in enumerate(traj.turns):
        obs, out = list(turn.obs_ids), list(turn.response_ids)
        if len(turn.logprobs) != len(out):
            raise ValueError(f"turn {t}: {len(turn.logprobs)} logprobs for {len(out)} response tokens")
        ids += obs
        resp += [0.0] * len(obs)
        tindex += [-1] * len(obs)
        lps += [0.0] * len(obs)
        spans.append((len(ids), len(ids) + len(out)))
        ids += out
        resp += [1.0] * len(out)
        tindex += [t] * len(out)
        lps += [float(x) for x in turn.logprobs]
        images += [bytes(b) for b in turn.images]
    n = len(ids)
    turn_end = torch.zeros(n)
    version = torch.full((n,), -1, dtype=torch.long)
    for t, (s, e) in enumerate(spans):
        if e > s:
            turn_end[e - 1] = 1.0
            per_token = traj.turns[t].token_versions
            if per_token is not None and len(per_token) != e - s:
                raise ValueError(f"turn {t}: {len(per_token)} token_versions for {e - s} response tokens")
            version[s:e] = torch.tensor(per_token, dtype=torch.long) if per_token is not None else versions[t]
    return SequenceLayout(
        input_ids=torch.tensor(ids, dtype=torch.long),
        response_mask=torch.tensor(resp, dtype=torch.float32),
        turn_end_mask=turn_end,
        turn_index=torch.tensor(tindex, dtype=torch.long),
        behaviour_logprobs=torch.tensor(lps, dtype=torch.float32),
        policy_version=version,
        turn_policy_version=versions,
        turn_spans=spans,
        images=images,
    )


# (field, pad value) of the per-position tensors that collate pads
_PADDED_FIELDS: tuple[tuple[str, float], ...] = (
    ("response_mask", 0.0),
    ("turn_end_mask", 0.0),
    ("turn_index", -1),
    ("behaviour_logprobs", 0.0),
    ("policy_version", -1),
)


def _pad_stack(rows: list[torch.Tensor], length: int, value: float) -> torch.Tensor:
    out = torch.full((len(rows), length), value, dtype=rows[0].dtype)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r
    return out


def collate(layouts: Sequence[SequenceLayout], codec: ChatCodec, pad_to_multiple: int = 8) -> dict[str, torch.Tensor]:
    """Right-pad a batch: input_ids, attention_mask, the per-position fields of SequenceLayout,
    and for vision models ``pixel_values``/``image_grid_thw`` (sequence by sequence, image by
    image) plus ``mm_token_type_ids`` (1 on ``<|image_pad|>``) and ``image_keys`` (images with the
    same PNG bytes share a key: :func:`_collate_vision`). Raises ValueError when a
    sequence's image tokens do not match its images' grids.
    """
    if not layouts:
        raise ValueError("collate needs at least one sequence")
    length = max(len(x) for x in layouts)
    length = -(-length // pad_to_multiple) * pad_to_multiple if pad_to_multiple > 1 else length
    batch = {
        "input_ids": _pad_stack([x.input_ids for x in layouts], length, codec.pad_token_id),
        "attention_mask": _pad_stack([torch.ones(len(x), dtype=torch.long) for x in layouts], length, 0),
    }
    for name, value in _PADDED_FIELDS:
        batch[name] = _pad_stack([getattr(x, name) for x in layouts], length, value)
    batch.update(_collate_vision(layouts, codec, batch["input_ids"]))
    return batch


def _collate_vision(layouts: Sequence[SequenceLayout], codec: ChatCodec, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """``mm_token_type_ids`` and, with images, ``pixel_values`` / ``image_grid_thw`` (sequence by
    sequence, image by image) and ``image_keys``: for each image, the index of the batch's first
    image with the same PNG bytes. Each distinct PNG is processed once (a GRPO group's first turns
    share their image, and later turns often do): its rows are copied for every repeat."""
    image_tokens = (input_ids == codec.image_token_id) if codec.is_vision else torch.zeros_like(input_ids, dtype=torch.bool)
    keys: list[int] = []
    distinct: dict[bytes, int] = {}
    for x in layouts:
        for png in x.images if codec.is_vision else ():
            keys.append(distinct.setdefault(bytes(png), len(distinct)))
    vis = codec.vision_inputs(list(distinct)) if distinct else {}
    per_image = _split_images(vis)
    at = 0
    for i, x in enumerate(layouts):
        n = len(x.images) if codec.is_vision else 0
        expected = sum(int(per_image[k][1].prod()) for k in keys[at : at + n]) // (MERGE * MERGE)
        at += n
        found = int(image_tokens[i].sum())
        if found != expected:
            raise ValueError(f"sequence {i}: {found} image tokens but its {len(x.images)} image(s) need {expected}")
    if not codec.is_vision:
        return {}
    out = {"mm_token_type_ids": image_tokens.long()}
    if keys:
        first = {}
        out["pixel_values"] = torch.cat([per_image[k][0] for k in keys])
        out["image_grid_thw"] = torch.stack([per_image[k][1] for k in keys])
        out["image_keys"] = torch.tensor([first.setdefault(k, j) for j, k in enumerate(keys)], dtype=torch.long)
    return out


def _split_images(vis: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:meth:`ChatCodec.vision_inputs`' output as one (pixel rows, grid) pair per image."""
    if not vis:
        return []
    grid = vis["image_grid_thw"]
    rows = torch.split(vis["pixel_values"], grid.prod(-1).tolist())
    return list(zip(rows, grid))
