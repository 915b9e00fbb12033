"""The per-turn failure breakdown replays `worldloop eval` records in real envs: counts by hand."""

from __future__ import annotations

import gymnasium

from worldloop import envs  # noqa: F401  (registers the ids)
from worldloop.eval.failures import failure_breakdown, format_breakdown

SOKOBAN = ("worldloop/Sokoban-v0", {"dim_room": [6, 6], "num_boxes": 1, "max_steps": 10, "min_actions_to_succeed": 2,
                                    "render_mode": "text"})


def _expert_record(env_id: str, kwargs: dict, seed: int, max_turns: int = 5) -> dict:
    env = gymnasium.make(env_id, **kwargs)
    env.reset(seed=seed)
    turns, success = [], False
    for _ in range(max_turns):
        response = env.unwrapped.expert_response()
        _, _, term, trunc, info = env.step(response)
        turns.append({"response": response})
        success = bool(info["success"])
        if term or trunc:
            break
    env.close()
    return {"env_id": env_id, "env_kwargs": kwargs, "seed": seed, "success": success, "turns": turns}


def test_expert_turns_garbage_and_a_mismatch_are_counted_by_hand() -> None:
    env_id, kw = SOKOBAN
    expert = _expert_record(env_id, kw, seed=3)
    assert expert["success"] and len(expert["turns"]) == 1  # seed 3: Down, Left in one turn
    garbage = {"env_id": env_id, "env_kwargs": kw, "seed": 4, "success": False,
               "turns": [{"response": "no idea"}, {"response": "<answer>Up</answer>"}]}
    lying = dict(garbage, seed=5, success=True)  # replays to a failure: left out
    errored = {"error": "timeout", "turns": []}
    out = failure_breakdown([expert, garbage, lying, errored])
    assert out["episodes"] == 2 and out["success_rate"] == 0.5 and out["replay_mismatch"] == 1
    first, later = out["counts"]["first"], out["counts"]["later"]
    # first turns: the expert's (well-formed, true observation, shortest plan) and "no idea"
    assert first == {"turns": 2, "well_formed": 1, "observation_right": 1, "on_shortest_path": 1,
                     "right_reading_on_path": 1, "wrong_reading_on_path": 0, "dead_end": 0, "outlooks": 0,
                     "outlook_right": 0, "right_outlook_dead_end": 0, "wrong_outlook_dead_end": 0,
                     "against_own_outlook": 0}
    assert later["turns"] == 1 and later["well_formed"] == 0 and later["on_shortest_path"] == 0
    r = out["rates"]["first"]
    assert r["on_path_if_reading_right"] == 1.0 and r["on_path_if_reading_wrong"] == 0.0
    assert "| first | 2 | 50.0 % | 50.0 % | 50.0 % | 100.0 % | 0.0 % | 0.0 % |" in format_breakdown(out)


def test_a_hole_is_a_dead_end_and_a_detour_is_off_the_shortest_path() -> None:
    kw = {"desc": ["SFFF", "FHFH", "FFFH", "HFFG"], "render_mode": "text", "prompt_format": "grounding"}
    obs = "<think><observation>x</observation><reasoning>r</reasoning></think>"
    rec = {"env_id": "worldloop/FrozenLake-v0", "env_kwargs": kw, "seed": 0, "success": False,
           # Down: one step along a shortest path (6 -> 5); Right: into hole0
           "turns": [{"response": obs + "<answer>Down</answer>"}, {"response": obs + "<answer>Right</answer>"}]}
    out = failure_breakdown([rec])
    assert out["counts"]["first"]["on_shortest_path"] == 1 and out["counts"]["first"]["dead_end"] == 0
    assert out["counts"]["later"]["on_shortest_path"] == 0 and out["counts"]["later"]["dead_end"] == 1
    assert out["counts"]["first"]["observation_right"] == 0  # "x" is not the goal's relation


def test_an_outlook_is_checked_against_the_true_cells_and_split_by_the_dead_ends_after_it() -> None:
    """DESC at (0, 0): Left edge, Down (1, 0) ice, Right (0, 1) ice, Up edge: said right, then Down (safe).
    At (1, 0): Left edge, Down (2, 0) ice, Right (1, 1) hole, Up (0, 0) ice: said "Right ice", then Right
    into the hole."""
    kw = {"desc": ["SFFF", "FHFH", "FFFH", "HFFG"], "render_mode": "text", "prompt_format": "grounding"}

    def turn(reasoning: str, answer: str) -> dict:
        return {"response": f"<think><observation>x</observation><reasoning>{reasoning}</reasoning></think>"
                            f"<answer>{answer}</answer>"}

    rec = {"env_id": "worldloop/FrozenLake-v0", "env_kwargs": kw, "seed": 0, "success": False,
           "turns": [turn("Left edge, Down ice, Right ice, Up edge.", "Down"),
                     turn("Left edge, Down ice, Right ice, Up ice.", "Right")]}
    out = failure_breakdown([rec])
    first, later = out["counts"]["first"], out["counts"]["later"]
    keys = ("outlooks", "outlook_right", "right_outlook_dead_end", "wrong_outlook_dead_end", "dead_end")
    assert [first[k] for k in keys] == [1, 1, 0, 0, 0]
    assert [later[k] for k in keys] == [1, 0, 0, 1, 1]
    assert out["rates"]["later"]["dead_end_if_outlook_wrong"] == 1.0 and out["rates"]["later"]["outlook_right"] == 0.0
    table = format_breakdown(out)
    assert "| first | 100.0 % | 0.0 % | - | 0.0 % |" in table and "| later | 0.0 % | - | 100.0 % | 0.0 % |" in table
    # a move against the agent's own words: it calls Down a hole (wrongly: (1, 0) is ice) and goes Down
    # anyway; then it calls Right the edge and goes Right into the hole; a cell it called ice is no
    # such move, nor is one it did not name
    against = dict(rec, turns=[turn("Left edge, Down hole, Right ice, Up edge.", "Down"),
                               turn("Left ice, Right edge.", "Right")])
    safe = dict(rec, turns=[turn("Left edge, Right ice, Up edge.", "Down"), turn("Left edge, Down ice.", "Right")])
    out = failure_breakdown([against, safe])
    assert out["counts"]["first"]["against_own_outlook"] == 1 and out["counts"]["later"]["against_own_outlook"] == 1
    assert out["rates"]["first"]["against_own_outlook"] == 0.5


def test_other_envs_are_skipped() -> None:
    rec = {"env_id": "worldloop/Navigation-v0", "env_kwargs": {}, "seed": 0, "success": False,
           "turns": [{"response": "x"}]}
    out = failure_breakdown([rec])
    assert out["episodes"] == 0 and out["skipped"] == 1 and out["success_rate"] is None
