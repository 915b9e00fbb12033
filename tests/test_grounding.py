"""Grounding pre-training of the embedded tiny model, the frozen vision tower and the RoPE base."""

from __future__ import annotations

import json
from pathlib import Path

import gymnasium
import pytest
import torch
from safetensors.torch import load_file

from worldloop.bootstrap.grounding import answer_loss, grounding_accuracy, grounding_examples, grounding_pretrain
from worldloop.bootstrap.tiny_model import ROPE_THETA
from worldloop.common.contracts.config import ConfigError, load_config
from worldloop.common.contracts.modeling import ChatCodec, freeze_vision_tower, load_policy

FL = {"id": "worldloop/FrozenLake-v0",
      "kwargs": dict(size=4, is_slippery=False, max_actions_per_step=3, min_actions_to_succeed=3, image_size=112,
                     render_mode="vision", prompt_format="grounding_worldmodeling", state_format="natural_language")}
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny(shared_tiny_model) -> Path:
    return shared_tiny_model(seed=0, max_image_side=112)


def test_tiny_model_uses_a_rope_base_that_resolves_board_cells(tiny: Path) -> None:
    """One cell apart must turn the height and width sections of M-RoPE by a visible angle: with the
    base of Qwen2.5-VL (1e6) one column is < 2e-4 rad on a 32-dim head."""
    text = json.loads((tiny / "config.json").read_text())["text_config"]
    rope = text["rope_parameters"]
    assert rope["rope_theta"] == ROPE_THETA
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    t, h, w = rope["mrope_section"]
    freqs = [rope["rope_theta"] ** (-2 * i / head_dim) for i in range(head_dim // 2)]
    # the fastest frequency of the width section (the slowest section) turns > 0.1 rad per column
    assert freqs[t + h] > 0.1
    # and Qwen's own base would not
    assert 1e6 ** (-2 * (t + h) / head_dim) < 1e-3


def test_freeze_vision_tower_freezes_the_tower_and_merger_only(tiny: Path) -> None:
    model = load_policy(tiny, dtype="float32")
    n = freeze_vision_tower(model)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert n == len(frozen) > 0
    assert all(".visual." in f".{name}" for name in frozen)
    assert any("merger" in name for name in frozen)
    assert all(p.requires_grad for name, p in model.named_parameters() if "visual" not in name)
    assert freeze_vision_tower(model) == 0  # idempotent


def test_examples_describe_the_true_state_in_the_answer_prefix(tiny: Path) -> None:
    codec = ChatCodec(tiny, max_image_side=112)
    env = gymnasium.make(FL["id"], **FL["kwargs"])
    try:
        for prompt in ("image", "observation", "agent"):
            ex = grounding_examples([FL], 3, 123, codec, prompt=prompt)
            for k, e in enumerate(ex):
                _, info = env.reset(seed=123 + k)
                want = f"<think><observation>{env.unwrapped.describe_state(info['state'])}</observation>"
                assert codec.decode(e.answer_ids) == want
                first = codec.decode(e.answer_ids[: e.first_len])
                assert first.endswith(info["state"]["relations"][0]) or first.endswith(info["state"]["relations"][0][:-1])
                assert e.prompt_ids.count(codec.image_token_id) == 16 and len(e.images) == 1
            text = codec.decode(ex[0].prompt_ids, skip_special_tokens=False)
            assert ("FrozenLake solver" in text) == (prompt == "agent")
            assert ("Decide your next action" in text) == (prompt != "image")
    finally:
        env.close()


def test_outlook_examples_go_on_into_the_reasoning_the_agent_will_write(tiny: Path) -> None:
    """sft.concise_reasoning outlook: grounding teaches the outlook too (the cells each move runs into,
    read off the image), as the reasoning right after the observation; an env without one is refused."""
    codec = ChatCodec(tiny, max_image_side=112)
    env = gymnasium.make(FL["id"], **FL["kwargs"])
    try:
        ex = grounding_examples([FL], 3, 321, codec, prompt="agent", outlook=True)
        for k, e in enumerate(ex):
            _, info = env.reset(seed=321 + k)
            u = env.unwrapped
            assert codec.decode(e.answer_ids) == (f"<think><observation>{u.describe_state(info['state'])}</observation>"
                                                  f"<reasoning>{u.move_outlook()}</reasoning>")
    finally:
        env.close()
    sokoban = {"id": "worldloop/Sokoban-v0", "kwargs": {"render_mode": "vision", "prompt_format": "grounding_worldmodeling"}}
    with pytest.raises(ValueError, match="has no move_outlook"):
        grounding_examples([sokoban], 1, 5, codec, outlook=True)


@pytest.mark.parametrize("reasoning", ["outlook", "empty"])
def test_the_build_grounds_the_outlook_when_the_demonstrations_reason_with_it(monkeypatch, reasoning) -> None:
    """worldloop.bootstrap.pipeline.ground asks grounding_pretrain for the outlook exactly when the SFT
    demonstrations will write it (the call's keywords are recorded; nothing is trained here)."""
    import worldloop.bootstrap.grounding as grounding
    from worldloop.bootstrap.pipeline import ground

    seen: dict = {}
    report = {"seconds": 0.0, "after_agent": {"first": 0.0, "exact": 0.0}, "before_agent": {"first": 0.0}}
    monkeypatch.setattr(grounding, "grounding_pretrain", lambda *a, **kw: seen.update(kw) or report)
    ground(load_config("configs/tiny-frozenlake.yaml", [f"sft.concise_reasoning={reasoning}"]), "unused")
    assert seen["outlook"] is (reasoning == "outlook")


def test_accuracy_counts_boards_read_right_token_for_token(tiny: Path) -> None:
    """0 for the random init; 1 on examples the model has memorised (teacher-forced argmax)."""
    codec = ChatCodec(tiny, max_image_side=112)
    ex = grounding_examples([FL], 4, 99, codec, prompt="image")
    model = load_policy(tiny, dtype="float32")
    acc = grounding_accuracy(model, ex, codec)
    assert acc["first"] == 0.0 and acc["exact"] == 0.0 and acc["boards"] == 4 and acc["token"] < 0.2
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    # clipped like grounding_pretrain; unclipped 3e-3 oscillates around the last tokens on some CPUs
    for step in range(1, 401):  # up to 400 steps, checked every 50: memorised sooner on most CPUs
        loss = answer_loss(model, ex, codec)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 and grounding_accuracy(model, ex, codec)["exact"] == 1.0:
            break
    acc = grounding_accuracy(model, ex, codec)
    assert acc == {"first": 1.0, "exact": 1.0, "token": 1.0, "boards": 4}, acc


def test_pretraining_trains_the_language_model_keeps_the_tower_and_lowers_the_loss(tmp_path: Path, tiny: Path) -> None:
    import shutil

    d = tmp_path / "m"
    shutil.copytree(tiny, d)
    before = load_file(str(d / "model.safetensors"))
    codec = ChatCodec(d, max_image_side=112)
    probe = grounding_examples([FL], 16, 7_000, codec)
    with torch.no_grad():
        loss0 = float(answer_loss(load_policy(d, dtype="float32"), probe, codec))
    seen = []
    report = grounding_pretrain(d, [FL], 40, seed_start=1_000, max_image_side=112, batch_size=8, lr=3e-3,
                                eval_boards=8, agent_every=4, agent_batch_size=2, prompt="observation",
                                progress=lambda p: seen.append(p["step"]))
    after = load_file(str(d / "model.safetensors"))
    assert seen == list(range(1, 41))
    vision = [k for k in before if "visual" in k]
    assert vision and all(torch.equal(before[k], after[k]) for k in vision)
    assert any(not torch.equal(before[k], after[k]) for k in before if "visual" not in k)
    with torch.no_grad():
        loss1 = float(answer_loss(load_policy(d, dtype="float32"), probe, codec))
    assert loss1 < 0.5 * loss0, (loss0, loss1)
    assert set(report) >= {"before", "after", "before_agent", "after_agent", "seconds", "steps"}
    assert report["after"]["token"] > report["before"]["token"]


def test_grounding_seeds_must_not_overlap_rl_eval_or_demonstrations() -> None:
    preset = ROOT / "configs" / "tiny-frozenlake.yaml"
    ok = load_config(preset, ["model.tiny_grounding_steps=10"])
    assert ok.model.tiny_grounding_steps == 10
    for over, what in ((["model.tiny_grounding_seed_start=0"], "RL seeds"),
                       (["model.tiny_grounding_seed_start=10000000"], "held-out eval seeds"),
                       (["model.tiny_grounding_seed_start=5000000"], "SFT demonstration seeds")):
        with pytest.raises(ConfigError, match=f"overlap the {what}") as e:
            load_config(preset, ["model.tiny_grounding_steps=10", *over])
        assert e.value.key == "model.tiny_grounding_seed_start" and what in str(e.value)
    with pytest.raises(ConfigError, match="must be >= 0 \\(0 = never\\), got -1") as e:
        load_config(preset, ["model.tiny_grounding_agent_every=-1"])
    assert e.value.key == "model.tiny_grounding_agent_every"
