"""``worldloop show``: the episode page of a real eval output (the tiny model playing real envs) and of
real sampled trajectories, checked in a real headless browser (Debian's chromium): every image
decodes, nothing overflows a laptop-wide window, no error text; plus a screenshot that is not blank.

chromium is installed by ``.ci/run`` (apt). Without it these tests skip, except on CI
(``tests/ci.py``), where a missing browser is a failure.
"""

from __future__ import annotations

import base64
import html
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import gymnasium
import msgspec
import numpy as np
import pytest
from PIL import Image

from worldloop import envs  # noqa: F401  (registers the ids)
from worldloop.cli import main
from worldloop.common.contracts.schemas import TRAJECTORY_SCHEMA, State, Trajectory, Turn
from worldloop.envs.parsing import parse_response
from worldloop.judge.rule import rule_score
from ci import require_tool

ROOT = Path(__file__).resolve().parent.parent
ERROR_WORDS = ("Traceback", "could not re-play", "re-play differs", "re-play ended", "episode error",
               "unreadable line", "undefined", "NaN", "None")


def _chromium() -> str:
    return require_tool("chromium", "chromium-browser", install="apt-get install chromium; .ci/run does")


def _browser(exe: str, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           "--disable-extensions", "--hide-scrollbars", "--virtual-time-budget=10000", *args],
                          capture_output=True, text=True, timeout=timeout)


# a probe appended to a copy of the page: for every <img>, did it decode; does anything overflow the
# window horizontally; then the verdict goes into the DOM that --dump-dom prints
PROBE = """<script>
addEventListener('load', () => {
  const imgs = [...document.images];
  const broken = imgs.filter(i => !(i.complete && i.naturalWidth > 0 && i.naturalHeight > 0)).length;
  const d = document.documentElement;
  const out = document.createElement('pre'); out.id = 'probe';
  out.textContent = JSON.stringify({images: imgs.length, broken, scrollWidth: d.scrollWidth,
    innerWidth: window.innerWidth, widths: imgs.map(i => i.naturalWidth)});
  document.body.appendChild(out);
});
</script>"""


def probe(exe: str, page: Path, width: int, tmp: Path) -> dict:
    text = page.read_text(encoding="utf-8")
    # the page's own policy forbids scripts; the probe copy allows only this inline one
    text = text.replace("default-src 'none';", "default-src 'none'; script-src 'unsafe-inline';", 1)
    copy = tmp / f"probe-{width}.html"
    copy.write_text(text.replace("</body>", PROBE + "</body>", 1), encoding="utf-8")
    res = _browser(exe, f"--window-size={width},900", "--dump-dom", copy.as_uri())
    assert res.returncode == 0, res.stderr[-2000:]
    m = re.search(r'<pre id="probe">(.*?)</pre>', res.stdout, re.S)
    assert m, f"the probe did not run: {res.stdout[-500:]} {res.stderr[-1000:]}"
    return json.loads(html.unescape(m.group(1))) | {"dom": res.stdout}


def screenshot(exe: str, page: Path, out: Path) -> np.ndarray:
    res = _browser(exe, f"--screenshot={out}", "--window-size=1366,900", page.as_uri())
    assert res.returncode == 0 and out.is_file(), res.stderr[-2000:]
    return np.asarray(Image.open(out).convert("RGB"))


def visible_text(dom: str) -> str:
    body = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S)
    body = re.sub(r'<pre id="probe">.*?</pre>', " ", body, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", " ", body))


def check_in_browser(exe: str, page: Path, tmp: Path, n_images: int) -> np.ndarray:
    for width in (1366, 1024):  # a laptop screen, and a narrow window
        p = probe(exe, page, width, tmp)
        assert p["images"] == n_images and p["broken"] == 0, p | {"dom": ""}
        assert p["scrollWidth"] <= p["innerWidth"], f"horizontal scrolling at {width}px: {p['scrollWidth']}"
        text = visible_text(p["dom"])
        for word in ERROR_WORDS:
            assert word not in text, f"{word!r} on the page"
    shot = screenshot(exe, page, tmp / "shot.png")
    assert shot.shape == (900, 1366, 3)
    # not blank: several colours, and the grid envs' image (a coloured tile board) is in the first screen
    assert shot.std() > 20 and len(np.unique(shot.reshape(-1, 3), axis=0)) > 200
    return shot


def static_checks(page: str) -> list[str]:
    """The page is self-contained: no script, no external reference; returns the <img> sources."""
    assert "<script" not in page and "<link" not in page and "@import" not in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//|file:)""", page)
    assert "url(" not in page
    srcs = re.findall(r'<img src="([^"]+)"', page)
    assert all(s.startswith("data:image/png;base64,") for s in srcs)
    for s in srcs:  # every inlined image is a real PNG
        Image.open(io.BytesIO(base64.b64decode(s.split(",", 1)[1]))).verify()
    return srcs


# --------------------------------------------------------------------------- (a) an eval output


@pytest.fixture(scope="module")
def eval_out(tmp_path_factory, shared_tiny_model) -> Path:
    model = shared_tiny_model(max_image_side=112)
    out = tmp_path_factory.mktemp("ev") / "out"
    assert main(["eval", "--model", str(model), "--envs", "sokoban,frozenlake", "--episodes", "1", "--max-tokens", "8",
                 "--output", str(out), "model.max_image_side=112"]) == 0
    return out


def test_show_eval_output_in_a_real_browser(eval_out: Path, tmp_path: Path) -> None:
    exe = _chromium()
    page_path = tmp_path / "page.html"
    res = subprocess.run([sys.executable, "-m", "worldloop", "show", str(eval_out), "--out", str(page_path)],
                         cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == str(page_path)
    page = page_path.read_text(encoding="utf-8")
    records = [json.loads(x) for x in (eval_out / "episodes.jsonl").read_text().splitlines() if x.strip()]
    n_turns = sum(len(r["turns"]) for r in records)
    assert n_turns >= 1
    srcs = static_checks(page)
    assert len(srcs) == sum(t["images"] for r in records for t in r["turns"]) == n_turns  # one image per turn
    # the re-played image before turn 0 is the env's first observation, pixel for pixel
    first = records[0]
    env = gymnasium.make(first["env_id"], **first["env_kwargs"])
    obs, info = env.reset(seed=first["seed"])
    shown = np.asarray(Image.open(io.BytesIO(base64.b64decode(srcs[0].split(",", 1)[1]))).convert("RGB"))
    assert np.array_equal(shown, obs["image"])
    # per episode: env, seed, success, total reward; per turn: the true state before it, the rewards
    for r in records:
        assert f'>{html.escape(r["env"])}' in page and f"seed {r['seed']}" in page
        assert f"total reward <b>{r['total_reward']:.4g}</b>" in page
    assert html.escape(env.unwrapped.describe_state(info["state"])) in page
    assert page.count("True state before the turn") == page.count("True state after the turn") == n_turns
    assert page.count("Agent&#x27;s &lt;observation&gt;") == n_turns
    assert page.count(">Rewards<") == n_turns and page.count(">Actions<") == n_turns
    check_in_browser(exe, page_path, tmp_path, n_turns)


def test_a_record_that_does_not_replay_is_flagged(eval_out: Path, tmp_path: Path) -> None:
    lines = [json.loads(x) for x in (eval_out / "episodes.jsonl").read_text().splitlines() if x.strip()]
    lines[0]["turns"][0]["reward"] = 123.0  # not what the env gives for that response
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(json.dumps(x) for x in lines) + "\n{not json\n")
    assert main(["show", str(bad)]) == 0
    page = (tmp_path / "bad.html").read_text()
    assert "re-play differs from the record at this turn" in page
    assert "1 unreadable line(s) skipped" in page


def test_show_needs_no_config_and_fails_clearly_without_input(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-m", "worldloop", "show", str(tmp_path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "no episodes.jsonl in the folder" in res.stderr
    res = subprocess.run([sys.executable, "-m", "worldloop", "show", str(tmp_path / "x.jsonl")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "no such file" in res.stderr


# --------------------------------------------------------------------------- (b) sampled trajectories


def _png(image: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return buf.getvalue()


def _state(d: dict) -> State:
    return State(relations=list(d["relations"]), symbolic=d["symbolic"], structured=dict(d["structured"]))


def sampled_trajectory(env_name: str, env_id: str, seed: int, turns: int = 2) -> Trajectory:
    """A worldloop.trajectory/1 of the env's expert, scored by the real rule judge, as the learner
    would sample it from the scored stream."""
    env = gymnasium.make(env_id)
    obs, info = env.reset(seed=seed)
    out = []
    for i in range(turns):
        response = env.unwrapped.expert_response()
        before, image = info["state"], obs["image"]
        obs, reward, term, trunc, info = env.step(response)
        p = parse_response(response, "grounding_worldmodeling")
        g, w = rule_score(p.observation, before, env_name), rule_score(p.prediction, info["state"], env_name)
        out.append(Turn(index=i, policy_version=3, obs_ids=[1, 2], response_ids=[5, 6], logprobs=[-0.1, -0.2],
                        images=[_png(image)], response_text=response, observation=p.observation,
                        reasoning=p.reasoning, prediction=p.prediction, actions=info["actions"],
                        format_ok=info["format_ok"], env_reward=info["env_reward"],
                        format_reward=info["format_reward"], done=bool(term or trunc), success=info["success"],
                        state_before=_state(before), state_after=_state(info["state"]),
                        actions_total=info["actions_executed"], actions_effective=info["actions_effective"],
                        grounding_score=g.score, worldmodeling_score=w.score, reasoning_reward=0.5 * (g.score + w.score),
                        judge={"grounding": g.to_dict(), "worldmodeling": w.to_dict(), "scorer": "rule"}))
        if term or trunc:
            break
    return Trajectory(schema=TRAJECTORY_SCHEMA, trajectory_id=f"{env_name}-{seed}", group_id="g", env_id=env_id,
                      env_name=env_name, env_kwargs={}, seed=seed, actor_id="actor-0", created_at=1.0,
                      prompt_format="grounding_worldmodeling", max_turns=turns, turns=out,
                      success=out[-1].success, scored=True)


def test_show_sampled_trajectories_in_a_real_browser(tmp_path: Path) -> None:
    exe = _chromium()
    trajs = [sampled_trajectory("sokoban", "worldloop/Sokoban-v0", 3),
             sampled_trajectory("navigation", "worldloop/Navigation-v0", 4)]
    samples = tmp_path / "samples.jsonl"
    samples.write_bytes(b"\n".join(msgspec.json.encode(t) for t in trajs) + b"\n")
    assert main(["show", str(samples)]) == 0
    page_path = tmp_path / "samples.html"
    page = page_path.read_text(encoding="utf-8")
    srcs = static_checks(page)
    n_turns = sum(len(t.turns) for t in trajs)
    assert len(srcs) == n_turns  # the recorded PNGs, inlined as they were
    assert base64.b64decode(srcs[0].split(",", 1)[1]) == trajs[0].turns[0].images[0]
    for t in trajs:
        assert f"seed {t.seed}" in page and "policy v3" in page
        for turn in t.turns:
            # the agent's text beside the truth, the judge's scores and details, actions and rewards
            assert html.escape(turn.observation) in page and html.escape(turn.prediction) in page
            assert html.escape(". ".join(turn.state_before.relations) + ".") in page
            assert f"grounding <b>{turn.grounding_score:.3g}</b>" in page
            assert f"world model <b>{turn.worldmodeling_score:.3g}</b>" in page
            assert all(f'<span class="chip action">{html.escape(a)}</span>' in page for a in turn.actions)
            total = turn.env_reward + turn.format_reward + turn.reasoning_reward
            assert f"total <b>{total:+.3g}</b>" in page
        assert f"total reward <b>{sum(x.env_reward + x.format_reward + x.reasoning_reward for x in t.turns):.4g}</b>" in page
    assert page.count('"method"') == 0 and page.count(">scorer<") == n_turns  # judge details, escaped
    assert trajs[0].turns[0].grounding_score == 1.0  # the expert describes the truth
    check_in_browser(exe, page_path, tmp_path, n_turns)
