"""Every registered worldloop env is a standard gymnasium env: ``check_env`` passes (with no
warning) in both observation modes, ``gymnasium.make`` runs the passive checker, the standard render
modes return what gymnasium expects, and the old names ``vision`` / ``text`` still work."""

from __future__ import annotations

import warnings

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from gymnasium.wrappers.common import PassiveEnvChecker

import worldloop.envs  # noqa: F401  (registers the ids)
from worldloop.envs import ENV_IDS
from worldloop.envs.base import IMAGE_PLACEHOLDER, TEXT_CHARSET, Observation

# small images keep the ray-cast / SVG renders quick; the declared shape must follow image_size
SMALL = {"worldloop/Navigation-v0": {"image_size": 64}, "worldloop/PrimitiveSkill-v0": {"image_size": 64},
         "worldloop/SVG-v0": {"image_size": 64}}


def _kwargs(env_id: str, mode: str) -> dict:
    return dict(SMALL.get(env_id, {}), render_mode=mode)


def _check_env_quietly(env: gymnasium.Env) -> None:
    """check_env, failing on any of gymnasium's checker warnings too (they flag spec violations)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env.unwrapped)
    problems = [str(w.message) for w in caught if "WARN:" in str(w.message)]  # gymnasium.logger.warn's prefix
    assert not problems, problems


def test_every_id_is_registered_with_the_checker_on() -> None:
    assert set(ENV_IDS) == {"worldloop/Sokoban-v0", "worldloop/FrozenLake-v0", "worldloop/Maze-v0", "worldloop/Taxi-v0",
                            "worldloop/Navigation-v0", "worldloop/PrimitiveSkill-v0", "worldloop/SVG-v0"}
    for env_id in ENV_IDS:
        assert gymnasium.spec(env_id).disable_env_checker is False, env_id


@pytest.mark.parametrize("mode", ["rgb_array", "ansi"])
@pytest.mark.parametrize("env_id", sorted(ENV_IDS))
def test_check_env_passes(env_id: str, mode: str) -> None:
    env = gymnasium.make(env_id, **_kwargs(env_id, mode))
    try:
        _check_env_quietly(env)
    finally:
        env.close()


@pytest.mark.parametrize("env_id", sorted(ENV_IDS))
def test_spaces_declare_what_reset_and_step_return(env_id: str) -> None:
    vis = gymnasium.make(env_id, **_kwargs(env_id, "vision"))  # old name: same as rgb_array
    assert any(isinstance(w, PassiveEnvChecker) for w in _wrappers(vis))
    assert vis.unwrapped.render_mode == "rgb_array" and vis.unwrapped.vision
    space = vis.observation_space
    assert set(space.spaces) == {"text", "image"}
    obs, _ = vis.reset(seed=7)
    assert set(obs) == {"text", "image"} and obs in space
    assert " " in obs["text"] and "\n" in obs["text"] and IMAGE_PLACEHOLDER in obs["text"]
    assert obs["image"].shape == space["image"].shape and obs["image"].dtype == np.uint8
    frame = vis.render()
    assert isinstance(frame, np.ndarray) and frame.shape == space["image"].shape and np.array_equal(frame, obs["image"])
    obs2, *_ = vis.step(vis.unwrapped.expert_response())
    assert obs2 in space and obs2["image"] is not obs["image"]
    vis.close()

    txt = gymnasium.make(env_id, **_kwargs(env_id, "text"))
    assert txt.unwrapped.render_mode == "ansi" and not txt.unwrapped.vision
    assert set(txt.observation_space.spaces) == {"text"}
    obs, _ = txt.reset(seed=7)
    assert isinstance(obs, Observation) and set(obs) == {"text"} and obs in txt.observation_space
    assert obs["image"] is None and obs.get("image") is None  # callers written for {"text", "image": None}
    with pytest.raises(KeyError, match="imagee"):
        obs["imagee"]
    rendered = txt.render()
    assert isinstance(rendered, str) and rendered and rendered in obs["text"]
    txt.close()


def test_text_space_takes_what_the_envs_write_and_rejects_the_rest() -> None:
    env = gymnasium.make("worldloop/Sokoban-v0", render_mode="ansi")
    space = env.observation_space["text"]
    assert space.contains("Decide your next action(s).\n\tA: #_P_O ->")
    assert not space.contains("")  # an observation always has text
    assert not space.contains("\u4e2d")  # outside the declared charset
    assert "\u2192" in TEXT_CHARSET and " " in TEXT_CHARSET
    # the action space accepts a sampled response; step takes it (as a format error) without raising
    env.action_space.seed(0)
    action = env.action_space.sample()
    env.reset(seed=0)
    _, reward, term, trunc, info = env.step(action)
    assert reward == 0.0 and not info["format_ok"] and not term and not trunc


def test_unknown_render_mode_names_the_kwarg() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="render_mode must be one of"):
            gymnasium.make("worldloop/Maze-v0", render_mode="bogus")


def _wrappers(env: gymnasium.Env) -> list[gymnasium.Env]:
    out = []
    while isinstance(env, gymnasium.Wrapper):
        out.append(env)
        env = env.env
    return out


@pytest.mark.parametrize("mode", ["rgb_array", "ansi"])
@pytest.mark.parametrize("env_id", sorted(ENV_IDS))
def test_expert_episodes_stay_in_the_observation_space(env_id: str, mode: str) -> None:
    """Whole expert episodes (every text the env writes: feedback, instructions, valid actions)."""
    env = gymnasium.make(env_id, **_kwargs(env_id, mode), max_steps=12)
    space = env.observation_space
    for seed in range(3):
        obs, _ = env.reset(seed=seed)
        assert obs in space, (seed, set(obs["text"]) - set(TEXT_CHARSET))
        for _ in range(6):
            obs, _, term, trunc, _ = env.step(env.unwrapped.expert_response())
            assert obs in space, (seed, set(obs["text"]) - set(TEXT_CHARSET))
            if term or trunc:
                break
    env.close()
