"""Env families: what a family knows about judging its envs, behind the one interface the judge asks.

An env family (``grid``, ``navigation``, ``primitive_skill``, ``svg``, or one you add) is an
:class:`EnvFamily`, defined in its package's ``truth.py`` and registered by one line in
``worldloop/envs/__init__.py`` (``register_family(...)``). It owns:

* its **env ids** (gymnasium id -> entry point; ``worldloop.envs`` registers them with gymnasium);
* its **ground truth**: :meth:`EnvFamily.truth` turns a state that only the family understands into
  a :class:`FamilyTruth` (the relations a text is scored against, as plain data: entities and the
  direction of each relative to a reference, or the image elements); states in the shared formats
  of the env contract (relation sentences, a symbolic grid, a structured dict of numbers) need no
  family code, the judge reads those itself;
* its **scoring knowledge**: the tolerance of its coordinates, the words its objects go by
  (:attr:`EnvFamily.object_types`), the VAGEN reward rules of its envs (:class:`VagenRule`), the envs
  whose ``local`` prompt the ``local`` rule mode scores, which ``relation_prompt`` follows each
  ``judge.rule_mode``, the YES/NO prompts of the LLM judge (:meth:`EnvFamily.judge_prompt`), and for
  ``worldloop eval`` the paper's turn limits and the similarity metrics it reports.

The judge (``worldloop.judge``) and ``worldloop eval`` ask the registry (:func:`family_of`,
:func:`families`), never a family's module. This module imports nothing of worldloop, so the judge may
import it (``tools/check_layers.py``: the judge imports from envs this registry only).

Public API::

    EnvFamily, FamilyTruth, VagenRule, env_name_of(name_or_id) -> "sokoban"
    register_family(family, replace=False) -> family;  unregister_family(name)
    family_of(env_name_or_id) -> EnvFamily | None;     families() -> list[EnvFamily]
    all_env_ids() -> {gymnasium id: entry point};       object_types() -> {word: type}
    PROMPT_FORMAT, PROMPT_EQUIV, PROMPT_PREDICTION_FIRST   # shared pieces of the judge's YES/NO prompts
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

Direction = tuple[str, str, str]  # (entity, direction words, reference): ("toaster", "ahead-left", "player")


@dataclass
class FamilyTruth:
    """One state's ground truth as its family states it, in plain data; the judge turns it into facts.

    ``kind`` says how the judge reads it:

    ``directions``  relations of entities to a reference: ``known`` lists every ``(entity, direction
                    words, reference)`` the state holds (precision is measured against them),
                    ``essential`` the ones recall counts (the task's target); ``entities`` are the ids
                    a text may name, ``surfaces`` multi-word spellings (("counter", "top") ->
                    "countertop"), ``aliases`` words that mean an entity ("target" -> "toaster"),
                    ``implicit`` the entity a direction without an object refers to.
    ``elements``    image elements: ``elements`` is the state's structured dict with its
                    ``target_elements`` (and, once rendered, ``rendered_elements`` and ``similarity``);
                    ``tolerance`` is how close a predicted similarity must be.

    ``method`` is the name the judge reports (``"navigation"``, ``"svg"``); ``info`` is what an LLM judge
    is shown as ground truth. ``before_coordinates``: the family's reading wins over comparing a text's
    number tuples with the state's numbers (else a text that gives coordinates is compared on those).
    """

    method: str
    kind: Literal["directions", "elements"]
    known: list[Direction] = field(default_factory=list)
    essential: list[Direction] = field(default_factory=list)
    entities: list[str] = field(default_factory=list)
    surfaces: dict[tuple[str, ...], str] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    implicit: str | None = None
    elements: dict = field(default_factory=dict)
    tolerance: float = 0.0
    info: Any = None
    before_coordinates: bool = False


@dataclass(frozen=True)
class VagenRule:
    """How VAGEN rewards an observation of one env (``judge.rule_mode: vagen``): the object types and
    their weights, and the matching: ``greedy`` (an item matches only with both relations equal, F1 0
    when nothing matched, score = weighted sum) or ``bipartite`` (one right axis is half credit,
    weights normalised over the types present, 1.0 when nothing of the types is anywhere and both
    lists are empty)."""

    weights: dict[str, float]
    matching: Literal["greedy", "bipartite"]


class EnvFamily:
    """One env family's knowledge for the judge and the evaluator; override what the family has.

    Class attributes (all optional but ``name`` and ``env_ids``):

    ``name``                the family's name (its package under ``envs/``)
    ``env_ids``             gymnasium id -> entry point of each of its envs
    ``coord_tolerance``     coordinates within this many units count as the same (structured states)
    ``object_types``        type -> the words its objects go by ("box" -> "box boxes crate crates")
    ``vagen``               env name -> :class:`VagenRule` (the envs ``judge.rule_mode: vagen`` scores)
    ``local_envs``          env names whose ``relation_prompt="local"`` the ``local`` mode scores
    ``relation_prompts``    ``judge.rule_mode`` -> gymnasium ids whose ``relation_prompt`` follows it
    ``prompts``             env name -> part (``grounding`` | ``worldmodeling``) -> YES/NO prompt
                            template with ``{state_information_dict}``, ``{natural_language_description}``
                            and ``{env}``; ``"*"``: the family's envs without their own
    ``own_prompt_always``   its prompt is used also when the text is a grid or dict (else the judge's
                            representation prompt compares those)
    ``paper_max_turns``     task name (``worldloop/Sokoban-v0`` -> ``Sokoban``) -> turns per episode
    ``similarity_metrics``  task name -> the similarity metrics ``worldloop eval`` reports instead of success
    """

    name: str = ""
    env_ids: dict[str, str] = {}
    coord_tolerance: float = 0.0
    object_types: dict[str, str] = {}
    vagen: dict[str, VagenRule] = {}
    local_envs: tuple[str, ...] = ()
    relation_prompts: dict[str, tuple[str, ...]] = {}
    prompts: dict[str, dict[str, str]] = {}
    own_prompt_always: bool = False
    paper_max_turns: dict[str, int] = {}
    similarity_metrics: dict[str, tuple[str, ...]] = {}

    def env_names(self) -> tuple[str, ...]:
        """Short names of its envs (``worldloop/Sokoban-v0`` -> ``sokoban``), as trajectories carry them."""
        return tuple(env_name_of(i) for i in self.env_ids)

    def truth(self, relations: list[str], symbolic: str | None, structured: dict) -> FamilyTruth | None:
        """The ground truth of a state only this family understands; None: the shared formats apply.

        Called for every registered family in turn (the first answer wins), so a family recognises its
        own states by their content, also when the env name is unknown."""
        return None

    def judge_prompt(self, env_name: str, part: str) -> str | None:
        """The YES/NO prompt template of the LLM judge for ``part`` of ``env_name``; None: the judge's default."""
        name = env_name_of(env_name)
        return (self.prompts.get(name) or self.prompts.get("*") or {}).get(part)


# --------------------------------------------------------------------------- the registry

_FAMILIES: dict[str, EnvFamily] = {}


def env_name_of(name: str | None) -> str:
    """``worldloop/FrozenLake-v0``, ``FrozenLake`` or ``frozenlake`` -> ``frozenlake``."""
    base = (name or "").lower().rsplit("/", 1)[-1]
    return re.sub(r"-v\d+$", "", base)


def register_family(family: EnvFamily, replace: bool = False) -> EnvFamily:
    """Add ``family`` to the registry (the one line that adds an env family); returns it.

    A second family of the same name, or one claiming an env another family has, is an error unless
    ``replace`` (then the old one of that name goes)."""
    if not family.name or not family.env_ids:
        raise ValueError(f"an env family needs a name and env_ids, got name={family.name!r}")
    if family.name in _FAMILIES and not replace:
        raise ValueError(f"env family {family.name!r} is already registered")
    for other in _FAMILIES.values():
        shared = set(other.env_names()) & set(family.env_names())
        if other.name != family.name and shared:
            raise ValueError(f"env family {family.name!r} claims {sorted(shared)}, which family {other.name!r} has")
    _FAMILIES[family.name] = family
    return family


def unregister_family(name: str) -> None:
    """Remove a family (tests that add a toy family take it out again)."""
    _FAMILIES.pop(name, None)


def families() -> list[EnvFamily]:
    """Every registered family, in registration order."""
    return list(_FAMILIES.values())


def family_of(env: str | None) -> EnvFamily | None:
    """The family of an env name or gymnasium id; None for an env no family claims."""
    name = env_name_of(env)
    return next((f for f in _FAMILIES.values() if name and name in f.env_names()), None)


def all_env_ids() -> dict[str, str]:
    """gymnasium id -> entry point over every family."""
    return {i: e for f in _FAMILIES.values() for i, e in f.env_ids.items()}


def object_types() -> dict[str, str]:
    """word -> object type over every family ("crates" -> "box"): how generic object mentions resolve."""
    return {w: t for f in _FAMILIES.values() for t, words in f.object_types.items() for w in words.split()}


# --------------------------------------------------------------------------- shared pieces of the YES/NO prompts

PROMPT_FORMAT = ("Your answer should be in the format of <think>...</think><answer>YES</answer> or "
                 "<think>...</think><answer>NO</answer>.")

PROMPT_EQUIV = """3. Equivalent Expression Recognition
 - "box is above player" = "player is below box"
 - "target is left of box" = "box is right of target"
 - Must recognize these as identical spatial relationships. Absolute position is not allowed"""

PROMPT_PREDICTION_FIRST = """Important: The Prediction Comes First
Remember: The Next State Prediction is made BEFORE the Groundtruth Next State exists. Your task is to check if the prediction correctly anticipated what actually happened."""
