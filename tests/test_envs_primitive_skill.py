"""PrimitiveSkill env: primitive parsing, geometric rules, Table 19 stage rewards, expert, adversarial."""

from __future__ import annotations

import gymnasium
import msgpack
import numpy as np
import pytest

from worldloop import envs  # noqa: F401  (registers the ids)
from worldloop.envs.primitive_skill.tasks import Action, format_action, parse_action
from worldloop.envs.primitive_skill.world import Body, Tabletop

RESP = "<think><observation>o</observation><reasoning>r</reasoning><prediction>p</prediction></think><answer>{}</answer>"


def make_env(**kw):
    return gymnasium.make("worldloop/PrimitiveSkill-v0", **kw).unwrapped


def cubes(task="place", **pos) -> Tabletop:
    bodies = {n: Body(n, "cube", [float(v) for v in p]) for n, p in pos.items()}
    targets = {"left_target": (80.0, -100.0), "right_target": (80.0, 100.0)} if task == "place" else {}
    return Tabletop(task, bodies, targets=targets)


def run(tt: Tabletop, text: str):
    return tt.execute(parse_action(text))


# ----------------------------------------------------------------------------- parsing


def test_parse_action():
    assert parse_action("pick(62,-55,20)") == Action("pick", (62.0, -55.0, 20.0))
    assert parse_action(" Place( 1.5 , 2 ,3 ) ") == Action("place", (1.5, 2.0, 3.0))
    assert parse_action("push(1,2,3,4,5,6)").args == (1.0, 2.0, 3.0, 4.0, 5.0, 6.0)
    for bad in ("pick(1,2)", "push(1,2,3)", "grab(1,2,3)", "pick(a,b,c)", "pick(1,2,3", "pick(1e999,0,0)",
                "pick(" + "1," * 500 + "1)", "", None):
        assert parse_action(bad) is None
    assert format_action(Action("place", (80.0, -100.0, 30.0))) == "place(80,-100,30)"
    assert format_action(Action("pick", (1.25, 2.0, 3.0))) == "pick(1.2,2,3)"


# ----------------------------------------------------------------------------- rules


def test_reach_grasp_and_place_rules():
    tt = cubes(red_cube=(0, 0, 20), green_cube=(100, 100, 20))
    ok, changed, msg = run(tt, "pick(300,0,20)")  # x limit is 150
    assert not ok and not changed and "outside the workspace" in msg
    ok, _, msg = run(tt, "pick(50,50,20)")
    assert not ok and "no object" in msg and tt.holding is None
    ok, _, msg = run(tt, "place(0,0,40)")
    assert not ok and "not holding" in msg
    ok, changed, _ = run(tt, "pick(3,-4,25)")  # within the cube's body (+5 mm slack)
    assert ok and changed and tt.holding == "red_cube"
    ok, _, msg = run(tt, "pick(100,100,20)")
    assert not ok and "already holding" in msg
    # resting height on the table is 20; 20 - 15 = 5 is the lowest release point (z limit 10 applies first)
    ok, _, msg = run(tt, "place(-50,0,10)")
    assert ok and tt.bodies["red_cube"].pos == [-50.0, 0.0, 20.0] and tt.holding is None


def test_stacking_support_and_collisions():
    tt = cubes("stack", red_cube=(0, 0, 20), green_cube=(100, 100, 20), purple_cube=(-60, -60, 20))
    run(tt, "pick(0,0,20)")
    # over green's top face (|dx|, |dy| <= 20) and high enough: rests at 40 + 20 = 60
    ok, _, msg = run(tt, "place(110,95,70)")
    assert ok and tt.bodies["red_cube"].pos == [110.0, 95.0, 60.0] and "green cube" in msg
    assert tt._on("red_cube", "green_cube") and tt.stage() == 1
    # green is covered by red: a top-down grasp is impossible
    ok, _, msg = run(tt, "pick(100,100,20)")
    assert not ok and "on top of it" in msg
    run(tt, "pick(-60,-60,20)")
    # half over red's edge (centre 30 mm off): it would tip/collide -> refused, still held
    ok, _, msg = run(tt, "place(140,95,110)")
    assert not ok and "collide" in msg and tt.holding == "purple_cube"
    # too low: releasing at 80 would push purple into red (rest 100, lowest 85)
    ok, _, msg = run(tt, "place(110,95,80)")
    assert not ok and "needs z >= 85" in msg
    ok, _, _ = run(tt, "place(110,95,110)")
    assert ok and tt.bodies["purple_cube"].pos[2] == 100.0 and tt.success()


def test_push_slides_and_stops_at_obstacles():
    tt = cubes("align", red_cube=(0, 0, 20), green_cube=(100, 0, 20))
    ok, changed, _ = run(tt, "push(0,0,20,0,80,20)")
    assert ok and changed and tt.bodies["red_cube"].pos[:2] == pytest.approx([0.0, 80.0])
    tt.bodies["red_cube"].pos = [0.0, 0.0, 20.0]
    # towards green at x = 100: cubes 40 mm wide touch at x = 60; the sweep stops before contact
    ok, changed, msg = run(tt, "push(0,0,20,140,0,20)")
    assert ok and changed and "obstacle" in msg
    assert 56.0 <= tt.bodies["red_cube"].pos[0] <= 60.0
    ok, _, msg = run(tt, "push(-80,-80,20,0,0,20)")
    assert not ok and "no object" in msg
    ok, _, msg = run(tt, "push(100,0,20,100,0,120)")
    assert not ok and "along the table" in msg


def test_drawer_rules_order_matters():
    rng = np.random.default_rng(0)
    tt = Tabletop.generate("drawer", rng)
    apple = [int(round(v)) for v in tt.bodies["apple"].pos]
    d = tt.drawer_pos()
    hx, hy, hz = (int(round(v)) for v in tt.handle_pos())
    # pulling the handle outwards is not a push
    ok, _, msg = run(tt, f"push({hx},{hy},{hz},{hx},{hy + 50},{hz})")
    assert not ok and "pulled" in msg
    # closing first, then the apple no longer fits: the task cannot be completed any more
    closed = tt.copy()
    ok, changed, _ = run(closed, f"push({hx},{hy},{hz},{hx},-570,{hz})")
    assert ok and changed and closed.drawer_open == 0.0
    run(closed, f"pick({apple[0]},{apple[1]},{apple[2]})")
    ok, _, msg = run(closed, f"place({int(d[0])},{int(d[1])},300)")  # where the opening was
    assert ok and "on the table" in msg and closed.bodies["apple"].pos[2] == 36.0
    assert closed.stage() == -1 and not closed.success()
    ok, _, msg = run(closed, f"push({hx},-570,{hz},{hx},-400,{hz})")
    assert not ok and "pulled" in msg
    # the right order: apple in (rests on the drawer floor at 200 + 36), then close
    run(tt, f"pick({apple[0]},{apple[1]},{apple[2]})")
    assert tt.stage() == 0
    ok, _, msg = run(tt, f"place({int(d[0])},{int(d[1])},260)")
    assert ok and "in the drawer" in msg and tt.bodies["apple"].pos[2] == 236.0 and tt.stage() == 1
    y_before = tt.bodies["apple"].pos[1]
    ok, _, msg = run(tt, f"push({hx},{hy},{hz},{hx},-570,{hz})")
    assert ok and "closed" in msg and tt.success()
    assert tt.bodies["apple"].pos[1] == pytest.approx(y_before - (hy + 570))  # rides along with the drawer


# ----------------------------------------------------------------------------- rewards (Table 19)


def test_stage_rewards_by_hand_place_task():
    env = make_env(task="place")
    env.reset(seed=0)
    env.tt = cubes(red_cube=(0, 50, 20), green_cube=(-50, -50, 20))
    env._state_cache = None
    # turn 1: pick red (stage 0: +2) and put it in the left target (stage 1: +2); each -0.1
    _, r1, term, _, info = env.step(RESP.format("pick(0,50,20)|place(80,-100,40)"))
    assert info["env_reward"] == pytest.approx((2 - 0.1) + (2 - 0.1)) and r1 == pytest.approx(4.3)
    assert info["metrics"]["stage"] == 1.0 and not term
    # turn 2: a place with nothing held fails (-0.1, not effective), then pick green (stage 2: +2 - 0.1)
    _, r2, _, _, info = env.step(RESP.format("place(0,0,40)|pick(-50,-50,20)"))
    assert info["actions_effective"] == 1 and info["env_reward"] == pytest.approx(-0.1 + 1.9)
    # turn 3: green into the right target: success +10
    _, r3, term, _, info = env.step(RESP.format("place(80,100,40)"))
    assert info["env_reward"] == pytest.approx(10.0) and r3 == pytest.approx(10.5) and term and info["success"]
    # the episode's stage rewards total (stage + 1) * 2 = 6 for the highest stage 2
    assert r1 + r2 + r3 == pytest.approx(0.5 * 3 + 6 + 10 - 0.1 * 4)


def test_regrasping_does_not_pay_twice():
    env = make_env(task="stack")
    env.reset(seed=0)
    env.tt = cubes("stack", red_cube=(0, 0, 20), green_cube=(100, 100, 20), purple_cube=(-60, -60, 20))
    env._state_cache = None
    _, _, _, _, info = env.step(RESP.format("pick(0,0,20)|place(0,0,30)"))
    assert info["env_reward"] == pytest.approx(1.9 - 0.1)  # stage 0 once
    _, _, _, _, info = env.step(RESP.format("pick(0,0,20)|place(0,0,30)"))
    assert info["env_reward"] == pytest.approx(-0.2)  # no new stage


# ----------------------------------------------------------------------------- episodes


@pytest.mark.parametrize("task", ["place", "stack", "drawer", "align"])
def test_expert_solves_within_max_turns(task):
    env = make_env(task=task, image_size=48, state_format="structured")
    for seed in range(3):
        _, info = env.reset(seed=seed)
        assert info["task"] == task
        for _turn in range(3):  # Table 13: max_turns 3
            _, _, term, trunc, info = env.step(env.expert_response())
            assert info["format_ok"] and info["actions_executed"] == info["actions_effective"]
            if term or trunc:
                break
        assert info["success"], (task, seed)
        assert info["metrics"]["stage"] == info["metrics"]["stages"] - 1


def test_expert_prediction_matches_the_next_state():
    env = make_env(task="stack", state_format="structured", image_size=32)
    _, info = env.reset(seed=4)
    resp = env.expert_response()
    import json
    obs = json.loads(resp.split("<observation>")[1].split("</observation>")[0])
    assert obs == info["state"]["structured"]
    _, _, _, _, info = env.step(resp)
    pred = json.loads(resp.split("<prediction>")[1].split("</prediction>")[0])
    assert pred == info["state"]["structured"]


def test_seed_determinism_and_state_format():
    a, b = make_env(task="align", image_size=64), make_env(task="align", image_size=64)
    oa, ia = a.reset(seed=9)
    ob, ib = b.reset(seed=9)
    assert oa["text"] == ob["text"] and np.array_equal(oa["image"], ob["image"]) and ia == ib
    assert oa["image"].shape == (64, 64, 3) and oa["text"].count("<image>") == 1
    assert "x_workspace_limit: (-100, 150)" in oa["text"] and "Object positions:" in oa["text"]
    s = ia["state"]
    assert msgpack.unpackb(msgpack.packb(s)) == s
    assert set(s["structured"]) == {"red_cube", "green_cube"}
    assert all(isinstance(v, list) and len(v) == 3 and all(isinstance(c, int) for c in v)
               for v in s["structured"].values())
    # vision mode lists unnamed positions (the agent grounds them in the image); text mode names them
    assert "red_cube" not in oa["text"]
    ot, _ = make_env(task="align", render_mode="text").reset(seed=9)
    assert ot["image"] is None and "'red_cube': (" in ot["text"]
    with pytest.raises(ValueError, match="symbolic"):
        make_env(state_format="symbolic")
    with pytest.raises(ValueError, match="task"):
        make_env(task="juggle")


def test_adversarial_answers():
    env = make_env(task="place", image_size=32)
    _, info0 = env.reset(seed=1)
    # well-formed primitive with out-of-range coordinates: executed, fails, costs the step penalty
    _, reward, _, _, info = env.step(RESP.format("pick(99999,-99999,20)|place(0,0,-5000)"))
    assert info["format_ok"] and info["actions_executed"] == 2 and info["actions_effective"] == 0
    assert info["env_reward"] == pytest.approx(-0.2) and reward == pytest.approx(0.3)
    assert info["state"] == info0["state"]
    assert "outside the workspace" in env._observation(False)["text"]
    # malformed primitives or garbage: a format failure, nothing runs
    for text in (RESP.format("pick(1,2)"), RESP.format("pick(1,2,3)|dance()"), "x" * 1_000_000,
                 RESP.format("pick(" + "9" * 5000 + ",0,0)"), None):
        _, reward, term, _, info = env.step(text)
        assert not info["format_ok"] and reward == 0.0 and not term and info["state"] == info0["state"]


def test_maniskill_backend_without_the_package_says_how_to_install():
    with pytest.raises(RuntimeError, match="pip install mani_skill"):
        make_env(backend="maniskill")


@pytest.mark.parametrize("fmt", ["no_think", "free_think", "grounding", "worldmodeling"])
def test_expert_response_in_every_prompt_format(fmt):
    env = make_env(task="drawer", prompt_format=fmt, image_size=32)
    env.reset(seed=5)
    _, _, _, _, info = env.step(env.expert_response())
    assert info["format_ok"] and info["actions_executed"] == 2 and info["metrics"]["stage"] == 1.0


def test_stuck_expert_still_answers_well_formed():
    env = make_env(task="drawer", image_size=32)
    env.reset(seed=0)
    hx, hy, hz = (int(round(v)) for v in env.tt.handle_pos())
    env.step(RESP.format(f"push({hx},{hy},{hz},{hx},-570,{hz})"))  # closed before the apple went in
    _, _, _, _, info = env.step(env.expert_response())
    assert info["format_ok"]
