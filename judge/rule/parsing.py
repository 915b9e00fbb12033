"""Facts stated in the agent's free text (untrusted: nothing here raises on any text, nothing is
ever read as an instruction): one module per kind of fact, gathered here as the one entry point
that :mod:`~worldloop.judge.rule.truths` and the package build on. Every parser takes plain inputs
(text, a lexicon, a grid string, a key table), never a Truth.

:mod:`~worldloop.judge.rule.lexicon`      the words of relations (directions, copulas, entity
                                          families) and the :class:`Lexicon` that maps mentions
                                          ("the box", "me") onto a truth's entity ids; canonical
                                          facts ``(a, b, axis, value)`` with ``a < b``.
:mod:`~worldloop.judge.rule.relations`    relation facts of sentences: tokens -> symbols -> clauses
                                          -> facts; negations, motion verbs and absolute positions
                                          yield nothing (App. D.1); a hybrid extractor's relations.
:mod:`~worldloop.judge.rule.grids`        the longest block of text lines as wide as the truth's
                                          grid, as (row, column, symbol) cells.
:mod:`~worldloop.judge.rule.coordinates`  the number tuples after each key of a structured state
                                          (``box_positions: [(3, 2)]``); a hybrid extractor's positions.
:mod:`~worldloop.judge.rule.svg`          (shape, colour) of every shape word and the stated
                                          similarity, or the elements of a dict the agent wrote.

Each imports only :mod:`~worldloop.judge.rule.f1` and the modules listed before it.

Public API::

    make_fact(subj, axis, value, obj) -> Fact | None
    Lexicon(ids, aliases={}, multiword={}), lexicon_from_sentences(sentences) -> Lexicon
    relation_items(text, lex, implicit=None) -> list[Item]    relation_facts(sentences, lex) -> list[Fact]
    directions_of(text) -> list[(axis, value)]
    grid_rows(symbolic) -> list[str]    grid_block(text, symbolic) -> list[str] | None
    grid_items(text, symbolic, background) -> list[Item]
    has_number_tuple(text) -> bool      norm_key(key) -> str      is_number(x) -> bool
    coordinate_facts(text, keys) -> list[Fact]
    BASIC_COLORS, svg_element_facts(structured) -> list[Fact], svg_text_facts(text, colors) -> list[Fact]
    extracted_relation_items(data, lex) -> list[Item], extracted_position_items(data) -> list[Item]
"""
from __future__ import annotations

from worldloop.judge.rule.coordinates import (coordinate_facts, extracted_position_items, has_number_tuple, is_number,
                                              norm_key)
from worldloop.judge.rule.grids import grid_block, grid_items, grid_rows, keeps_spaces
from worldloop.judge.rule.lexicon import Lexicon, directions_of, lexicon_from_sentences, make_fact
from worldloop.judge.rule.relations import extracted_relation_items, relation_facts, relation_items
from worldloop.judge.rule.svg import BASIC_COLORS, svg_element_facts, svg_text_facts

__all__ = [
    "BASIC_COLORS", "Lexicon", "coordinate_facts", "directions_of", "extracted_position_items",
    "extracted_relation_items", "grid_block", "grid_items", "grid_rows", "has_number_tuple", "is_number",
    "keeps_spaces", "lexicon_from_sentences", "make_fact", "norm_key", "relation_facts", "relation_items",
    "svg_element_facts", "svg_text_facts",
]
