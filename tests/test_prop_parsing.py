"""Property tests of the response parser (envs/parsing.py) and the rule judge (judge/rule).

* ``parse_response`` never raises on any text, bytes or other value, says why whenever the format
  is wrong, and gives back exactly the fields of a well-formed response built from any contents;
* ``ActionVocab.parse`` never raises and keeps only known words;
* ``rule_score`` never raises on any text, its score stays in [0, 1], and neither the order of the
  state's relations nor the order of the sentences the agent writes changes it.
"""

from __future__ import annotations

import random
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from worldloop.envs.parsing import PROMPT_FORMATS, THINK_FIELDS, ActionVocab, parse_response
from worldloop.judge.rule import rule_score
from worldloop.judge.rule.outlook import outlook_score
from test_judge_rule import relation_sentence, sokoban_state

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TAGS = ["<think>", "</think>", "<observation>", "</observation>", "<reasoning>", "</reasoning>", "<prediction>",
        "</prediction>", "<answer>", "</answer>"]
# text made of the pieces a parser trips on: tags, white space, letters, brackets
PIECES = st.lists(st.sampled_from(TAGS) | st.text(alphabet=" \n\t<>/abcdefghijUpDown,", max_size=8), max_size=24)
FORMATS = st.sampled_from(PROMPT_FORMATS)


def _tagless(min_size: int = 0):
    """Field contents: any text without '<' (so no tag), stripped as the parser strips them."""
    return st.text(alphabet=st.characters(blacklist_characters="<", blacklist_categories=("Cs",)),
                   min_size=min_size, max_size=40).map(str.strip)


@SETTINGS
@given(st.one_of(st.text(max_size=300), PIECES.map("".join), st.binary(max_size=300), st.none(), st.integers(),
                 st.lists(st.text(max_size=5), max_size=3)), FORMATS)
def test_the_parser_never_raises_and_says_why(text, fmt) -> None:
    r = parse_response(text, fmt)
    assert isinstance(r.format_ok, bool)
    assert (r.reason == "") == r.format_ok, r  # a reason exactly when the format is wrong
    if r.format_ok:
        assert r.answer and r.answer == r.answer.strip()


@SETTINGS
@given(FORMATS, st.data())
def test_a_well_formed_response_gives_back_its_fields(fmt, data) -> None:
    children = THINK_FIELDS[fmt]
    fields = {c: data.draw(_tagless(), label=c) for c in (children or ())}
    answer = data.draw(_tagless(min_size=1).filter(bool), label="answer")
    ws = data.draw(st.sampled_from(["", " ", "\n", " \n\t"]), label="space")
    if children is None:
        think = data.draw(_tagless(), label="think")
        text = f"{ws}<think>{think}</think>{ws}<answer>{answer}</answer>{ws}"
    else:
        inner = ws.join(f"<{c}>{fields[c]}</{c}>" for c in children)
        text = (f"<think>{ws}{inner}{ws}</think>" if children else "") + f"{ws}<answer>{answer}</answer>"
    r = parse_response(text, fmt)
    assert r.format_ok and r.reason == "" and r.answer == answer, (text, r)
    for c in children or ():
        assert getattr(r, c) == fields[c], (c, text, r)
    if children is None:
        assert r.think == think


@SETTINGS
@given(st.text(max_size=200), st.integers(1, 5))
def test_action_parsing_never_raises_and_keeps_only_known_words(answer: str, limit: int) -> None:
    vocab = ActionVocab(["Up", "Down", "Left", "Right"], {"north": "Up"})
    got = vocab.parse(answer, limit)
    assert len(got.actions) <= limit and set(got.actions) <= {"Up", "Down", "Left", "Right"}
    assert got.ok == (bool(got.actions) and not got.unknown), got


# --------------------------------------------------------------------------- the rule judge

CELLS = st.tuples(st.integers(1, 4), st.integers(1, 4))


@st.composite
def states(draw) -> dict:
    """A Sokoban state on a 6 x 6 board: a player, 1-2 boxes and as many targets, all distinct."""
    cells = draw(st.lists(CELLS, min_size=3, max_size=5, unique=True))
    n = (len(cells) - 1) // 2
    return sokoban_state(cells[0], cells[1 : 1 + n], cells[1 + n : 1 + 2 * n])


def _claims(state: dict, draw) -> list[str]:
    """Sentences an agent might write: some of the state's relations, some of them wrong."""
    s = state["structured"]
    names = ["player"] + [f"box{i}" for i in range(len(s["box_positions"]))] + \
            [f"target{i}" for i in range(len(s["target_positions"]))]
    pos = {"player": tuple(s["player_position"])}
    pos.update({f"box{i}": tuple(p) for i, p in enumerate(s["box_positions"])})
    pos.update({f"target{i}": tuple(p) for i, p in enumerate(s["target_positions"])})
    out = []
    for _ in range(draw(st.integers(0, 6))):
        a, b = draw(st.sampled_from(names)), draw(st.sampled_from(names))
        where = pos[a] if draw(st.booleans()) else draw(CELLS)  # true, or about a made-up place
        if a != b:
            out.append(relation_sentence(a, where, b, pos[b]) + ".")
    return out


@SETTINGS
@given(states(), st.text(max_size=300) | PIECES.map("".join))
def test_the_rule_judge_never_raises_and_scores_in_the_unit_interval(state: dict, text: str) -> None:
    r = rule_score(text, state, "sokoban")
    assert r is not None and 0.0 <= r.score <= 1.0, r


@SETTINGS
@given(states(), st.data())
def test_the_rule_score_ignores_the_order_of_relations_and_of_sentences(state: dict, data) -> None:
    claims = _claims(state, data.draw)
    text = " ".join(claims)
    base = rule_score(text, state, "sokoban")
    assert 0.0 <= base.score <= 1.0
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = random.Random(seed)
    shuffled_state = dict(state, relations=rng.sample(state["relations"], len(state["relations"])))
    shuffled_text = " ".join(rng.sample(claims, len(claims)))
    for st_, tx in ((shuffled_state, text), (state, shuffled_text), (shuffled_state, shuffled_text)):
        r = rule_score(tx, st_, "sokoban")
        assert (r.score, r.matched, r.predicted, r.truth) == pytest.approx(
            (base.score, base.matched, base.predicted, base.truth)), (claims, seed)


@SETTINGS
@given(states(), st.text(alphabet=string.printable, max_size=60))
def test_the_rule_judge_on_relations_only_states(state: dict, noise: str) -> None:
    # a state that carries only its relation sentences (the "relations" method): same properties
    only = {"relations": state["relations"]}
    # (sentences end with a period: run together without one, "... of the player target0 is ..."
    # is another text, whose reading may depend on the order)
    said = lambda rel: noise + ". " + " ".join(f"{x}." for x in rel)
    r = rule_score(said(state["relations"]), only)
    assert r is not None and 0.0 <= r.score <= 1.0
    for rel, truth in ((state["relations"][::-1], state["relations"]), (state["relations"], state["relations"][::-1]),
                       (state["relations"][::-1], state["relations"][::-1])):
        again = rule_score(said(rel), {"relations": truth})
        assert (again.score, again.matched, again.predicted) == pytest.approx((r.score, r.matched, r.predicted))


OUTLOOK_NAMES = ["Left", "Down", "Right", "Up", "Down-left", "Down-right", "Up-left", "Up-right"]
OUTLOOK_WORDS = ["ice", "hole", "goal", "edge"]


@st.composite
def outlooks(draw) -> list[tuple[str, str]]:
    names = draw(st.lists(st.sampled_from(OUTLOOK_NAMES), min_size=1, max_size=8, unique=True))
    return [(n, draw(st.sampled_from(OUTLOOK_WORDS))) for n in names]


def _outlook_text(items: list[tuple[str, str]], seps: list[str]) -> str:
    return "".join(f"{n} {w}{seps[i % len(seps)]} " for i, (n, w) in enumerate(items)).strip()


@SETTINGS
@given(st.one_of(st.text(max_size=200), PIECES.map("".join), st.none()), outlooks())
def test_the_outlook_score_never_raises_and_stays_in_the_unit_interval(text, truth) -> None:
    score = outlook_score(text, _outlook_text(truth, [","]))
    assert 0.0 <= score <= 1.0


@SETTINGS
@given(outlooks(), st.data())
def test_the_outlook_score_counts_right_cells_whatever_their_order(truth, data) -> None:
    """Against a hand count: the agent keeps some cells, changes the word of others and drops the
    rest, then writes them in any order with any separators; the score is the kept share."""
    said, right = [], 0
    for name, word in truth:
        fate = data.draw(st.sampled_from(["keep", "change", "drop"]))
        if fate == "keep":
            said.append((name, word))
            right += 1
        elif fate == "change":
            said.append((name, data.draw(st.sampled_from([w for w in OUTLOOK_WORDS if w != word]))))
    said = data.draw(st.permutations(said))
    seps = data.draw(st.lists(st.sampled_from([",", ";", "."]), min_size=1, max_size=3))
    truth_text = _outlook_text(truth, [",", ";"])
    assert outlook_score(_outlook_text(said, seps), truth_text) == pytest.approx(right / len(truth))
    assert outlook_score(_outlook_text(said, seps).upper(), truth_text) == pytest.approx(right / len(truth))
