"""worldloop.envs.parsing (response parser, Table 5 formats; action words), worldloop.envs.prompts (prompt
pieces) and worldloop.envs.base's App. D.1 relations."""

from __future__ import annotations

import numpy as np
import pytest

from worldloop.envs.base import IMAGE_PLACEHOLDER, relation_sentence, relative_position, to_plain
from worldloop.envs.parsing import (
    MAX_RESPONSE_CHARS,
    PROMPT_FORMATS,
    ActionVocab,
    normalise_action_word,
    parse_actions,
    parse_response,
)
from worldloop.envs.prompts import build_response, format_prompt, user_message

FULL = {"observation": "box0 is below the player", "reasoning": "push it", "prediction": "box0 on target0",
        "think": "free text"}


@pytest.mark.parametrize("fmt", PROMPT_FORMATS)
def test_each_format_round_trips(fmt: str) -> None:
    text = build_response(fmt, answer="Up, Down", **FULL)
    p = parse_response(text, fmt)
    assert p.format_ok and p.reason == "" and p.answer == "Up, Down"
    assert p.observation == (FULL["observation"] if "grounding" in fmt else None)
    assert p.prediction == (FULL["prediction"] if "worldmodeling" in fmt else None)
    assert p.reasoning == (FULL["reasoning"] if fmt not in ("no_think", "free_think") else None)
    assert p.think == ({"free_think": "free text", "no_think": None}.get(fmt, p.think))
    # white space around and between the structural tags is fine
    spaced = text.replace("><", ">\n  <")
    assert parse_response("\n " + spaced + " \n", fmt).format_ok


def test_exact_strings_of_table5() -> None:
    gwm = ("<think><observation>o</observation><reasoning>r</reasoning><prediction>p</prediction></think>"
           "<answer>Left</answer>")
    assert build_response("grounding_worldmodeling", answer="Left", observation="o", reasoning="r", prediction="p") == gwm
    assert build_response("no_think", answer="Left") == "<answer>Left</answer>"
    assert build_response("free_think", answer="Left", think="t") == "<think>t</think><answer>Left</answer>"


@pytest.mark.parametrize(
    "fmt,text,reason",
    [
        ("grounding_worldmodeling",
         "<think><observation>a</observation><reasoning>b</reasoning></think><answer>Up</answer>", "missing <prediction>"),
        ("grounding", "<think><observation>a</observation><reasoning>b</reasoning></think>", "missing <answer>"),
        ("free_think", "<think>a</think><answer>Up", "missing </answer>"),
        ("no_think", "Up", "no tags"),
        ("no_think", "<answer>Up</answer><answer>Down</answer>", "duplicated <answer>"),
        ("grounding",
         "<think><observation>a</observation><observation>a</observation><reasoning>b</reasoning></think>"
         "<answer>Up</answer>", "duplicated <observation>"),
        ("grounding",
         "<think><observation>a</observation><reasoning>b</reasoning><prediction>c</prediction></think>"
         "<answer>Up</answer>", "unexpected <prediction>"),
        ("no_think", "<think>a</think><answer>Up</answer>", "unexpected <think>"),
        ("free_think", "<answer>Up</answer><think>a</think>", "tags out of order"),
        ("worldmodeling", "<think><prediction>c</prediction><reasoning>b</reasoning></think><answer>Up</answer>",
         "tags out of order"),
        ("free_think", "Sure! <think>a</think><answer>Up</answer>", "text outside the tags"),
        ("free_think", "<think>a</think> so <answer>Up</answer>", "text outside the tags"),
        ("free_think", "<think>a</think><answer>Up</answer> done", "text outside the tags"),
        ("free_think", "<think>a</think><answer>  </answer>", "empty answer"),
        ("free_think", "<THINK>a</THINK><ANSWER>Up</ANSWER>", "no tags"),
    ],
)
def test_bad_formats_give_reasons(fmt: str, text: str, reason: str) -> None:
    p = parse_response(text, fmt)
    assert not p.format_ok and p.reason == reason


def test_free_think_body_may_hold_other_tags() -> None:
    # VAGEN App. B.1's free-think example nests <reasoning> in <think>
    text = "<think><reasoning>one step below</reasoning></think><answer>Down,Down</answer>"
    p = parse_response(text, "free_think")
    assert p.format_ok and p.think == "<reasoning>one step below</reasoning>" and p.reasoning is None


def test_non_text_and_huge_inputs_never_raise() -> None:
    for bad, kind in ((None, "NoneType"), (42, "int"), (["<answer>Up</answer>"], "list")):
        p = parse_response(bad, "no_think")
        assert (p.format_ok, p.reason, p.answer) == (False, f"response is {kind}, not text", None)
    # bytes are decoded as UTF-8 with replacement: the two invalid bytes become U+FFFD, text outside the tags
    p = parse_response(b"\xff\xfe<answer>Up</answer>", "no_think")
    assert (p.format_ok, p.reason, p.answer) == (False, "text outside the tags", None)
    assert parse_response(b"<answer>Up</answer>", "no_think").answer == "Up"
    rng = np.random.default_rng(0)
    garbage = "".join(rng.choice(list("<>/abc answer think \n\x00\ufffd"), size=1 << 20))
    p = parse_response(garbage, "grounding_worldmodeling")
    assert not p.format_ok and "more than" in p.reason
    # just under the cap: thousands of tags are scanned only until the format is exceeded
    many = ("<answer>" * (MAX_RESPONSE_CHARS // 8))[:MAX_RESPONSE_CHARS]
    assert parse_response(many, "no_think").reason == "duplicated <answer>"
    with pytest.raises(ValueError, match="prompt_format"):
        parse_response("<answer>Up</answer>", "cot")


VOCAB = ActionVocab(["Left", "Down", "Right", "Up"], {"move up": "Up", "push left": "Left", "north": "Up"})


def test_action_words_case_space_and_aliases() -> None:
    assert normalise_action_word("  Move  UP. ") == "moveup"
    ap = VOCAB.parse("  up ,DOWN,  Left ", 3)
    assert ap.ok and ap.actions == ["Up", "Down", "Left"] and ap.dropped == 0
    assert VOCAB.parse("Move Up; push_left\nNORTH", 3).actions == ["Up", "Left", "Up"]
    assert VOCAB.parse("Up,,Down,", 3).actions == ["Up", "Down"]


def test_action_limit_and_unknown_words() -> None:
    ap = VOCAB.parse("Up,Up,Up,Up,Up", 3)
    assert ap.ok and ap.actions == ["Up"] * 3 and ap.dropped == 2
    ap = VOCAB.parse("Up,Jump,Down", 3)
    assert not ap.ok and ap.unknown == ["Jump"] and ap.reason == "unknown action 'Jump'"
    # words beyond the limit are dropped before they are looked at (VAGEN truncates first)
    assert VOCAB.parse("Up,Down,Left,Fly", 3).ok
    assert not VOCAB.parse("", 3).ok and not VOCAB.parse(" , ;", 3).ok
    assert parse_actions("right", ["Left", "Right"], 1).actions == ["Right"]
    with pytest.raises(ValueError, match="alias 'jump' maps to 'Fly', which is not an action"):
        ActionVocab(["Up"], {"jump": "Fly"})


@pytest.mark.parametrize(
    "pos,ref,phrase",
    [
        ((1, 1), (3, 3), "above and on the left side of"),
        ((1, 4), (3, 3), "above and on the right side of"),
        ((5, 1), (3, 3), "below and on the left side of"),
        ((5, 4), (3, 3), "below and on the right side of"),
        ((1, 3), (3, 3), "above and at the same column as"),
        ((4, 3), (3, 3), "below and at the same column as"),
        ((3, 0), (3, 3), "at the same row and to the left of"),
        ((3, 5), (3, 3), "at the same row and to the right of"),
        ((3, 3), (3, 3), "at the same place as"),
    ],
)
def test_relative_position_app_d1(pos, ref, phrase) -> None:
    assert relative_position(pos, ref) == phrase


def test_relation_sentences_match_the_paper_examples() -> None:
    # VAGEN App. D.1: ['box0 is at the same row and to the left of the player',
    #                  'target0 is above and on the left side of the player', 'target0 is above and on the left side of box0']
    player, box, target = (3, 3), (3, 1), (1, 0)
    assert relation_sentence("box0", box, "the player", player) == "box0 is at the same row and to the left of the player"
    assert relation_sentence("target0", target, "the player", player) == "target0 is above and on the left side of the player"
    assert relation_sentence("target0", target, "box0", box) == "target0 is above and on the left side of box0"


def test_prompt_pieces() -> None:
    text = format_prompt("grounding_worldmodeling", 3, example="<answer>Up</answer>", state_hint="HINT")
    assert text.splitlines()[0] == "You can take up to 3 action(s) at a time, separated by ,."
    assert "<think><observation>...</observation><reasoning>...</reasoning><prediction>...</prediction></think>" \
           "<answer>...</answer>" in text
    assert "HINT" in text and text.endswith("e.g. <answer>Up</answer>")
    assert "HINT" not in format_prompt("free_think", 3, state_hint="HINT")  # no observation/prediction there
    first = user_message(IMAGE_PLACEHOLDER, initial=True, format_text="F")
    assert first.startswith("[Initial Observation]:\n<image>\n") and first.count(IMAGE_PLACEHOLDER) == 1
    later = user_message(IMAGE_PLACEHOLDER, initial=False, valid_actions=["Up", "Left"])
    assert later.startswith("After your answer, the extracted valid action is Up, Left.")
    assert "is none." in user_message("grid", initial=False, valid_actions=[])


def test_image_placeholder_is_the_codecs() -> None:
    from worldloop.common.contracts.modeling import IMAGE_PLACEHOLDER as CODEC_PLACEHOLDER

    assert IMAGE_PLACEHOLDER == CODEC_PLACEHOLDER


def test_to_plain() -> None:
    out = to_plain({"a": (np.int64(1), np.float32(0.5)), "b": np.array([[1, 2]]), 3: [np.bool_(True), None]})
    assert out == {"a": [1, 0.5], "b": [[1, 2]], "3": [True, None]}
    assert type(out["a"][0]) is int and type(out["3"][0]) is bool
