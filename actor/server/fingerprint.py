"""What must agree between an inference server and the learner's model: tokenizer, architecture, weights.

    model_fingerprint(model_dir) -> {"tokenizer", "architecture", "weights": hex digests, "vocab": n}
    fingerprint_mismatch(local, remote) -> str | None     # the reason they differ, None when they agree

Token-in/token-out makes the token ids the interface: a server whose tokenizer maps ids to other
tokens would sample ids that the actor decodes and the learner trains as something else, and a
server whose model has other parameter names or shapes cannot load the learner's versions. Both
fail silently (garbage text, a rejected weight set far into a run), so an actor refuses such a
server at start, naming the part that differs.

* ``tokenizer``: sha256 of the vocabulary of ``tokenizer.json`` (every token string and its id,
  added and special tokens included), the mapping token-in/token-out relies on;
* ``architecture``: sha256 of the Hugging Face model's ``state_dict()`` names and shapes
  (built on the meta device from ``config.json``: what the weight channel's sets must match);
* ``weights``: xxh3-128 of the weight files (``*.safetensors``, ``*.bin``: names and bytes), so a
  server started from another checkpoint of the same architecture is refused too (before its
  first update its version 0 would not be the learner's version 0). It reads every byte once
  (disk speed: seconds for a 7B model).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

WEIGHT_PATTERNS = ("*.safetensors", "*.bin")


def _tokenizer_digest(model_dir: Path) -> tuple[str, int]:
    from tokenizers import Tokenizer

    path = model_dir / "tokenizer.json"
    if not path.exists():
        raise FileNotFoundError(f"no tokenizer.json in model directory {model_dir}")
    vocab = Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)
    text = json.dumps(sorted(vocab.items(), key=lambda kv: (kv[1], kv[0])), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest(), len(vocab)


def _architecture_digest(model_dir: Path) -> str:
    from worldloop.actor.vllm_backend import reference_params

    shapes, _ = reference_params(model_dir)
    return hashlib.sha256(json.dumps(sorted((k, list(v)) for k, v in shapes.items())).encode()).hexdigest()


def _weights_digest(model_dir: Path) -> str:
    import xxhash

    h = xxhash.xxh3_128()
    files = sorted({p for pattern in WEIGHT_PATTERNS for p in model_dir.glob(pattern)})
    if not files:
        raise FileNotFoundError(f"no weight files ({', '.join(WEIGHT_PATTERNS)}) in model directory {model_dir}")
    for p in files:
        h.update(p.name.encode() + b"\0")
        with open(p, "rb") as f:
            while chunk := f.read(16 << 20):
                h.update(chunk)
    return h.hexdigest()


def model_fingerprint(model_dir: str | Path) -> dict:
    """The fingerprint of a local model directory (see the module docstring)."""
    d = Path(model_dir)
    tokenizer, vocab = _tokenizer_digest(d)
    return {"tokenizer": tokenizer, "vocab": vocab, "architecture": _architecture_digest(d), "weights": _weights_digest(d)}


def fingerprint_mismatch(local: dict, remote: dict) -> str | None:
    """Why a server's fingerprint ``remote`` does not fit the local model's ``local``; None when it does."""
    if remote.get("tokenizer") != local["tokenizer"]:
        return (f"its tokenizer differs from the learner's ({remote.get('vocab')} tokens, vocabulary sha256 "
                f"{str(remote.get('tokenizer'))[:12]} vs {local['vocab']} tokens, {local['tokenizer'][:12]})")
    if remote.get("architecture") != local["architecture"]:
        return ("its model differs from the learner's: other parameter names or shapes (the weight channel's "
                "versions could not be loaded into it)")
    if remote.get("weights") != local["weights"]:
        return (f"its model differs from the learner's: the same architecture with other weights (xxh3 "
                f"{str(remote.get('weights'))[:12]} vs {local['weights'][:12]}): another checkpoint")
    return None
