"""The env contract for the four grid envs: registration, obs/info shapes, seeds, prompts, expert."""

from __future__ import annotations

import json

import gymnasium
import msgpack
import numpy as np
import pytest

from worldloop import envs
from worldloop.envs.base import IMAGE_PLACEHOLDER
from worldloop.envs.parsing import PROMPT_FORMATS, parse_response
from worldloop.envs.presets import PRESETS, resolve

GRID_IDS = ["worldloop/Sokoban-v0", "worldloop/FrozenLake-v0", "worldloop/Maze-v0", "worldloop/Taxi-v0"]
STEP_KEYS = {"state", "success", "task", "metrics", "format_ok", "actions", "actions_executed", "actions_effective",
             "env_reward", "format_reward", "observation", "reasoning", "prediction"}


def test_all_seven_ids_are_registered_lazily() -> None:
    for env_id, entry in envs.ENV_IDS.items():
        spec = gymnasium.spec(env_id)
        assert spec.entry_point == entry and not spec.disable_env_checker  # gymnasium's checker is on
    assert set(envs.ENV_IDS) == {
        "worldloop/Sokoban-v0", "worldloop/FrozenLake-v0", "worldloop/Maze-v0", "worldloop/Taxi-v0",
        "worldloop/Navigation-v0", "worldloop/PrimitiveSkill-v0", "worldloop/SVG-v0"}
    assert envs.ENV_IDS["worldloop/SVG-v0"] == "worldloop.envs.svg.env:SVGEnv"


@pytest.mark.parametrize("env_id", GRID_IDS)
def test_vision_and_text_observations(env_id: str) -> None:
    env = gymnasium.make(env_id, image_size=100)
    obs, info = env.reset(seed=1)
    assert obs["text"].count(IMAGE_PLACEHOLDER) == 1 and obs["text"].startswith("[Initial Observation]:")
    assert obs["image"].dtype == np.uint8 and obs["image"].shape == (100, 100, 3)
    assert obs["image"].std() > 10  # a drawn scene, not a blank canvas
    assert set(info) >= {"state", "success", "task", "metrics"}
    obs, *_ = env.step(env.unwrapped.expert_response())
    assert obs["text"].count(IMAGE_PLACEHOLDER) == 1 and "the extracted valid action is" in obs["text"]
    text_env = gymnasium.make(env_id, render_mode="text")
    obs, info = text_env.reset(seed=1)
    assert obs["image"] is None and IMAGE_PLACEHOLDER not in obs["text"]
    assert info["state"]["symbolic"] in obs["text"]


@pytest.mark.parametrize("env_id", GRID_IDS)
def test_a_state_text_observation_is_the_true_state_in_the_state_format(env_id: str) -> None:
    for fmt in ("natural_language", "structured"):
        env = gymnasium.make(env_id, render_mode="text", text_observation="state", state_format=fmt)
        obs, info = env.reset(seed=2)
        truth = env.unwrapped.describe_state(info["state"])
        assert truth and truth in obs["text"] and info["state"]["symbolic"] not in obs["text"]
        if fmt == "natural_language":  # the sentences of the relations, the first one verbatim
            assert info["state"]["relations"][0] in obs["text"]
        else:
            assert json.loads(truth) == info["state"]["structured"]
        obs, _, _, _, info = env.step(env.unwrapped.expert_response())
        assert env.unwrapped.describe_state(info["state"]) in obs["text"] and env.render() in obs["text"]
    with pytest.raises(ValueError, match="text_observation"):  # nothing to show it on in vision mode
        gymnasium.make(env_id, text_observation="state")
    with pytest.raises(ValueError, match="text_observation"):
        gymnasium.make(env_id, render_mode="text", text_observation="grid")


@pytest.mark.parametrize("env_id", GRID_IDS)
def test_same_seed_same_episode_regardless_of_history(env_id: str) -> None:
    env = gymnasium.make(env_id)
    obs_a, info_a = env.reset(seed=11)
    env.step(env.unwrapped.expert_response())
    for s in (3, 4):
        env.reset(seed=s)
    env.reset()
    obs_b, info_b = env.reset(seed=11)
    assert info_a["state"] == info_b["state"] and np.array_equal(obs_a["image"], obs_b["image"])
    other = gymnasium.make(env_id)
    assert other.reset(seed=11)[1]["state"] == info_a["state"]
    states = {json.dumps(other.reset(seed=s)[1]["state"]) for s in range(8)}
    assert len(states) > 1


@pytest.mark.parametrize("env_id", GRID_IDS)
@pytest.mark.parametrize("fmt", ["natural_language", "symbolic", "structured"])
def test_expert_fields_match_the_true_states(env_id: str, fmt: str) -> None:
    env = gymnasium.make(env_id, state_format=fmt, render_mode="text")
    _, info = env.reset(seed=2)
    before = info["state"]
    text = env.unwrapped.expert_response()
    parsed = parse_response(text, "grounding_worldmodeling")
    assert parsed.format_ok
    _, reward, _, _, info = env.step(text)
    describe = env.unwrapped.describe_state
    assert parsed.observation == describe(before) and parsed.prediction == describe(info["state"])
    assert info["observation"] == parsed.observation and info["prediction"] == parsed.prediction
    if fmt == "structured":
        assert json.loads(parsed.prediction) == info["state"]["structured"]
    if fmt == "natural_language":
        assert all(r in parsed.observation for r in before["relations"])
    assert info["format_ok"] and reward == pytest.approx(info["env_reward"] + info["format_reward"])
    assert STEP_KEYS <= set(info)
    # plain msgpack-able python: a round trip gives the same objects back
    assert msgpack.unpackb(msgpack.packb(info["state"]), raw=False) == info["state"]
    for k in ("actions", "actions_executed", "actions_effective", "env_reward", "format_reward", "metrics", "success"):
        msgpack.packb(info[k])


@pytest.mark.parametrize("env_id", GRID_IDS)
@pytest.mark.parametrize("fmt", PROMPT_FORMATS)
def test_prompts_and_expert_for_every_strategy(env_id: str, fmt: str) -> None:
    env = gymnasium.make(env_id, prompt_format=fmt)
    obs, _ = env.reset(seed=0)
    system = env.unwrapped.system_prompt()
    assert system.startswith("You are a") and "Actions you can take:" in system
    assert "Your response should be in the format of:" in system and "Your response should be" in obs["text"]
    example = system.rsplit("e.g. ", 1)[1]
    assert parse_response(example, fmt).format_ok  # the example obeys its own format
    assert "e.g. " not in obs["text"]
    _, _, _, _, info = env.step(env.unwrapped.expert_response())
    assert info["format_ok"] and info["format_reward"] == 0.5 and info["actions_executed"] >= 1


@pytest.mark.parametrize("env_id", GRID_IDS)
def test_expert_replay_reaches_success_with_the_plus_ten(env_id: str) -> None:
    env = gymnasium.make(env_id, render_mode="text")
    for seed in range(3):
        env.reset(seed=seed)
        optimal, executed = env.unwrapped.optimal_actions, 0
        while True:
            _, _, term, trunc, info = env.step(env.unwrapped.expert_response())
            executed += info["actions_executed"]
            if term or trunc:
                break
        assert term and info["success"] and executed == optimal
        # last turn: at most max_actions_per_step - 1 penalties of -0.1 next to the +10
        assert info["env_reward"] >= 10 - 0.1 * (env.unwrapped.max_actions_per_step - 1) - 1e-9


@pytest.mark.parametrize("env_id", GRID_IDS)
def test_garbage_never_raises_and_changes_nothing(env_id: str) -> None:
    env = gymnasium.make(env_id)
    _, info0 = env.reset(seed=5)
    rng = np.random.default_rng(0)
    junk = [bytes(rng.integers(0, 256, 1 << 20, dtype=np.uint8)).decode("latin-1"), "", "<answer>", None,
            "<think></think><answer>Up</answer>" * 3, "\x00" * 1000]
    for text in junk:
        _, reward, term, trunc, info = env.step(text)
        assert reward == 0.0 and not info["format_ok"] and not term and not trunc
        assert info["state"] == info0["state"] and info["steps"] == 0


@pytest.mark.filterwarnings("ignore:.*render_mode")
@pytest.mark.parametrize("env_id", GRID_IDS)
def test_bad_common_kwargs_name_the_kwarg(env_id: str) -> None:
    # ("human" would be served by gymnasium's HumanRendering wrapper over rgb_array)
    for kw, name in (({"render_mode": "bogus"}, "render_mode"), ({"prompt_format": "cot"}, "prompt_format"),
                     ({"state_format": "json"}, "state_format"), ({"max_actions_per_step": 0}, "max_actions_per_step"),
                     ({"image_size": 8}, "image_size")):
        with pytest.raises(ValueError, match=name):
            gymnasium.make(env_id, **kw)
    with pytest.raises(TypeError, match="colour"):
        gymnasium.make(env_id, colour="red")


def test_presets_build_and_reset() -> None:
    for name in PRESETS:
        env_id, kwargs = resolve(name)
        if not env_id.startswith(tuple(GRID_IDS)):
            continue
        env = gymnasium.make(env_id, render_mode="text", **kwargs)
        _, info = env.reset(seed=0)
        assert info["success"] is False and env.unwrapped.optimal_actions >= kwargs.get("min_actions_to_succeed", 1)
    assert resolve("sokoban-hard-7x7-3box")[1]["num_boxes"] == 3
    assert resolve("maze-hard-15x15")[1]["size"] == 15
    assert resolve("worldloop/Taxi-v0") == ("worldloop/Taxi-v0", {})
    with pytest.raises(ValueError, match="unknown env preset"):
        resolve("pong")
