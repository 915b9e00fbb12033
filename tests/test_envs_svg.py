"""SVG env: validation of hostile SVG, bounded rendering, similarity by hand, rewards, dataset loader."""

from __future__ import annotations

import json

import gymnasium
import msgpack
import numpy as np
import pytest

from worldloop import envs  # noqa: F401  (registers the ids)
from worldloop.envs.svg.icons import generate_icon, load_svg_dataset
from worldloop.envs.svg.metrics import make_metric, pixel_similarity
from worldloop.envs.svg.describe import color_name, describe_svg, element_sentence
from worldloop.envs.svg.render import (DEFAULT_TIMEOUT_S, SVGRejected, SVGRenderError, WORKER_SCRIPT, _Worker, extract_svg,
                                       render_svg, validate_svg)

NS = 'xmlns="http://www.w3.org/2000/svg"'
CIRCLE = f'<svg viewBox="0 0 100 100" {NS}><circle cx="25" cy="25" r="15" fill="red" /></svg>'
RESP = "<think><observation>o</observation><reasoning>r</reasoning><prediction>p</prediction></think><answer>{}</answer>"


def make_env(**kw):
    return gymnasium.make("worldloop/SVG-v0", **kw).unwrapped


# ----------------------------------------------------------------------------- validation


HOSTILE = {
    "entity": f'<!DOCTYPE svg [<!ENTITY a "aaaaaaaa"><!ENTITY b "&a;&a;&a;&a;">]><svg {NS}><text>&b;</text></svg>',
    "doctype-in-svg": f'<svg {NS}><!DOCTYPE x></svg>',
    "pi": f'<svg {NS}><?xml-stylesheet href="http://evil/x.css"?></svg>',
    "external-image": f'<svg {NS} xmlns:xlink="http://www.w3.org/1999/xlink"><image xlink:href="file:///etc/passwd" /></svg>',
    "external-use": f'<svg {NS}><use href="http://evil/a.svg#x" /></svg>',
    "external-url": f'<svg {NS}><rect width="10" height="10" fill="url(http://evil/p)" /></svg>',
    "data-url": f'<svg {NS}><rect width="10" height="10" style="fill:url(data:image/png;base64,AAAA)" /></svg>',
    "css-import": f'<svg {NS}><style>@import url(file:///etc/passwd);</style></svg>',
    "script": f'<svg {NS}><script>alert(1)</script></svg>',
    "event": f'<svg {NS} onload="alert(1)"></svg>',
    "foreign": f'<svg {NS}><foreignObject><div>x</div></foreignObject></svg>',
    "huge-size": f'<svg {NS} width="50000" height="50000"><rect width="1" height="1" /></svg>',
    "huge-viewbox": f'<svg {NS} viewBox="0 0 1e12 1e12"></svg>',
    "bad-viewbox": f'<svg {NS} viewBox="0 0 0 10"></svg>',
    "huge-number": f'<svg {NS}><circle cx="5" cy="5" r="1e300" /></svg>',
    "deep": f'<svg {NS}>' + "<g>" * 40 + "</g>" * 40 + "</svg>",
    "many-elements": f'<svg {NS}>' + "<g/>" * 2100 + "</svg>",
    "use-bomb": (f'<svg {NS}><g id="a"><circle r="1"/></g><g id="b"><use href="#a"/><use href="#a"/></g>'
                 '<use href="#b"/></svg>'),
    "use-missing": f'<svg {NS}><use href="#nope"/></svg>',
    "fine-dashes": f'<svg {NS}><path d="M0 0 L1000 0" stroke="black" stroke-dasharray="0.001 0.001"/></svg>',
    "not-svg-root": f'<html {NS}></html>',
    "malformed": "<svg><rect></svg>",
    "too-long": f'<svg {NS}>' + " " * 70000 + "</svg>",
}


# the reason each one is refused for (a document refused for another reason would hide a hole)
HOSTILE_REASON = {
    "entity": "DTD/entity declarations", "doctype-in-svg": "DTD/entity declarations",
    "pi": "processing instructions are not allowed", "external-image": "<image> elements are not allowed",
    "external-use": r"only local references \(href=\"#id\"\)", "external-url": r"only local url\(#id\) references",
    "data-url": r"only local url\(#id\) references", "css-import": r"@import, javascript: and expression\(\)",
    "script": "<script> elements are not allowed", "event": "event attribute 'onload' is not allowed",
    "foreign": "<foreignobject> elements are not allowed", "huge-size": r"width='50000' is too large \(<= 10000\)",
    "huge-viewbox": "number 1e12 in 'viewbox' is out of range", "bad-viewbox": "invalid viewBox '0 0 0 10'",
    "huge-number": "number 1e300 in 'r' is out of range", "deep": "elements nested deeper than 24",
    "many-elements": "more than 2000 elements", "use-bomb": "<use> may not refer to an element that is or contains",
    "use-missing": "<use> refers to a missing element #nope", "fine-dashes": "dash pattern finer than 0.01",
    "not-svg-root": "root element is <html>, not <svg>", "malformed": "not well-formed XML",
    "too-long": "SVG code has 70046 characters, more than 65536",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_svg_is_rejected(name):
    with pytest.raises(SVGRejected, match=HOSTILE_REASON[name]):
        validate_svg(HOSTILE[name])


def test_generated_icons_validate_and_render_deterministically():
    a = [generate_icon(np.random.default_rng(s)) for s in range(6)]
    b = [generate_icon(np.random.default_rng(s)) for s in range(6)]
    assert a == b and len(set(a)) == 6
    for code in a:
        validate_svg(code)
    img = render_svg(a[0], 64)
    assert img.shape == (64, 64, 3) and img.dtype == np.uint8
    assert np.array_equal(img, render_svg(a[0], 64))


def test_extract_svg_is_linear_on_pathological_text():
    assert extract_svg("<svg" * 250_000) is None  # 1 MB of openings without a close
    assert extract_svg("text <svg a='1'>x</svg> more") == "<svg a='1'>x</svg>"
    assert extract_svg(None) is None


def test_render_time_bound_kills_a_slow_render_and_recovers():
    # passes validation (dashes of 0.01 along 200 segments 1e6 long, 3 KB) but takes many seconds
    d = "M0 50 " + " ".join(f"L{1000000 if i % 2 == 0 else 0} {50 + i * 0.01:.2f}" for i in range(200))
    slow = f'<svg {NS} viewBox="0 0 100 100"><path d="{d}" stroke="black" stroke-dasharray="0.01 0.01"/></svg>'
    validate_svg(slow)
    with pytest.raises(SVGRenderError, match="longer than"):
        render_svg(slow, 32, timeout_s=0.5)
    img = render_svg(CIRCLE, 100)  # a fresh worker takes over
    assert tuple(img[25, 25]) == (255, 0, 0) and tuple(img[80, 80]) == (255, 255, 255)


def test_a_fresh_workers_start_up_is_not_counted_against_the_render(tmp_path):
    # a worker whose start-up (imports, on a loaded machine) takes longer than a render's whole limit
    # still renders within it: the limit counts from the worker's greeting (a loaded CI machine once
    # timed out the first render after a kill)
    slow_start = tmp_path / "slow_worker.py"
    slow_start.write_text(f"import runpy, time\ntime.sleep({DEFAULT_TIMEOUT_S + 1})\n"
                          f"runpy.run_path({str(WORKER_SCRIPT)!r}, run_name='__main__')\n")
    worker = _Worker(slow_start)
    try:
        img = worker.render(CIRCLE.encode(), 100, DEFAULT_TIMEOUT_S)
    finally:
        worker.stop()
    assert tuple(img[25, 25]) == (255, 0, 0) and tuple(img[80, 80]) == (255, 255, 255)


# ----------------------------------------------------------------------------- similarity


def test_pixel_similarity_by_hand():
    white = np.full((64, 64, 3), 255, np.uint8)
    black_sq = white.copy()
    black_sq[16:32, 16:32] = 0
    gray_sq = white.copy()
    gray_sq[16:32, 16:32] = 128
    assert pixel_similarity(black_sq, black_sq)["similarity"] == pytest.approx(1.0)
    assert pixel_similarity(white, black_sq)["similarity"] == 0.0  # blank answer: no correlation
    inverted = (255 - black_sq).astype(np.uint8)
    assert pixel_similarity(inverted, black_sq)["pixel_ncc"] == 0.0  # anti-correlated, clipped
    # same shape, lighter shade: correlation 1 at every scale; MAE at 32 px = (1/16 of pixels) x 128/255
    s = pixel_similarity(gray_sq, black_sq)
    assert s["pixel_ncc"] == pytest.approx(1.0)
    assert s["pixel_mae"] == pytest.approx(128 / 255 / 16)
    assert s["similarity"] == pytest.approx(1.0 - 128 / 255 / 16)
    # a flat target is scored by 1 - MAE alone: all-gray 128 vs all-white
    flat = np.full((64, 64, 3), 128, np.uint8)
    assert pixel_similarity(white, flat)["similarity"] == pytest.approx(1.0 - 127 / 255)


def test_learned_metrics_need_local_weights():
    with pytest.raises(RuntimeError, match="dino_model"):
        make_metric("dino")
    with pytest.raises(RuntimeError, match="dreamsim"):
        make_metric("dreamsim")
    assert make_metric("auto")[0] == "pixel"
    with pytest.raises(ValueError, match="metric"):
        make_metric("clip")


# ----------------------------------------------------------------------------- descriptions


def test_describe_svg_boxes_and_sentences():
    code = (f'<svg viewBox="0 0 100 100" {NS}><g transform="translate(10,5)">'
            '<rect x="50" y="60" width="30" height="20" style="fill:#1e88e5" /></g>'
            '<circle cx="25" cy="25" r="15" fill="red" /><path d="M10 10 l20 0 l0 20 z" fill="none" stroke="green"/>'
            '<defs><circle id="hidden" r="99"/></defs></svg>')
    d = describe_svg(validate_svg(code))
    rect, circle, path = d["elements"]
    assert d["viewbox"] == [0, 0, 100, 100] and len(d["elements"]) == 3
    assert rect["bbox"] == [60.0, 65.0, 90.0, 85.0] and rect["fill"] == "blue"
    assert circle == {"shape": "circle", "cx": 25.0, "cy": 25.0, "r": 15.0, "fill": "red", "stroke": None,
                      "bbox": [10.0, 10.0, 40.0, 40.0]}
    assert path["bbox"] == [10.0, 10.0, 30.0, 30.0] and path["fill"] is None and path["stroke"] == "green"
    assert element_sentence(circle, d["viewbox"]) == "a red circle centered at (25, 25) with radius 15, at the top-left"
    assert element_sentence(rect, d["viewbox"]) == "a blue rectangle spanning (60, 65) to (90, 85), at the bottom-right"
    assert [color_name(c) for c in ("#fff59d", "#212121", "#795548", "none", "bogus")] == \
        ["light yellow", "black", "brown", None, None]


# ----------------------------------------------------------------------------- env


def test_rewards_follow_table_20():
    env = make_env(image_size=64)
    _, info = env.reset(seed=0, options={"svg": CIRCLE})
    assert info["metrics"] == {} and info["task"] == "icon"
    assert info["state"]["relations"] == ["the target image has a red circle centered at (25, 25) with radius 15, "
                                          "at the top-left"]
    # a partial answer: reward = 0.5 + 5 x similarity of its rendering (computed independently)
    half = f'<svg viewBox="0 0 100 100" {NS}><circle cx="30" cy="25" r="15" fill="red" /></svg>'
    expected = pixel_similarity(render_svg(half, 64), render_svg(CIRCLE, 64))["similarity"]
    assert 0.2 < expected < 0.95
    _, reward, term, _, info = env.step(RESP.format(half))
    assert info["format_ok"] and info["metrics"]["similarity"] == pytest.approx(expected)
    assert info["env_reward"] == pytest.approx(5.0 * expected) and reward == pytest.approx(0.5 + 5.0 * expected)
    assert not term and not info["success"]
    assert info["state"]["relations"][0] == f"the generated image has similarity {round(expected, 3):.2f} to the target"
    # an empty SVG is well formed: format reward only
    _, reward, _, _, info = env.step(RESP.format(f'<svg viewBox="0 0 100 100" {NS}></svg>'))
    assert reward == pytest.approx(0.5) and info["metrics"]["similarity"] == 0.0
    # the exact code: similarity 1, success ends the episode; no success bonus (Table 20)
    _, reward, term, _, info = env.step(env.expert_response())
    assert reward == pytest.approx(5.5) and term and info["success"]


def test_rejected_svg_is_a_format_failure_with_a_blank_canvas():
    env = make_env(image_size=32)
    env.reset(seed=1)
    _, _, term, _, info = env.step(RESP.format(CIRCLE))  # a valid answer that does not end the episode
    assert info["format_ok"] and not term
    for text in (RESP.format(HOSTILE["entity"]), RESP.format(HOSTILE["external-image"]),
                 RESP.format("no svg here"), RESP.format("<svg><rect></svg>"),
                 RESP.format(f'<svg {NS}>' + "<g/>" * 3000 + "</svg>"), "<" * 1_000_000, None):
        obs, reward, term, _, info = env.step(text)
        assert not info["format_ok"] and reward == 0.0 and not term
        assert info["metrics"]["similarity"] == 0.0
        assert np.all(obs["image"] == 255)
    assert "invalid SVG" in env.step(RESP.format(HOSTILE["script"]))[4]["reason"]


def test_seed_determinism_and_state():
    a, b = make_env(image_size=48), make_env(image_size=48)
    oa, ia = a.reset(seed=7)
    ob, ib = b.reset(seed=7)
    assert a.target_code == b.target_code and np.array_equal(oa["image"], ob["image"]) and ia == ib
    assert oa["text"].count("<image>") == 1
    a.reset(seed=8)
    assert a.target_code != b.target_code
    _, _, _, _, info = b.step(b.expert_response())
    assert msgpack.unpackb(msgpack.packb(info["state"])) == info["state"]
    assert info["state"]["structured"]["similarity"] == 1.0
    assert "your SVG code (" in b._observation(False)["text"]  # the code is not echoed back


def test_expert_response_formats():
    env = make_env(image_size=32, state_format="structured")
    env.reset(seed=3)
    resp = env.expert_response()
    obs = json.loads(resp.split("<observation>")[1].split("</observation>")[0])
    assert obs["target_elements"] == env.target_desc["elements"]
    pred = json.loads(resp.split("<prediction>")[1].split("</prediction>")[0])
    assert pred["similarity"] == 1.0
    assert resp.split("<answer>")[1].split("</answer>")[0] == env.target_code
    text_env = make_env(render_mode="text", prompt_format="no_think")
    obs, _ = text_env.reset(seed=3)
    assert obs["image"] is None and "The target image contains" in obs["text"]
    with pytest.raises(ValueError, match="max_actions_per_step"):
        make_env(max_actions_per_step=2)


def test_local_dataset_loader(tmp_path):
    (tmp_path / "a.svg").write_text(CIRCLE)
    (tmp_path / "evil.svg").write_text(HOSTILE["entity"])
    rows = [{"Filename": "sq", "Svg": f'<svg viewBox="0 0 10 10" {NS}><rect width="5" height="5"/></svg>'},
            {"Filename": "bad", "Svg": HOSTILE["script"]}, {"other": 1}]
    (tmp_path / "icons.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    ds = load_svg_dataset(tmp_path)
    assert [n for n, _ in ds.items] == ["a", "sq"] and ds.skipped == 2
    env = make_env(source="dataset", dataset_dir=str(tmp_path), image_size=32)
    names = {env.reset(seed=s)[1]["task"] and env.target_name for s in range(8)}
    assert names == {"a", "sq"} and env.task == "dataset"
    with pytest.raises(ValueError, match="dataset_dir"):
        make_env(source="dataset")
    with pytest.raises(FileNotFoundError, match="SVG dataset path .*missing' does not exist"):
        load_svg_dataset(tmp_path / "missing")


@pytest.mark.parametrize("fmt", ["no_think", "free_think", "grounding", "worldmodeling"])
def test_expert_response_in_every_prompt_format(fmt):
    env = make_env(prompt_format=fmt, image_size=32)
    env.reset(seed=5)
    _, reward, term, _, info = env.step(env.expert_response())
    assert info["format_ok"] and reward == pytest.approx(5.5) and term
