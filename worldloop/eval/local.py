"""``worldloop eval`` of a local model: the actors' rollout engine (``actor/rollout.py``) plays the
episodes with the ``hf`` or ``vllm`` backend, ``concurrency`` episodes per batched generation.

Public API::

    play_local(episodes, model, settings, cfg, backend_name, concurrency, on_done)
        # on_done(episode, fields) as each episode ends; fields as worldloop.eval.remote.play_episode's
    TranscriptEnv(env)     # gymnasium wrapper keeping the texts and infos the trajectory lacks

The engine's trajectories carry the token ids, the response texts and the parsed fields; the eval
record also needs what the env said (the user message of every turn, ``info["task"]``,
``info["metrics"]``, the parser's reason), so every env is wrapped in :class:`TranscriptEnv`, which
records that as it passes through. The engine is driven directly (``start``/``step``) rather than
through ``play_episodes`` so that each episode is written to ``episodes.jsonl`` the moment it ends.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any, Callable

import gymnasium

from worldloop.eval.remote import turn_record

if TYPE_CHECKING:
    from worldloop.eval.model import ModelRef
    from worldloop.eval.plan import Episode
    from worldloop.common.contracts.config import Config
    from worldloop.common.contracts.schemas import Trajectory

log = logging.getLogger(__name__)


class TranscriptEnv(gymnasium.Wrapper):
    """Keeps the observation texts, image counts and infos of one episode."""

    def __init__(self, env: gymnasium.Env, on_reset: Callable[["TranscriptEnv", Any], None] | None = None):
        super().__init__(env)
        self.on_reset = on_reset  # called with (self, seed) at every reset
        self.system_prompt = ""
        self.reset_info: dict = {}
        self.prompts: list[tuple[str, int]] = []  # (text, images) of each observation, from reset on
        self.steps: list[tuple[float, bool, dict]] = []  # (reward, done, info) of each step

    def _keep(self, obs: Any) -> None:
        self.prompts.append((str(obs.get("text", "")), int(obs.get("image") is not None)))

    def reset(self, **kwargs):
        if self.on_reset is not None:
            self.on_reset(self, kwargs.get("seed"))
        obs, info = self.env.reset(**kwargs)
        self.reset_info, self.prompts, self.steps = dict(info), [], []
        self.system_prompt = str(self.env.unwrapped.system_prompt())
        self._keep(obs)
        return obs, info

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.steps.append((float(reward), bool(terminated or truncated), dict(info)))
        self._keep(obs)
        return obs, reward, terminated, truncated, info


def _fields(traj: Trajectory, rec: TranscriptEnv | None) -> dict:
    """The record fields of a finished trajectory (see ``worldloop.eval.remote.play_episode``)."""
    if traj.end_reason == "env_error" or rec is None:
        return {"error": "env_error: the env raised (see the log)", "turns": []}
    turns = []
    for t, (reward, done, info) in zip(traj.turns, rec.steps):
        prompt, n_img = rec.prompts[t.index]
        turns.append(turn_record(t.index, prompt, n_img, t.response_text, info, reward, done, t.truncated_response))
    last = rec.steps[-1][2] if rec.steps else rec.reset_info
    return {"task": rec.reset_info.get("task"), "success": bool(traj.success),
            "metrics": dict(last.get("metrics") or {}), "turns": turns, "end_reason": traj.end_reason,
            "system_prompt": rec.system_prompt, "error": None}


def _env_key(env_id: str, kwargs: dict, seed: int) -> str:
    return json.dumps([env_id, kwargs, int(seed)], sort_keys=True, default=str)


def play_local(episodes: list["Episode"], model: "ModelRef", settings: dict, cfg: "Config", backend_name: str,
               concurrency: int, on_done: Callable[["Episode", dict], None]) -> None:
    from worldloop import envs  # noqa: F401  (registers the ids)
    from worldloop.actor.backends import make_backend
    from worldloop.actor.rollout import EpisodeSpec, RolloutEngine, Sampling

    cfg.actor.backend = backend_name  # type: ignore[assignment]
    backend = make_backend(cfg, str(model.path))
    codec = backend.codec
    if not codec.is_vision and settings.get("render_mode") == "vision":
        log.warning("%s is a text-only model: the images are dropped; --render-mode text shows it the state as text",
                    model.path)
    made: dict[str, TranscriptEnv] = {}  # (env id, kwargs, seed) -> the wrapper of that episode

    def make_env(env_id: str, **kwargs) -> gymnasium.Env:
        def keep(env: TranscriptEnv, seed: Any) -> None:  # the engine resets each env once, with its seed
            made[_env_key(env_id, kwargs, seed)] = env

        return TranscriptEnv(gymnasium.make(env_id, **kwargs), on_reset=keep)

    sampling = Sampling(temperature=settings["temperature"], top_p=settings["top_p"], max_new_tokens=settings["max_tokens"])
    engine = RolloutEngine(backend, sampling=sampling, max_model_len=cfg.model.max_model_len, actor_id="eval",
                           codec=codec, sample_seed=cfg.run.seed, make_env=make_env,
                           keyed_sampling=settings.get("sampling") == "keyed")
    by_id: dict[str, "Episode"] = {}
    queue = list(episodes)
    try:
        while queue or engine.live or engine.pending_reports:
            while queue and engine.live < concurrency:
                ep = queue.pop(0)
                spec = EpisodeSpec(ep.plan.env_id, ep.seed, dict(ep.plan.kwargs), env_name=ep.plan.name,
                                   max_turns=ep.plan.max_turns)
                by_id[engine.start(spec)] = ep
            for traj in engine.step().finished:
                ep = by_id.pop(traj.trajectory_id)
                rec = made.pop(_env_key(ep.plan.env_id, ep.plan.kwargs, ep.seed), None)
                on_done(ep, _fields(traj, rec))
    finally:
        engine.close()
        backend.close()
