"""``worldloop eval`` of a local model: the tiny Qwen2.5-VL (made here) plays two real envs through the
actors' rollout engine with the HF backend; the table, the transcript and resume are checked."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import gymnasium
import pytest

from worldloop import envs  # noqa: F401
from worldloop.cli import main
from worldloop.envs.presets import resolve
from worldloop.eval.stats import wilson_interval

SEED0 = 10_000_000


@pytest.fixture(scope="module")
def model_dir(shared_tiny_model) -> Path:
    return shared_tiny_model(max_image_side=112)


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines() if line.strip()]


def test_local_model_table_transcript_and_resume(model_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "ev"
    args = ["eval", "--model", str(model_dir), "--envs", "sokoban,frozenlake", "--episodes", "2", "--max-tokens", "8",
            "--concurrency", "4", "--output", str(out), "model.max_image_side=112"]
    assert main(args) == 0
    printed = capsys.readouterr()
    recs = _records(out)
    assert len(recs) == 4 and {(r["env"], r["seed"]) for r in recs} == {
        (e, s) for e in ("sokoban", "frozenlake") for s in (SEED0, SEED0 + 1)}
    for r in recs:
        assert r["backend"] == "hf" and r["model"] == str(model_dir.resolve()) and r["error"] is None
        assert r["task"] in ("6x6-1box", "4x4") and r["settings"]["max_tokens"] == 8
        assert r["end_reason"] in ("done", "max_turns", "context", "vision_token")
        assert 0 <= r["num_turns"] <= 3 and r["system_prompt"]
        # the transcript replays: each prompt is what the env said, each reward what it gave for the response
        env_id, kwargs = resolve(r["env"])
        env = gymnasium.make(env_id, **kwargs)
        obs, _ = env.reset(seed=r["seed"])
        for t in r["turns"]:
            assert t["prompt"] == obs["text"] and t["images"] == 1 and isinstance(t["response"], str)
            obs, reward, term, trunc, info = env.step(t["response"])
            assert (t["reward"], t["actions"], t["format_ok"], t["done"]) == (reward, info["actions"], info["format_ok"],
                                                                              term or trunc)
        assert r["success"] == bool(r["turns"] and r["turns"][-1]["success"])
    assert sum(r["num_turns"] for r in recs) >= 2  # the model did play
    # the table: Wilson intervals of the recorded outcomes, in results.csv and printed
    rows = {row["task"]: row for row in csv.DictReader((out / "results.csv").open())}
    for env, fam in (("sokoban", "Sokoban"), ("frozenlake", "FrozenLake")):
        k = sum(r["success"] for r in recs if r["env"] == env)
        low, high = wilson_interval(k, 2)
        assert float(rows[fam]["value"]) == pytest.approx(k / 2) and rows[fam]["n"] == "2"
        assert (float(rows[fam]["ci_low"]), float(rows[fam]["ci_high"])) == (pytest.approx(low, abs=1e-6),
                                                                             pytest.approx(high, abs=1e-6))
        if k == 0:  # 0 of 2 by hand: z^2 = 3.8415; high = 2 * (3.8415/4) / (1 + 3.8415/2) = 0.65753
            assert high == pytest.approx(0.65753, abs=1e-4)
    assert "Sokoban" in printed.out and "Overall" in printed.out and "4/4 episodes" in printed.err
    assert (out / "results.md").read_text().count("|") > 10

    # resume: the same command plays nothing again and writes no new line
    assert main(args) == 0
    assert len(_records(out)) == 4
    assert "4 already recorded" in capsys.readouterr().err
    # a different setting is a different episode: the temperature is part of the key
    assert main(args[:-1] + ["--temperature", "0", "--episodes", "1", "model.max_image_side=112"]) == 0
    new = _records(out)[4:]
    assert len(new) == 2 and all(r["settings"]["temperature"] == 0.0 for r in new)
    assert "2 already recorded" not in capsys.readouterr().err


def test_local_single_turn(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "st"
    assert main(["eval", "--model", str(model_dir), "--envs", "frozenlake", "--episodes", "2", "--max-tokens", "8",
                 "--single-turn", "--output", str(out), "model.max_image_side=112"]) == 0
    recs = _records(out)
    assert all(r["num_turns"] <= 1 and r["settings"]["max_turns"] == 1 for r in recs)
    assert all(r["env_kwargs"]["max_actions_per_step"] == gymnasium.make("worldloop/FrozenLake-v0").unwrapped.max_steps
               for r in recs)
