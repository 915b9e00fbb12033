"""Env families own their truth (envs/family.py): a toy family added here, in this file alone (its own
gymnasium env, its truth, one ``register_family`` line), is scored by the judge through the registry;
the registry's rules; the built-in families' declarations agree with the envs and the config."""
from __future__ import annotations

import ast
import asyncio
import re
from pathlib import Path

import gymnasium
import numpy as np
import pytest
from gymnasium import spaces

from worldloop.common.contracts.config import RELATION_PROMPT_ENVS, JudgeConfig, load_config
from worldloop.common.contracts.schemas import State
from worldloop.envs import register_all
from worldloop.envs.family import (PROMPT_FORMAT, EnvFamily, FamilyTruth, all_env_ids, families, family_of,
                                   register_family, unregister_family)
from worldloop.judge.prompts import verdict_messages
from worldloop.judge.rule import build_truth
from worldloop.judge.scoring import TrajectoryScorer, rule_text_score
from worldloop.testing.trajectories import make_trajectory

ROOT = Path(__file__).resolve().parent.parent
LAMP_ID = "worldloop-test/Lamp-v0"


# ----------------------------------------------------------------------------- the toy family


class LampEnv(gymnasium.Env):
    """A corridor of 5 cells with the player and a lamp; actions 0 (left) and 1 (right) move the player."""

    observation_space = spaces.Discrete(5)
    action_space = spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.player, self.lamp = (int(x) for x in self.np_random.choice(5, size=2, replace=False))
        return self.player, {"state": self.state()}

    def step(self, action: int):
        self.player = int(np.clip(self.player + (1 if action == 1 else -1), 0, 4))
        done = self.player == self.lamp
        return self.player, float(done), done, False, {"state": self.state()}

    def state(self) -> dict:
        side = "left" if self.lamp < self.player else "right" if self.lamp > self.player else "here"
        return {"relations": [], "symbolic": None,
                "structured": {"lamp": [self.lamp, 0], "player": [self.player, 0], "lamp_side": side}}


LAMP_PROMPT = ("Is the lamp where the description says? {state_information_dict} {natural_language_description} "
               + PROMPT_FORMAT)


class LampFamily(EnvFamily):
    name = "lamp"
    env_ids = {LAMP_ID: f"{__name__}:LampEnv"}
    coord_tolerance = 1.0
    prompts = {"lamp": {"grounding": LAMP_PROMPT, "worldmodeling": LAMP_PROMPT}}

    def truth(self, relations, symbolic, structured):
        side = structured.get("lamp_side")
        if side not in ("left", "right"):
            return None
        return FamilyTruth("lamp", "directions", known=[("lamp", side, "player")], essential=[("lamp", side, "player")],
                           entities=["player", "lamp"], aliases={"light": "lamp"}, implicit="player", info=structured)


@pytest.fixture
def lamp_family():
    family = register_family(LampFamily())  # the one registration line
    register_all()
    yield family
    unregister_family("lamp")
    gymnasium.registry.pop(LAMP_ID, None)


def _play(seed: int) -> tuple[dict, dict, int]:
    """The state before and after one step toward the lamp, and the lamp's cell."""
    env = gymnasium.make(LAMP_ID)
    _, info = env.reset(seed=seed)
    before = info["state"]
    toward = 0 if before["structured"]["lamp_side"] == "left" else 1
    _, _, _, _, info = env.step(toward)
    env.close()
    return before, info["state"], before["structured"]["lamp"][0]


def _opposite(side: str) -> str:
    return {"left": "right", "right": "left"}[side]


def test_a_toy_family_is_scored_by_the_judge_through_the_registry(lamp_family) -> None:
    assert family_of(LAMP_ID) is lamp_family and family_of("lamp") is lamp_family
    assert all_env_ids()[LAMP_ID] == f"{__name__}:LampEnv" and LAMP_ID in gymnasium.registry
    # a level where one step does not reach the lamp: the state after still holds its side
    seed = next(s for s in range(100) if _play(s)[1]["structured"]["lamp_side"] != "here")
    before, after, _ = _play(seed)
    side = before["structured"]["lamp_side"]
    assert side in ("left", "right") and after["structured"]["lamp_side"] == side

    traj = make_trajectory("lamp-1", turns=1)
    traj.env_name, traj.env_id, traj.prompt_format = "lamp", LAMP_ID, "grounding_worldmodeling"
    turn = traj.turns[0]
    # truth: one fact ("lamp", "player", "h", side); the observation states it (alias "light"): P = R = 1;
    # the prediction states the opposite side: P = 0 -> F1 = 0
    turn.observation = f"The light is to the {side} of me."
    turn.prediction = f"The lamp will be to the {_opposite(side)} of the player."
    turn.state_before, turn.state_after = State(**before), State(**after)
    asyncio.run(TrajectoryScorer(JudgeConfig()).score(traj))
    assert turn.grounding_score == 1.0
    assert turn.judge["grounding"]["method"] == "lamp"
    assert turn.worldmodeling_score == 0.0
    assert turn.judge["worldmodeling"]["scorers"]["rule"]["predicted"] == 1


def test_the_toy_family_s_tolerance_and_prompt_reach_the_judge(lamp_family) -> None:
    before, _, lamp = _play(3)
    player = before["structured"]["player"][0]
    # a text with coordinates is compared on them (the family's truth does not come first); the lamp
    # is off by one: within the family's coord_tolerance 1.0 both facts match (F1 = 1), without a
    # family (tolerance 0) one of two matches: P = R = 1/2 -> F1 = 0.5
    text = f"lamp at ({lamp + 1}, 0), player at ({player}, 0)"
    assert rule_text_score(text, before, "lamp").score == 1.0
    assert rule_text_score(text, before, "unknown-env").score == 0.5
    truth = build_truth("the lamp is near", before, "lamp")
    messages = verdict_messages("lamp", "grounding", truth.method, truth.info, "the lamp is left")
    assert messages[1]["content"].startswith("Is the lamp where the description says? {'lamp': [")
    assert "<agent_text>\nthe lamp is left\n</agent_text>" in messages[1]["content"]
    # an env no family claims gets the judge's default grid prompt
    other = verdict_messages("unknown-env", "grounding", truth.method, truth.info, "x")[1]["content"]
    assert other.startswith("Evaluate whether the description accurately captures the key position relationships in the unknown-env")


def test_the_registry_refuses_a_second_family_of_a_name_or_an_env(lamp_family) -> None:
    with pytest.raises(ValueError, match="env family 'lamp' is already registered"):
        register_family(LampFamily())

    class Thief(LampFamily):
        name = "thief"

    with pytest.raises(ValueError, match=r"env family 'thief' claims \['lamp'\], which family 'lamp' has"):
        register_family(Thief())

    class Nameless(EnvFamily):
        pass

    with pytest.raises(ValueError, match="an env family needs a name and env_ids"):
        register_family(Nameless())
    assert family_of("thief") is None and [f.name for f in families()][-1] == "lamp"


def test_the_built_in_families_claim_every_env_once() -> None:
    names = {f.name: sorted(f.env_names()) for f in families()}
    assert names == {"grid": ["frozenlake", "maze", "sokoban", "taxi"], "navigation": ["navigation"],
                     "primitive_skill": ["primitiveskill"], "svg": ["svg"]}
    assert family_of("worldloop/PrimitiveSkill-v0").coord_tolerance == 10.0
    assert family_of("maze").judge_prompt("maze", "grounding") is None  # the judge's default grid prompt
    assert family_of("Sokoban").judge_prompt("worldloop/Sokoban-v0", "grounding").startswith(
        "Evaluate whether the description accurately captures the key position relationships in the Sokoban game state.")


def test_the_rule_mode_envs_agree_between_the_config_the_grid_family_and_the_envs() -> None:
    """The config contract keeps its own copy of which envs follow judge.rule_mode (contracts cannot
    import envs); it must equal the grid family's declaration, and that what the env classes offer."""
    import worldloop.envs.grid as grid

    declared = family_of("sokoban").relation_prompts
    assert {k: tuple(v) for k, v in RELATION_PROMPT_ENVS.items()} == declared
    offered = {"vagen": [], "local": []}
    for env_id in family_of("sokoban").env_ids:
        cls = getattr(grid, all_env_ids()[env_id].split(":")[1])
        for mode, hint in (("vagen", cls.VAGEN_NL_HINT), ("local", cls.LOCAL_NL_HINT)):
            if hint:
                offered[mode].append(env_id)
    assert {k: tuple(v) for k, v in offered.items()} == declared
    cfg = load_config(None, ["judge.rule_mode=local", "actor.envs=[{id: worldloop/FrozenLake-v0}, {id: worldloop/Sokoban-v0}]"])
    assert [e.kwargs.get("relation_prompt") for e in cfg.actor.envs] == ["local", None]


def test_the_judge_names_no_env_and_imports_only_the_registry_from_envs() -> None:
    """The judge asks the registry: no env name appears in its code (docstrings aside), and the only
    module of envs it imports is worldloop.envs.family."""
    # ("taxi" stays: the fact language reads "the taxi" as the player, a word like "me")
    envs = re.compile(r"\b(sokoban|frozenlake|maze|navigation|primitiveskill|primitive_skill|svg)\b", re.IGNORECASE)
    for f in sorted((ROOT / "judge").rglob("*.py")):
        tree = ast.parse(f.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body
                and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
                assert not envs.search(n.value), (f.name, n.value[:80])
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("worldloop.envs"):
                assert n.module == "worldloop.envs.family", (f.name, n.module)
