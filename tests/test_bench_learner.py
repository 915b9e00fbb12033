"""bench/learner.py's ``--preset``: one update shaped as a preset's learner runs it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from worldloop.common.contracts.config import load_config
from worldloop.common.contracts.config_fields import ConfigError

BENCH = Path(__file__).resolve().parent.parent / "bench" / "learner.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_learner_preset", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("preset", ["tiny-frozenlake", "tiny-sokoban"])
def test_preset_gives_the_update_the_presets_trainer_and_group_size(preset: str) -> None:
    trainer, group = _bench().preset_trainer(preset)
    cfg = load_config(preset)
    assert group == cfg.actor.n_samples_per_seed
    assert "total_steps" not in trainer  # the bench sets its own number of updates
    for key in ("train_batch_size", "ppo_mini_batch_size", "micro_batch_size", "micro_batch_tokens", "ppo_epochs",
                "estimator", "use_critic", "kl_coef", "loss_agg_mode"):
        assert trainer[key] == getattr(cfg.trainer, key), key


def test_an_unknown_preset_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="no-such-preset.*is not a preset"):
        _bench().preset_trainer("no-such-preset")
