"""Host syncs in the learner's hot loop (issue 40 item 4): at most 2 per micro-batch.

On a GPU every read of a device tensor's value on the host (``.item()``, ``.tolist()``,
``float(t)``, ``int(t)``, ``bool(t)``, ``.cpu()``, a ``nonzero``) waits for the device. This CPU
test counts those calls made by worldloop's own code (the calling frame is a file of this
repository, not torch, transformers or DeepSpeed) while ``PPOTrainer._train_micro`` runs, over
one real update (policy + critic + reference, KL in the loss, entropy bonus on), and divides by
the micro-batches trained. The host-side planning before each micro-batch (slicing, the
micro-batch's loss-token count from its CPU mask, the log-prob positions found on the host)
is outside ``_train_micro`` by design: on a GPU those tensors are still on the host.

Before issue 40 the same loop made 9 such calls per micro-batch (a device ``nonzero`` of the
log-prob mask, the policy stats' ``tolist``, four ``bool(m.any())`` of the ratio / weight
extremes, ``float`` of the entropy and of the KL loss, the value stats' ``tolist``).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from test_microbatch import run_update  # noqa: E402

_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "nonzero", "cpu")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from worldloop.bootstrap.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "vl", max_image_side=112)


@pytest.fixture
def counter(monkeypatch):
    """Counts host reads of tensors by this repository's code (not tests) inside ``_train_micro``."""
    from worldloop.learner.trainer import PPOTrainer

    state = {"inside": False, "micro": 0}
    seen: Counter = Counter()
    tests = str(ROOT / "tests")

    def wrap(name, original):
        def counted(self, *args, **kwargs):
            if state["inside"]:
                f = sys._getframe(1).f_code.co_filename
                if f.startswith(str(ROOT)) and not f.startswith(tests) and ".venv" not in f:
                    seen[f"{name} at {Path(f).name}:{sys._getframe(1).f_lineno}"] += 1
            return original(self, *args, **kwargs)
        return counted

    for name in _READS:
        monkeypatch.setattr(torch.Tensor, name, wrap(name, getattr(torch.Tensor, name)))
    original_nonzero = torch.nonzero

    def nonzero(*args, **kwargs):
        if state["inside"]:
            seen[f"torch.nonzero at {Path(sys._getframe(1).f_code.co_filename).name}"] += 1
        return original_nonzero(*args, **kwargs)

    monkeypatch.setattr(torch, "nonzero", nonzero)
    train_micro = PPOTrainer._train_micro

    def traced(self, *args, **kwargs):
        state["inside"], state["micro"] = True, state["micro"] + 1
        try:
            return train_micro(self, *args, **kwargs)
        finally:
            state["inside"] = False

    monkeypatch.setattr(PPOTrainer, "_train_micro", traced)
    return state, seen


@pytest.mark.parametrize("packing,stage", [(True, 0), (True, 2), (False, 2)])
def test_at_most_two_host_syncs_per_micro_batch(model_dir, counter, packing, stage):
    state, seen = counter
    stats, _, _ = run_update(model_dir, micro_batch_tokens=400, zero_stage=stage, packing=packing, entropy_coef=0.01,
                             kl_in_reward=False, kl_estimator="low_var_kl")
    assert state["micro"] == stats["micro_batches"] >= 3
    total = sum(seen.values())
    assert total >= state["micro"], dict(seen)  # the instrument sees the stats read (else it counts nothing)
    assert total / state["micro"] <= 2, dict(seen)
    assert stats["policy_kl_loss"] > 0 and stats["policy_entropy"] > 0  # the terms that used to sync each ran
