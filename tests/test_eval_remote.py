"""``worldloop eval`` against a real OpenAI-compatible HTTP server on loopback (worldloop/testing/fake_openai.py).

The server's responder is an expert: it finds the episode from the first image (or text) of the
conversation, replays the assistant messages of the request in its own copy of the env and answers
``env.unwrapped.expert_response()``. So the eval's success per seed must equal that of playing the
expert directly, which also proves the images arrive as data URLs of the env's own frames and the
history is sent back turn after turn.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import gymnasium
import numpy as np
import pytest
from PIL import Image

from worldloop import envs  # noqa: F401
from worldloop.cli import main
from worldloop.common.metrics import free_port
from worldloop.envs.presets import resolve
from worldloop.testing.fake_openai import FakeOpenAI, Reply, images_of

ROOT = Path(__file__).resolve().parent.parent
SEED0 = 10_000_000  # eval.seed_start default


def _pixels(image: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(image, dtype=np.uint8).tobytes()).hexdigest()


class Expert:
    """Responder: replays the conversation in its own env and answers the expert response."""

    def __init__(self, names: list[str], seeds: range, **overrides):
        self.index: dict[str, tuple[str, dict, int]] = {}
        for name in names:
            env_id, kwargs = resolve(name)
            kwargs.update(overrides)
            env = gymnasium.make(env_id, **kwargs)
            for s in seeds:
                obs, _ = env.reset(seed=s)
                key = _pixels(obs["image"]) if obs["image"] is not None else obs["text"]
                self.index[key] = (env_id, kwargs, s)

    def episode_of(self, request: dict) -> tuple[str, dict, int]:
        imgs = images_of(request)
        if imgs:
            return self.index[_pixels(np.asarray(Image.open(io.BytesIO(imgs[0])).convert("RGB")))]
        return self.index[next(m["content"] for m in request["messages"] if m["role"] == "user")]

    def __call__(self, request: dict) -> str:
        env_id, kwargs, seed = self.episode_of(request)
        env = gymnasium.make(env_id, **kwargs)
        env.reset(seed=seed)
        for m in request["messages"]:
            if m["role"] == "assistant":
                env.step(m["content"])
        return env.unwrapped.expert_response()


def expert_outcome(name: str, seed: int, max_turns: int, **overrides) -> tuple[bool, int]:
    """(success, turns) of the expert playing ``name`` on ``seed`` directly."""
    env_id, kwargs = resolve(name)
    env = gymnasium.make(env_id, **dict(kwargs, **overrides))
    env.reset(seed=seed)
    for t in range(max_turns):
        _, _, term, trunc, info = env.step(env.unwrapped.expert_response())
        if term or trunc:
            return bool(info["success"]), t + 1
    return bool(info["success"]), max_turns


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines() if line.strip()]


def test_expert_endpoint_multi_turn_table_and_resume(tmp_path: Path, capsys) -> None:
    out = tmp_path / "ev"
    expert = Expert(["sokoban", "frozenlake"], range(SEED0, SEED0 + 5))
    with FakeOpenAI(expert, delay_s=0.05) as srv:
        args = ["eval", "--model", "vlm-x", "--base-url", srv.base_url, "--envs", "sokoban,frozenlake",
                "--episodes", "4", "--concurrency", "3", "--output", str(out)]
        assert main(args) == 0
        printed = capsys.readouterr().out
        reqs = srv.chat_requests()
        assert srv.max_concurrent <= 3
        recs = _records(out)
        assert len(recs) == 8
        for r in recs:
            ok, turns = expert_outcome(r["env"], r["seed"], 3)
            assert (r["success"], r["num_turns"]) == (ok, turns), r["env"]
            assert r["error"] is None and r["model"] == "vlm-x" and r["settings"]["max_turns"] == 3
            assert r["turns"][0]["prompt"].count("<image>") == 1 and r["turns"][0]["images"] == 1
            assert r["turns"][0]["response"] and r["turns"][0]["actions"] and r["turns"][0]["format_ok"]
        assert sorted(r["seed"] for r in recs if r["env"] == "sokoban") == list(range(SEED0, SEED0 + 4))
        assert len(reqs) == sum(r["num_turns"] for r in recs)
        assert sum(r["success"] for r in recs) >= 6  # the expert solves nearly all of them in 3 turns

        # the wire format: system prompt, the image as a PNG data URL equal to the env's frame, history
        first = reqs[0]["json"]
        assert first["model"] == "vlm-x" and first["max_tokens"] == 400 and first["temperature"] == 0.7
        env_id, kwargs, seed = expert.episode_of(first)
        env = gymnasium.make(env_id, **kwargs)
        obs, _ = env.reset(seed=seed)
        # the system message is exactly the played env's own system prompt
        assert first["messages"][0] == {"role": "system", "content": env.unwrapped.system_prompt()}
        parts = first["messages"][1]["content"]
        url = next(p["image_url"]["url"] for p in parts if p["type"] == "image_url")
        assert url.startswith("data:image/png;base64,")
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(images_of(first)[0])).convert("RGB")), obs["image"])
        later = [q["json"] for q in reqs if len(q["json"]["messages"]) > 2]
        assert later and all([m["role"] for m in q["messages"]][:4] == ["system", "user", "assistant", "user"] for q in later)

        # the table: printed, results.md / results.csv agree with the records
        rate = {n: sum(r["success"] for r in recs if r["env"] == n) / 4 for n in ("sokoban", "frozenlake")}
        assert "FrozenLake" in printed and "Sokoban" in printed and "Overall" in printed
        rows = {(row.split(",")[1]): row.split(",") for row in (out / "results.csv").read_text().splitlines()[1:]}
        assert float(rows["Sokoban"][4]) == pytest.approx(rate["sokoban"]) and rows["Sokoban"][7] == "4"
        assert float(rows["Overall"][4]) == pytest.approx((rate["sokoban"] + rate["frozenlake"]) / 2)
        assert "| vlm-x |" in (out / "results.md").read_text()

        # resume: nothing is played again, the same table comes out
        n_before = len(srv.chat_requests())
        assert main(args) == 0
        assert len(srv.chat_requests()) == n_before and len(_records(out)) == 8
        assert capsys.readouterr().out.splitlines()[-8:] == printed.splitlines()[-8:]
        # a run killed mid-line leaves a partial record: it is skipped, and the next record starts a new line
        with open(out / "episodes.jsonl", "a") as f:
            f.write('{"key": "cut-off", "mod')
        # one more episode per env: only the new seeds are played
        assert main(args[:-4] + ["--episodes", "5", "--output", str(out)]) == 0
        lines = (out / "episodes.jsonl").read_text().splitlines()
        assert lines[8] == '{"key": "cut-off", "mod' and len(lines) == 11
        new = [json.loads(line) for line in lines[9:]]
        assert sorted((r["env"], r["seed"]) for r in new) == [("frozenlake", SEED0 + 4), ("sokoban", SEED0 + 4)]


def test_single_turn_protocol_gives_the_whole_budget(tmp_path: Path) -> None:
    out = tmp_path / "st"
    max_steps = resolve("sokoban")[1]["max_steps"]
    expert = Expert(["sokoban"], range(SEED0, SEED0 + 3), max_actions_per_step=max_steps, render_mode="vision")
    with FakeOpenAI(expert) as srv:
        assert main(["eval", "--model", "m", "--base-url", srv.base_url, "--envs", "sokoban", "--episodes", "3",
                     "--single-turn", "--output", str(out)]) == 0
        reqs = srv.chat_requests()
    recs = _records(out)
    assert len(reqs) == 3 and all(r["num_turns"] == 1 for r in recs)
    assert all(r["settings"]["single_turn"] and r["settings"]["max_turns"] == 1 for r in recs)
    assert all(r["env_kwargs"]["max_actions_per_step"] == max_steps for r in recs)
    assert f"up to {max_steps} action" in reqs[0]["json"]["messages"][0]["content"]
    # the expert's whole plan fits one answer, so every episode is solved in one turn
    assert all(r["success"] for r in recs)
    assert all(r["success"] == expert_outcome("sokoban", r["seed"], 1, max_actions_per_step=max_steps)[0] for r in recs)


def test_text_mode_sends_plain_strings(tmp_path: Path) -> None:
    out = tmp_path / "txt"
    expert = Expert(["frozenlake"], range(SEED0, SEED0 + 2), render_mode="text", prompt_format="free_think")
    with FakeOpenAI(expert) as srv:
        assert main(["eval", "--model", "m", "--base-url", srv.base_url, "--envs", "frozenlake", "--episodes", "2",
                     "--render-mode", "text", "--prompt-format", "free_think", "--output", str(out)]) == 0
        reqs = srv.chat_requests()
    assert all(isinstance(m["content"], str) for q in reqs for m in q["json"]["messages"])
    assert not any(images_of(q["json"]) for q in reqs)
    recs = _records(out)
    assert all(r["settings"]["prompt_format"] == "free_think" and r["env_kwargs"]["render_mode"] == "text" for r in recs)
    assert all(r["success"] == expert_outcome("frozenlake", r["seed"], 3, render_mode="text",
                                              prompt_format="free_think")[0] for r in recs)


def test_retries_and_the_key_stays_secret(tmp_path: Path) -> None:
    """A real `worldloop eval` process: 429s and a 503 are retried; the key is sent, never printed."""
    out = tmp_path / "sec"
    secret = "sk-test-SECRET-0123456789"
    state = {"n": 0}
    expert = Expert(["frozenlake"], range(SEED0, SEED0 + 2))

    def flaky(request: dict):
        state["n"] += 1
        return Reply(status=503, content="overloaded") if state["n"] == 1 else expert(request)

    with FakeOpenAI(flaky, fail_first=2, fail_status=429, retry_after=0) as srv:
        env = dict(os.environ, PYTHONPATH=str(ROOT), OPENAI_API_KEY=secret)
        proc = subprocess.run([sys.executable, "-m", "worldloop", "eval", "--model", "m", "--base-url", srv.base_url,
                               "--envs", "frozenlake", "--episodes", "2", "--concurrency", "1", "--output", str(out),
                               "eval.backoff_s=0.01", "run.log_level=DEBUG"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        reqs = srv.chat_requests()
    assert proc.returncode == 0, proc.stderr[-2000:]
    recs = _records(out)
    assert len(recs) == 2 and all(r["error"] is None for r in recs)
    # 2 x 429 + 1 x 503 before the first answer: three extra requests, all counted on the first episode
    assert len(reqs) == sum(r["num_turns"] for r in recs) + 3
    assert sorted(r["requests"] - r["num_turns"] for r in recs) == [0, 3]
    auth = [{k.lower(): v for k, v in q["headers"].items()}.get("authorization") for q in reqs]
    assert auth == [f"Bearer {secret}"] * len(reqs)
    for text in (proc.stdout, proc.stderr, *(p.read_text() for p in out.iterdir() if p.is_file())):
        assert secret not in text
    assert "[" in proc.stderr and "2/2 episodes" in proc.stderr  # the progress bar


def test_dead_endpoint_fails_clearly(tmp_path: Path, capsys) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    rc = main(["eval", "--model", "m", "--base-url", url, "--envs", "sokoban", "--episodes", "2",
               "--output", str(tmp_path / "dead"), "eval.timeout_s=5"])
    assert rc == 1
    err = capsys.readouterr().err
    assert f"cannot reach the endpoint at {url}" in err
    assert not (tmp_path / "dead" / "episodes.jsonl").exists()


def test_failing_requests_are_recorded_then_retried_on_resume(tmp_path: Path, capsys) -> None:
    out = tmp_path / "fail"
    args = ["eval", "--model", "m", "--envs", "frozenlake", "--episodes", "3", "--output", str(out),
            "eval.max_retries=1", "eval.backoff_s=0.01"]
    with FakeOpenAI(lambda req: Reply(status=500, content="down")) as srv:
        assert main([*args, "--base-url", srv.base_url]) == 1
        assert len(srv.chat_requests()) == 3 * 2  # one retry each
    recs = _records(out)
    assert len(recs) == 3 and all(r["error"] == "http_500" and not r["success"] for r in recs)
    captured = capsys.readouterr()
    assert "3 episode(s) failed" in captured.out and "3 episode(s) ended with an error" in captured.err
    assert "3 episode(s) failed" in (out / "results.md").read_text()
    # a 400 is not retried: one request per episode
    with FakeOpenAI(lambda req: Reply(status=400, content="bad request")) as srv:
        assert main([*args, "--base-url", srv.base_url]) == 1
        assert len(srv.chat_requests()) == 3
    assert all(r["error"].startswith("http_400") for r in _records(out)[3:])
    # a server slower than eval.timeout_s: each attempt times out, then the episode is recorded as such
    with FakeOpenAI(delay_s=1.0) as srv:
        assert main([*args[:-2], "--base-url", srv.base_url, "--episodes", "1", *args[-2:], "eval.timeout_s=0.2"]) == 1
        assert len(srv.chat_requests()) == 2
    assert _records(out)[-1]["error"] == "timeout"
    capsys.readouterr()
    # the endpoint is back: the failed episodes are played again, the newer lines win
    with FakeOpenAI(Expert(["frozenlake"], range(SEED0, SEED0 + 3))) as srv:
        assert main([*args, "--base-url", srv.base_url]) == 0
    printed = capsys.readouterr().out
    assert "failed" not in printed
    done = _records(out)[7:]
    assert len(done) == 3 and all(r["error"] is None for r in done)


def test_bad_input_exits_2_naming_the_problem(tmp_path: Path, capsys) -> None:
    assert main(["eval", "--model", "m", "--base-url", "http://127.0.0.1:9/v1", "--envs", "sokoban,nosuchenv",
                 "--output", str(tmp_path / "a")]) == 2
    assert "nosuchenv" in capsys.readouterr().err
    missing = tmp_path / "no-model-here"
    assert main(["eval", "--model", str(missing), "--envs", "sokoban", "--output", str(tmp_path / "b")]) == 2
    assert str(missing) in capsys.readouterr().err
    assert main(["eval", "--base-url", "http://127.0.0.1:9/v1", "--envs", "sokoban"]) == 2
    assert "--model" in capsys.readouterr().err
    # held-out seeds must not overlap the training range
    assert main(["eval", "--model", "m", "--base-url", "http://127.0.0.1:9/v1", "--envs", "sokoban",
                 "eval.seed_start=0", "actor.seed_start=5", "--episodes", "10"]) == 2
    assert "overlap the training seeds" in capsys.readouterr().err


def test_vagen_suite_gives_the_table_2_layout(tmp_path: Path, capsys) -> None:
    """All of Table 2's tasks and sub-tasks with the real envs, played by the expert endpoint."""
    from worldloop.eval.evaluate import SUITES

    out = tmp_path / "vagen"
    expert = Expert(SUITES["vagen"], range(SEED0, SEED0 + 2))
    with FakeOpenAI(expert) as srv:
        assert main(["eval", "--model", "expert", "--base-url", srv.base_url, "--envs", "vagen", "--episodes", "2",
                     "--output", str(out)]) == 0
    recs = _records(out)
    assert len(recs) == 18
    # max turns per env as in VAGEN Tables 7-15
    assert {r["env"]: r["settings"]["max_turns"] for r in recs} == {
        "frozenlake": 3, "sokoban": 3, "navigation": 4, "navigation-common-sense": 4, "primitive-place": 3,
        "primitive-stack": 3, "primitive-drawer": 3, "primitive-align": 3, "svg": 2}
    rows = [(row["task"], row["subtask"], row["kind"]) for row in csv.DictReader((out / "results.csv").open())]
    assert rows == [("FrozenLake", "", "success"), ("Sokoban", "", "success"),
                    ("Navigation", "base", "success"), ("Navigation", "common_sense", "success"),
                    ("Navigation", "Average", "average"),
                    ("PrimitiveSkill", "place", "success"), ("PrimitiveSkill", "stack", "success"),
                    ("PrimitiveSkill", "drawer", "success"), ("PrimitiveSkill", "align", "success"),
                    ("PrimitiveSkill", "Average", "average"),
                    ("SVG", "pixel_similarity", "similarity"), ("Overall", "", "overall")]
    svg = [r for r in recs if r["env"] == "svg"]
    assert all(0.0 <= r["metrics"]["pixel_similarity"] <= 1.0 for r in svg)
    assert "not DreamSim or DINO" in capsys.readouterr().out
