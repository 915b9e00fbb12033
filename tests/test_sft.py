"""SFT warm start: expert demonstrations from a real gymnasium env, loss and answer format improve."""

from __future__ import annotations

import hashlib
from pathlib import Path

import gymnasium
import numpy as np
import pytest

from worldloop.common.contracts.modeling import ChatCodec, build_sequence, collate
from worldloop.bootstrap.tiny_model import fallback_corpus, make_tiny_model
from worldloop.bootstrap.sft import answer_format_ok, demonstration_seeds, format_ok_rate, make_demonstrations, run_sft

ENV_ID = "worldloop-test/Corridor-v0"


class Corridor(gymnasium.Env):
    """A 1-D corridor following the worldloop env contract: walk onto the goal cell.

    obs = {"text", "image"}; ``system_prompt()``; ``expert_response()`` in the VAGEN
    grounding + world-modeling format; ``step(response_text)`` parses the <answer>.
    """

    metadata = {"render_modes": ["vision", "text"]}

    def __init__(self, render_mode: str = "vision", size: int = 6):
        self.render_mode, self.size = render_mode, size
        self.player = self.goal = 0
        self.action_space = gymnasium.spaces.Text(max_length=4096)
        self.observation_space = gymnasium.spaces.Dict({"text": gymnasium.spaces.Text(max_length=4096)})

    def system_prompt(self) -> str:
        return (
            "You are a corridor walker. Actions you can take: Left, Right. Answer in the format "
            "<think><observation>...</observation><reasoning>...</reasoning><prediction>...</prediction></think>"
            "<answer>...</answer>"
        )

    def _obs(self) -> dict:
        if self.render_mode != "vision":
            return {"text": f"Player at {self.player}, goal at {self.goal}. Decide.", "image": None}
        img = np.zeros((28, 28 * self.size, 3), dtype=np.uint8)
        img[:, 28 * self.player : 28 * (self.player + 1), 0] = 255
        img[:, 28 * self.goal : 28 * (self.goal + 1), 1] = 255
        return {"text": "[Current Observation]:\n<image>\nDecide your next action(s).", "image": img}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.player, self.goal = self.np_random.choice(self.size, 2, replace=False).tolist()
        return self._obs(), {"state": {"player": self.player, "goal": self.goal}}

    def expert_response(self) -> str:
        d = "Right" if self.goal > self.player else "Left"
        return (
            f"<think><observation>The goal is {d.lower()} of the player.</observation>"
            f"<reasoning>I should move {d}.</reasoning><prediction>The player will be closer to the goal.</prediction>"
            f"</think><answer>{d}</answer>"
        )

    def step(self, action: str):
        if "<answer>Right</answer>" in action:
            self.player = min(self.size - 1, self.player + 1)
        elif "<answer>Left</answer>" in action:
            self.player = max(0, self.player - 1)
        done = self.player == self.goal
        return self._obs(), float(done), done, False, {"success": done}


if ENV_ID not in gymnasium.registry:
    gymnasium.register(ENV_ID, entry_point=Corridor, disable_env_checker=True)


@pytest.fixture(scope="module")
def vl_dir(shared_tiny_model) -> Path:
    # a fixed tokenizer corpus: the default one grows with every env's texts, and the format-rate
    # thresholds below were set for this tokenizer
    return shared_tiny_model(seed=0, max_image_side=112, corpus=fallback_corpus())


@pytest.fixture(scope="module")
def codec(vl_dir: Path) -> ChatCodec:
    return ChatCodec(vl_dir, max_image_side=112)


def test_answer_format_check() -> None:
    assert answer_format_ok("<think><observation>a</observation></think><answer>Up</answer>")
    assert answer_format_ok("  <think>x</think>\n<answer>Left, Up</answer> ")
    assert not answer_format_ok("<think>x</think><answer> </answer>")
    assert not answer_format_ok("<answer>Up</answer>")
    assert not answer_format_ok("<think>x</think><answer>Up</answer> trailing")
    # in a strategy's own format: No-Think answers alone; Grounding-WorldModeling needs its three fields
    assert answer_format_ok("<answer>Up</answer>", "no_think")
    assert not answer_format_ok("<think>x</think><answer>Up</answer>", "no_think")
    assert not answer_format_ok("<think>x</think><answer>Up</answer>", "grounding_worldmodeling")
    assert answer_format_ok("<think><observation>a</observation><reasoning>b</reasoning><prediction>c</prediction></think>"
                            "<answer>Up</answer>", "grounding_worldmodeling")


def test_demonstrations_follow_the_actor_layout(codec: ChatCodec) -> None:
    demos = make_demonstrations([{"id": ENV_ID, "kwargs": {"size": 6}}], 4, 100, codec, max_turns=3)
    assert [d.seed for d in demos] == [100, 101, 102, 103]
    for d in demos:
        env = gymnasium.make(ENV_ID, disable_env_checker=True)
        env.reset(seed=d.seed)
        first = d.turns[0]
        assert first.response_text == env.unwrapped.expert_response()
        assert codec.decode(first.response_ids) == first.response_text
        assert first.response_ids[-1] == codec.im_end_id
        assert "You are a corridor walker." in codec.decode(first.obs_ids)
        # the expert walks straight to the goal: turns = distance (capped by max_turns)
        assert len(d.turns) == min(3, abs(env.unwrapped.goal - env.unwrapped.player))
        assert d.success == (len(d.turns) == abs(env.unwrapped.goal - env.unwrapped.player))
        assert all(len(t.images) == 1 for t in d.turns)
    batch = collate([build_sequence(d) for d in demos], codec)  # consistent image tokens, or it raises
    assert int(batch["response_mask"].sum()) == sum(len(t.response_ids) for d in demos for t in d.turns)
    with pytest.raises(ValueError, match="needs at least one env spec"):
        make_demonstrations([], 1, 0, codec, 1)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_sft_lowers_loss_and_raises_format_rate(vl_dir: Path, codec: ChatCodec, tmp_path: Path) -> None:
    demos = make_demonstrations([ENV_ID], 16, 0, codec, max_turns=3)
    held_out = make_demonstrations([ENV_ID], 8, 1000, codec, max_turns=1)
    original = _sha(vl_dir / "model.safetensors")
    before = format_ok_rate(vl_dir, held_out, temperature=0.7, max_new_tokens=256, seed=0)
    seen = []
    stats = run_sft(vl_dir, demos, epochs=40, lr=1e-2, batch_size=8, out_dir=tmp_path / "sft", progress=seen.append)
    assert stats["steps"] == 40 * 2 == len(seen)
    assert stats["loss_after"] < 0.5 * stats["loss_before"]
    assert _sha(vl_dir / "model.safetensors") == original  # out_dir given: the source stays as it was
    assert (tmp_path / "sft" / "tokenizer.json").exists() and (tmp_path / "sft" / "preprocessor_config.json").exists()
    after = format_ok_rate(tmp_path / "sft", held_out, temperature=0.7, max_new_tokens=256, seed=0)
    assert before <= 0.125 and after >= 0.75, (before, after)


def test_sft_in_place_and_bad_arguments(tmp_path: Path, codec: ChatCodec) -> None:
    path = make_tiny_model(tmp_path / "m", seed=0, max_image_side=112, corpus=fallback_corpus())
    demos = make_demonstrations([ENV_ID], 2, 0, codec, max_turns=1)
    first = _sha(path / "model.safetensors")
    stats = run_sft(path, demos, epochs=1, lr=1e-3, batch_size=2)
    assert stats["loss_after"] < stats["loss_before"]
    assert _sha(path / "model.safetensors") != first
    with pytest.raises(ValueError, match="needs at least one demonstration"):
        run_sft(path, [], epochs=1, lr=1e-3, batch_size=1)
    with pytest.raises(ValueError, match="lr > 0"):
        run_sft(path, demos, epochs=1, lr=0.0, batch_size=1)


@pytest.fixture
def worldloop_envs() -> None:
    """worldloop's env ids, registered by importing the installed ``worldloop.envs``: part of the
    package, never optional, so an import error fails the test instead of skipping it."""
    from worldloop import envs  # noqa: F401

    assert {"worldloop/Sokoban-v0", "worldloop/FrozenLake-v0"} <= set(gymnasium.registry)


def test_demonstrations_from_sokoban(codec: ChatCodec, worldloop_envs) -> None:
    spec = {"id": "worldloop/Sokoban-v0", "kwargs": {"render_mode": "vision", "prompt_format": "grounding_worldmodeling"}}
    demos = make_demonstrations([spec], 2, 0, codec, max_turns=2)
    for d in demos:
        text = d.turns[0].response_text
        assert "<observation>" in text and "<prediction>" in text and answer_format_ok(text)
    collate([build_sequence(d) for d in demos], codec)


def test_concise_response_keeps_answer_and_first_relations() -> None:
    from worldloop.bootstrap.sft import concise_response

    full = ("<think><observation>goal is above and on the right side of the player. hole0 is below and at the same "
            "column as the player.</observation><reasoning>The shortest solution takes 3 more action(s); I will do "
            "Right, Up now.</reasoning><prediction>goal is above and at the same column as the player. hole0 is below "
            "and on the left side of the player.</prediction></think><answer>Right,Up</answer>")
    assert concise_response(full, "grounding_worldmodeling", 1) == (
        "<think><observation>goal is above and on the right side of the player.</observation><reasoning></reasoning>"
        "<prediction>goal is above and at the same column as the player.</prediction></think><answer>Right,Up</answer>")
    assert concise_response(full, "grounding_worldmodeling", 5).count(". ") == 2  # both sentences, both fields
    assert concise_response("not a response", "grounding_worldmodeling", 1) == "not a response"
    # plan: the turn's actions become the reasoning, written before the prediction
    assert concise_response(full, "grounding_worldmodeling", 1, reasoning="plan") == (
        "<think><observation>goal is above and on the right side of the player.</observation><reasoning>Right,Up"
        "</reasoning><prediction>goal is above and at the same column as the player.</prediction></think>"
        "<answer>Right,Up</answer>")
    with pytest.raises(ValueError, match="reasoning"):
        concise_response(full, "grounding_worldmodeling", 1, reasoning="why")
    # outlook: the env's text of what each move runs into becomes the reasoning
    assert concise_response(full, "grounding_worldmodeling", 1, reasoning="outlook",
                            outlook="Left ice, Down hole, Right ice, Up edge.") == (
        "<think><observation>goal is above and on the right side of the player.</observation><reasoning>Left ice, "
        "Down hole, Right ice, Up edge.</reasoning><prediction>goal is above and at the same column as the player."
        "</prediction></think><answer>Right,Up</answer>")
    with pytest.raises(ValueError, match="needs the env's move_outlook"):
        concise_response(full, "grounding_worldmodeling", 1, reasoning="outlook")


def test_concise_demonstrations_are_shorter_and_still_solve(codec: ChatCodec, worldloop_envs) -> None:
    spec = {"id": "worldloop/FrozenLake-v0", "kwargs": {"size": 4, "min_actions_to_succeed": 3, "image_size": 112,
                                                        "prompt_format": "grounding_worldmodeling"}}
    full = make_demonstrations([spec], 4, 7, codec, max_turns=3)
    short = make_demonstrations([spec], 4, 7, codec, max_turns=3, style="concise", observation_relations=1)
    for f, s in zip(full, short):
        assert s.success == f.success and [t.actions for t in s.turns] == [t.actions for t in f.turns]
        assert all(len(b.response_ids) < len(a.response_ids) for a, b in zip(f.turns, s.turns))
        assert all(t.format_ok and "<reasoning></reasoning>" in t.response_text for t in s.turns)
    planned = make_demonstrations([spec], 4, 7, codec, max_turns=3, style="concise", observation_relations=1,
                                  reasoning="plan")
    for f, p in zip(full, planned):
        assert p.success == f.success and [t.actions for t in p.turns] == [t.actions for t in f.turns]
        for t in p.turns:
            assert t.format_ok and t.reasoning == ",".join(t.actions)
    with pytest.raises(ValueError, match="style must be 'expert' or 'concise', got 'terse'"):
        make_demonstrations([spec], 1, 0, codec, 1, style="terse")


def test_demonstration_seeds_must_not_overlap_rl_or_eval_seeds() -> None:
    from worldloop.common.contracts.config import ConfigError, load_config

    cfg = load_config("configs/tiny-sokoban.yaml")
    demo = range(cfg.sft.seed_start, cfg.sft.seed_start + cfg.sft.episodes + 8)
    assert not set(demo) & set(range(cfg.actor.seed_start, min(cfg.actor.seed_end, cfg.actor.seed_start + 10**6)))
    with pytest.raises(ConfigError, match="overlap the RL seeds") as e:
        load_config("configs/tiny-sokoban.yaml", ["sft.seed_start=0"])
    assert e.value.key == "sft.seed_start" and "RL seeds" in e.value.reason
    with pytest.raises(ConfigError, match="overlap the held-out eval seeds") as e:  # the last probe seed touches the first held-out seed
        load_config("configs/tiny-sokoban.yaml", [f"sft.seed_start={cfg.eval.seed_start - cfg.sft.episodes - 7}"])
    assert e.value.key == "sft.seed_start" and "eval seeds" in e.value.reason
    load_config("configs/tiny-sokoban.yaml", [f"sft.seed_start={cfg.eval.seed_start - cfg.sft.episodes - 8}"])
    load_config("configs/tiny-sokoban.yaml", ["sft.seed_start=0", "sft.enabled=false"])  # no demonstrations: no check


def _tempting(spec: dict, seed: int) -> bool:
    """The level's verdict from a fresh env (the verdict itself: tests/test_envs_frozenlake.py, hand-made boards)."""
    env = gymnasium.make(spec["id"], **spec["kwargs"])
    env.reset(seed=seed)
    return env.unwrapped.tempting_dead_end()


def test_a_level_pool_puts_the_levels_that_tempt_a_dead_end_first(worldloop_envs) -> None:
    spec = {"id": "worldloop/FrozenLake-v0", "kwargs": {"size": 4, "min_actions_to_succeed": 3, "image_size": 112}}
    assert demonstration_seeds([spec], 40, 100) == [(0, s) for s in range(100, 140)]
    tempting = [s for s in range(100, 180) if _tempting(spec, s)]
    assert 5 < len(tempting) < 40  # both kinds in the pool: the order below is not trivial
    quiet = [s for s in range(100, 180) if s not in tempting]
    assert demonstration_seeds([spec], 40, 100, level_pool=2) == [(0, s) for s in (tempting + quiet)[:40]]
    # every tempting level of a pool of 3 x 8 seeds, then the first quiet ones, in seed order
    picked = [s for _, s in demonstration_seeds([spec], 8, 100, level_pool=3)]
    assert picked == ([s for s in range(100, 124) if _tempting(spec, s)] + [s for s in range(100, 124) if not _tempting(spec, s)])[:8]
    two = [spec, {"id": "worldloop/Sokoban-v0", "kwargs": {}}]
    assert demonstration_seeds(two, 4, 7) == [(0, 7), (1, 8), (0, 9), (1, 10)]
    with pytest.raises(ValueError, match="worldloop/Sokoban-v0 has no tempting_dead_end"):
        demonstration_seeds(two, 4, 7, level_pool=2)
    with pytest.raises(ValueError, match="level_pool must be >= 1, got 0"):
        demonstration_seeds([spec], 4, 7, level_pool=0)


def test_a_level_pool_widens_the_demonstration_seeds_the_config_checks() -> None:
    from worldloop.common.contracts.config import ConfigError, load_config

    cfg = load_config("configs/tiny-frozenlake.yaml")
    edge = cfg.eval.seed_start - 2 * cfg.sft.episodes - 8
    load_config("configs/tiny-frozenlake.yaml", [f"sft.seed_start={edge}", "sft.level_pool=2"])
    with pytest.raises(ConfigError, match="overlap the held-out eval seeds") as e:
        load_config("configs/tiny-frozenlake.yaml", [f"sft.seed_start={edge + 1}", "sft.level_pool=2"])
    assert e.value.key == "sft.seed_start"
    with pytest.raises(ConfigError, match="sft.level_pool") as e:
        load_config("configs/tiny-frozenlake.yaml", ["sft.level_pool=0"])


def test_distinct_moves_demonstrations_take_each_direction_once_per_turn(codec: ChatCodec, worldloop_envs) -> None:
    from worldloop.common.contracts.config import load_config

    spec = {"id": "worldloop/FrozenLake-v0", "kwargs": {"size": 4, "min_actions_to_succeed": 3, "image_size": 112,
                                                        "prompt_format": "grounding_worldmodeling"}}
    plain = make_demonstrations([spec], 8, 11, codec, max_turns=3)
    step = make_demonstrations([spec], 8, 11, codec, max_turns=3, distinct_moves=True)
    for p, d in zip(plain, step):
        env = gymnasium.make(spec["id"], **spec["kwargs"])
        env.reset(seed=d.seed)
        assert d.turns[0].response_text == env.unwrapped.expert_response(distinct_moves=True)
        assert all(len(set(t.actions)) == len(t.actions) >= 1 for t in d.turns)
        assert sum(len(t.actions) for t in d.turns[:1]) <= sum(len(t.actions) for t in p.turns[:1])
    assert any(len(d.turns) > len(p.turns) for p, d in zip(plain, step))  # looking again costs turns
    assert load_config(None, ["sft.turn_plan=distinct"]).sft.turn_plan == "distinct"


def test_local_demonstrations_write_exactly_the_truth(codec: ChatCodec, worldloop_envs) -> None:
    """relation_prompt local: the concise demonstrations keep the whole description (observation_relations
    does not cut it), which is exactly the state's relations, so the local judge scores every one 1.0."""
    from worldloop.judge.scoring import rule_text_score

    spec = {"id": "worldloop/FrozenLake-v0", "kwargs": {"size": 4, "min_actions_to_succeed": 3, "image_size": 112,
                                                        "prompt_format": "grounding_worldmodeling",
                                                        "relation_prompt": "local"}}
    demos = make_demonstrations([spec], 6, 11, codec, max_turns=3, style="concise", observation_relations=1)
    several = 0
    for d in demos:
        for t in d.turns:
            assert t.format_ok
            assert t.observation == ". ".join(t.state_before.relations) + "."
            assert t.prediction == ". ".join(t.state_after.relations) + "."
            assert rule_text_score(t.observation, t.state_before, "frozenlake", "local").score == 1.0
            assert rule_text_score(t.prediction, t.state_after, "frozenlake", "local").score == 1.0
            several += len(t.state_before.relations) > 1
    assert several > 0  # some turn had a hole next to the player, so more than the first sentence was kept


def test_symbolic_demonstrations_write_the_whole_grid(codec: ChatCodec, worldloop_envs) -> None:
    """state_format symbolic: a concise demonstration keeps the whole grid (observation_relations cuts
    relation sentences only; before, the grid was cut at ". " like a sentence and got a "." added),
    so the rule judge scores every observation and prediction 1.0."""
    from worldloop.judge.scoring import rule_text_score

    spec = {"id": "worldloop/FrozenLake-v0", "kwargs": {"size": 4, "min_actions_to_succeed": 3, "image_size": 112,
                                                        "prompt_format": "grounding_worldmodeling",
                                                        "state_format": "symbolic"}}
    demos = make_demonstrations([spec], 4, 11, codec, max_turns=3, style="concise", observation_relations=1)
    for d in demos:
        for t in d.turns:
            assert t.format_ok
            assert t.observation == t.state_before.symbolic and t.prediction == t.state_after.symbolic
            assert len(t.observation.splitlines()) == 4 and not t.observation.endswith(".")
            assert rule_text_score(t.observation, t.state_before, "frozenlake", "f1").score == 1.0
            assert rule_text_score(t.prediction, t.state_after, "frozenlake", "f1").score == 1.0


def test_outlook_demonstrations_reason_from_the_cells_around_the_player(codec: ChatCodec, worldloop_envs) -> None:
    """sft.concise_reasoning outlook: each turn's reasoning is the env's move_outlook() before the move, and
    the demonstrator's first move never runs into a hole or off the board by what that reasoning says."""
    spec = {"id": "worldloop/FrozenLake-v0", "kwargs": {"size": 4, "min_actions_to_succeed": 3, "image_size": 112,
                                                        "prompt_format": "grounding_worldmodeling"}}
    demos = make_demonstrations([spec], 6, 11, codec, max_turns=3, style="concise", observation_relations=1,
                                reasoning="outlook", distinct_moves=True)
    import gymnasium

    assert sum(len(d.turns) for d in demos) > len(demos)  # some episodes look again
    env = gymnasium.make(spec["id"], **spec["kwargs"])
    for d in demos:  # replayed: each turn's reasoning is the outlook of the state the turn starts from
        env.reset(seed=d.seed)
        for t in d.turns:
            assert t.format_ok and t.reasoning == env.unwrapped.move_outlook()
            said = dict(part.split(" ") for part in t.reasoning.rstrip(".").split(", "))
            assert list(said) == ["Left", "Down", "Right", "Up"] and set(said.values()) <= {"ice", "hole", "goal", "edge"}
            assert said[t.actions[0]] in ("ice", "goal")
            env.step(t.response_text)
    env.close()
    from worldloop.common.contracts.config import load_config

    assert load_config(None, ["sft.concise_reasoning=outlook"]).sft.concise_reasoning == "outlook"
    sokoban = {"id": "worldloop/Sokoban-v0", "kwargs": {"render_mode": "vision", "prompt_format": "grounding_worldmodeling"}}
    with pytest.raises(ValueError, match="has no move_outlook"):
        make_demonstrations([sokoban], 1, 11, codec, max_turns=1, style="concise", reasoning="outlook")
