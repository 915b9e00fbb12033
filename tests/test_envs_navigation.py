"""Navigation env: renderer geometry, motion rules, Table 18 rewards, D.1 ground truth, expert, adversarial."""

from __future__ import annotations

import math

import gymnasium
import msgpack
import numpy as np
import pytest

from worldloop import envs  # noqa: F401  (registers the ids)
from worldloop.envs.navigation.raycast import Scene
from worldloop.envs.navigation.world import World, NavObject, direction_word, relations_from_gt
from worldloop.envs.navigation.env import describe_gt


def make_env(**kw):
    return gymnasium.make("worldloop/Navigation-v0", **kw).unwrapped


def toy_world(threshold: float = 1.0) -> World:
    """A 3 m x 4 m room, agent at (1.5, 0.5) facing +z, a garbage can centred at (1.5, 3.0)."""
    parts = [((1.3, 0.0, 2.8), (1.7, 0.6, 3.2), (40, 110, 60))]
    can = NavObject(1, "GarbageCan", (1.5, 0.3, 3.0), (1.3, 2.8, 1.7, 3.2), 0.6, parts)
    return World("kitchen", 3.0, 4.0, [can], None, 1, "Navigate to the garbage can.", "base",
                 x=1.5, z=0.5, heading=0, horizon=0, step_length=0.25, success_threshold=threshold)


def install(env, world):
    env.world = world
    env._state_cache = None


# ----------------------------------------------------------------------------- renderer


def test_raycast_depth_and_ids_by_hand():
    sc = Scene((-5, 0, -5), (5, 3, 5))
    sc.add_box((-0.5, 0.5, 2.0), (0.5, 1.5, 3.0), (200, 0, 0), 7)
    f = sc.render((0.0, 1.0, 0.0), 0.0, 0.0, 90.0, 33)
    assert f.rgb.shape == (33, 33, 3) and f.rgb.dtype == np.uint8
    # the central ray goes straight along +z and enters the box face at z = 2
    assert f.ids[16, 16] == 7
    assert f.depth[16, 16] == pytest.approx(2.0, abs=1e-4)
    # a corner ray (45 degrees off axis in x and y) misses the box and hits the room shell
    assert f.ids[0, 0] == 0
    # facing backwards the box is out of view; the back wall is 5 m away
    back = sc.render((0.0, 1.0, 0.0), 180.0, 0.0, 90.0, 33)
    assert 7 not in back.visible_ids()
    assert back.depth[16, 16] == pytest.approx(5.0, abs=1e-4)
    # looking down 90 degrees the centre ray hits the floor 1 m below
    down = sc.render((0.0, 1.0, 0.0), 0.0, 90.0, 60.0, 9)
    assert down.depth[4, 4] == pytest.approx(1.0, abs=1e-4)


def test_direction_buckets():
    # VAGEN's buckets of the bearing relative to the heading
    assert direction_word(0, 1, 0) == "ahead"
    assert direction_word(1, 0, 0) == "right"
    assert direction_word(-1, 0, 0) == "left"
    assert direction_word(0, -1, 0) == "back"
    assert direction_word(1, 0, 90) == "ahead"
    assert direction_word(1, 1.01, 0) == "ahead"  # 44.7 degrees
    assert direction_word(1, 0.99, 0) == "right"  # 45.3 degrees


# ----------------------------------------------------------------------------- motion rules


def test_moves_rotations_and_blocking():
    w = toy_world()
    assert w.step("moveahead") and (w.x, w.z) == (1.5, 0.75)
    assert w.step("moveback") and (w.x, w.z) == (1.5, 0.5)
    assert w.step("moveright") and (w.x, w.z) == (1.75, 0.5)  # facing +z, right is +x
    assert w.step("rotateright") and w.heading == 90
    assert w.step("moveahead") and (w.x, w.z) == (2.0, 0.5)
    assert w.step("moveahead") and (w.x, w.z) == (2.25, 0.5)
    assert w.step("moveahead") and (w.x, w.z) == (2.5, 0.5)
    assert w.step("moveahead") and (w.x, w.z) == (2.75, 0.5)  # body reaches 2.95 < 3
    # x = 3.0 would put the 0.2 m body through the wall at x = 3
    assert not w.step("moveahead") and (w.x, w.z) == (2.75, 0.5)
    assert w.step("rotateleft") and w.heading == 0
    # camera horizon: 0 -> -30, then blocked; down to 60, then blocked
    assert w.step("lookup") and w.horizon == -30
    assert not w.step("lookup") and w.horizon == -30
    for h in (0, 30, 60):
        assert w.step("lookdown") and w.horizon == h
    assert not w.step("lookdown")


def test_furniture_blocks_and_success_threshold():
    w = toy_world()
    w.x, w.z = 1.5, 2.25
    # the can's footprint starts at z = 2.8; the body (r = 0.2) at z = 2.5 would need 2.7 < 2.8: free
    assert w.step("moveahead") and w.z == 2.5
    assert not w.step("moveahead")  # 2.75 + 0.2 overlaps the footprint
    assert w.distance_to_target() == pytest.approx(0.5)
    assert w.success()
    w.z = 1.75
    assert w.distance_to_target() == pytest.approx(1.25) and not w.success()
    w.z = 2.0
    assert w.success()  # exactly 1.0 m: within the threshold


# ----------------------------------------------------------------------------- rewards (Table 18)


def test_rewards_success_and_penalties_by_hand():
    env = make_env()
    env.reset(seed=0)
    w = toy_world()
    w.z = 1.5
    install(env, w)
    # 1.5 m away: the 2nd moveahead reaches 1.0 m -> -0.1 + 10 ; the 3rd never runs (episode ended)
    resp = "<think><observation>o</observation><reasoning>r</reasoning><prediction>p</prediction></think>" \
           "<answer>moveahead, moveahead, moveahead</answer>"
    _, reward, term, trunc, info = env.step(resp)
    assert info["format_ok"] and info["actions_executed"] == 2 and info["actions_effective"] == 2
    assert info["env_reward"] == pytest.approx(-0.1 + 10.0)  # 1st: 1.25 m -> -0.1; 2nd: 1.0 m -> +10
    assert info["format_reward"] == 0.5 and reward == pytest.approx(10.4)
    assert term and not trunc and info["success"]


def test_blocked_moves_cost_the_step_penalty_and_are_not_effective():
    env = make_env()
    env.reset(seed=0)
    w = toy_world()
    w.heading = 180  # facing the wall behind (z = 0): moveahead is blocked at z = 0.25
    install(env, w)
    _, reward, term, _, info = env.step(
        "<think><observation>o</observation><reasoning>r</reasoning><prediction>p</prediction></think>"
        "<answer>moveahead,moveahead,rotateleft</answer>")
    assert info["actions_executed"] == 3 and info["actions_effective"] == 2  # 0.5 -> 0.25, blocked, rotate
    assert info["env_reward"] == pytest.approx(-0.3)
    assert reward == pytest.approx(0.2) and not term
    assert "Env_feedback: Last action is executed successfully." in env._observation(False)["text"]


# ----------------------------------------------------------------------------- ground truth


def test_ground_truth_dict_and_relations():
    w = toy_world()
    gt = w.ground_truth(max_objects=8)
    assert gt["target_obj_type"] == "GarbageCan"
    assert gt["target_distance_to_player"] == 2.5
    assert gt["target_direction_to_player"] == "ahead"
    assert gt["target_visible"] is True
    assert gt["visible_objects"] == [{"type": "GarbageCan", "direction_to_player": "ahead", "distance_to_player": 2.5}]
    assert relations_from_gt(gt) == ["the target garbage can is ahead of the player, 2.50 m away",
                                     "the target garbage can is visible in the view"]
    w.heading = 180
    gt = w.ground_truth()
    assert gt["target_direction_to_player"] == "back" and not gt["target_visible"] and gt["visible_objects"] == []
    assert "behind me" in describe_gt(gt)


def test_info_state_is_plain_msgpack_and_symbolic_is_unsupported():
    env = make_env()
    _, info = env.reset(seed=3)
    state = info["state"]
    assert msgpack.unpackb(msgpack.packb(state)) == state
    assert state["symbolic"] is None and state["relations"]
    assert info["task"] == "base" and info["metrics"]["optimal_actions"] >= 3
    with pytest.raises(ValueError, match="symbolic"):
        make_env(state_format="symbolic")
    with pytest.raises(ValueError, match="split"):
        make_env(split="hard")
    with pytest.raises(ValueError, match="resolution"):
        make_env(resolution=128, image_size=64)


# ----------------------------------------------------------------------------- episodes


def test_seed_determinism():
    a, b = make_env(resolution=64), make_env(resolution=64)
    oa, ia = a.reset(seed=11)
    ob, ib = b.reset(seed=11)
    assert oa["text"] == ob["text"] and np.array_equal(oa["image"], ob["image"]) and ia == ib
    assert oa["image"].shape == (64, 64, 3)
    oc, ic = a.reset(seed=12)
    assert ic["state"] != ia["state"] or not np.array_equal(oc["image"], oa["image"])


@pytest.mark.parametrize("split", ["base", "common_sense"])
def test_expert_reaches_the_target_with_consistent_observation_and_prediction(split):
    env = make_env(split=split, resolution=48)
    for seed in range(4):
        _, info = env.reset(seed=seed)
        label = info["state"]["relations"][0].split(" is ")[0].replace("the target ", "")
        if split == "common_sense":
            assert label not in env.world.instruction.lower()
        else:
            assert label in env.world.instruction
        for turn in range(4):  # VAGEN's max_turns
            before = info["state"]
            resp = env.expert_response()
            obs_text = resp.split("<observation>")[1].split("</observation>")[0]
            assert obs_text == describe_gt(before["structured"])
            _, _, term, trunc, info = env.step(resp)
            assert info["format_ok"]
            pred_text = resp.split("<prediction>")[1].split("</prediction>")[0]
            assert pred_text == describe_gt(info["state"]["structured"])
            if term or trunc:
                break
        assert info["success"], (split, seed)


def test_adversarial_answers_change_nothing():
    env = make_env(resolution=32)
    _, info0 = env.reset(seed=2)
    pose = env.world.pose()
    for text in ("x" * 1_000_000, "<answer>fly away</answer>", "<think></think><answer>moveahead</answer>",
                 "<think><observation>a</observation><reasoning>b</reasoning><prediction>c</prediction></think>"
                 "<answer>moveahead, teleport</answer>", None, b"\xff\xfe"):
        _, reward, term, trunc, info = env.step(text)
        assert not info["format_ok"] and reward == 0.0 and not term and not trunc
        assert env.world.pose() == pose and info["state"] == info0["state"]
    # more than 5 actions: only the first 5 run
    _, _, _, _, info = env.step("<think><observation>a</observation><reasoning>b</reasoning><prediction>c"
                                "</prediction></think><answer>" + ",".join(["rotateleft"] * 8) + "</answer>")
    assert info["format_ok"] and info["actions_executed"] == 5


def test_text_mode_and_aliases():
    env = make_env(render_mode="text", prompt_format="free_think")
    obs, _ = env.reset(seed=1)
    assert obs["image"] is None and "<image>" not in obs["text"] and "You are in a" in obs["text"]
    _, _, _, _, info = env.step("<think>go</think><answer>turn left, Move Ahead, movelleft</answer>")
    assert info["actions"] == ["rotateleft", "moveahead", "moveleft"]


def test_ai2thor_backend_without_the_package_says_how_to_install():
    with pytest.raises(RuntimeError, match="pip install ai2thor"):
        make_env(backend="ai2thor")


def test_room_generation_is_varied_and_solvable():
    rooms, types = set(), set()
    for seed in range(12):
        w = World.generate(np.random.default_rng(seed))
        rooms.add(w.room_type)
        types.add(w.target_object().type)
        plan = w.plan()
        assert plan is not None and 3 <= len(plan) <= 12
        for a in plan:
            w.step(a)
        assert w.success() and math.isfinite(w.distance_to_target())
    assert len(rooms) == 3 and len(types) >= 4


@pytest.mark.parametrize("fmt", ["no_think", "free_think", "grounding", "worldmodeling"])
def test_expert_response_in_every_prompt_format(fmt):
    env = make_env(prompt_format=fmt, resolution=32)
    obs, _ = env.reset(seed=5)
    assert obs["text"].count("<image>") == 1 and "<image>" not in env.system_prompt()
    _, reward, _, _, info = env.step(env.expert_response())
    assert info["format_ok"] and info["actions_executed"] >= 1 and info["format_reward"] == 0.5
