"""A CPU-sized learner for tests and the CPU bench smoke run, trained on synthetic trajectories.

    tiny_learner_config(model_dir, redis_url, run_dir, namespace="wl", **trainer) -> Config
    train_until_stopped(cfg, trajectories) -> (Learner, int)

``tiny_learner_config`` is a CPU-sized learner config (small batches, metrics server off, ephemeral
weight ports). ``train_until_stopped`` puts trajectories into that config's ``scored`` stream and
runs a learner's loop until it stops by itself (total_steps, time_limit_s), then closes it.
The trajectories come from ``worldloop.testing.trajectories``.
"""

from __future__ import annotations

from worldloop.common.contracts.config import Config, config_from_dict


def tiny_learner_config(model_dir, redis_url: str, run_dir, namespace: str = "wl", max_image_side: int = 112,
                        freeze_vision: bool = False, **trainer) -> Config:
    """A learner config for the tiny model on CPU: 4 trajectories per update, 2 per mini-batch
    (``freeze_vision``: ``model.freeze_vision``; ``trainer``: trainer keys)."""
    base = {"train_batch_size": 4, "ppo_mini_batch_size": 2, "micro_batch_size": 1, "total_steps": 2,
            "checkpoint_every": 2, "actor_lr": 1e-3, "critic_lr": 1e-3, "device": "cpu"}
    base.update(trainer)
    return config_from_dict({
        "run": {"run_dir": str(run_dir)},
        "redis": {"url": redis_url, "namespace": namespace, "block_ms": 200},
        "model": {"path": str(model_dir), "max_image_side": max_image_side, "make_tiny_if_missing": False,
                  "freeze_vision": freeze_vision},
        "metrics": {"enabled": False},
        "weights": {"pub_port": 0, "fetch_port": 0},
        "trainer": base,
    })


def train_until_stopped(cfg: Config, trajectories) -> tuple:
    """Add ``trajectories`` to ``cfg``'s ``scored`` stream, run ``Learner.run_loop`` and close the
    learner; returns ``(learner, run_loop's exit code)`` (the learner closed, its state readable)."""
    from worldloop.common.contracts.keys import Keys
    from worldloop.common.contracts.schemas import encode_trajectory
    from worldloop.common.transport.streams import StreamProducer
    from worldloop.learner.engine import init_distributed
    from worldloop.learner.process import Learner

    prod = StreamProducer(cfg.redis.url, Keys(cfg.redis.namespace).scored, 100)
    for t in trajectories:
        prod.add(encode_trajectory(t))
    learner = Learner(cfg, init_distributed(cfg))
    try:
        rc = learner.run_loop()
    finally:
        learner.close()
    return learner, rc
