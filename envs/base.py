"""The env contract: :class:`VisualEnv`, the base class of every worldloop environment.

Public API (stable; later changes only add)::

    STATE_FORMATS = ("natural_language", "symbolic", "structured")
    RENDER_MODES = ("rgb_array", "ansi", "vision", "text")   # vision == rgb_array, text == ansi
    RENDER_MODE_ALIASES = {"vision": "rgb_array", "text": "ansi"}
    TEXT_CHARSET: str                      # characters of observation text (observation_space["text"])
    IMAGE_PLACEHOLDER = "<image>"          # == worldloop.common.contracts.modeling.IMAGE_PLACEHOLDER
    FORMAT_REWARD = 0.5                    # VAGEN Tables 16-20
    observation_parts(obs) -> (text, images)
    move_outlook_of(env, env_id) -> str      # env.move_outlook(), ValueError where it has none
    relative_position(pos, ref) -> str     # App. D.1 phrase, e.g. "above and on the left side of"
    relation_sentence(name, pos, ref_name, ref_pos) -> str
    to_plain(obj)                          # numpy / tuples -> plain msgpack-able Python
    check_int(name, value, lo, hi=None) -> int   # an int kwarg in [lo, hi], else ValueError naming it
    ActionResult(changed: bool, reward: float = 0.0)
    class VisualEnv(gymnasium.Env)

What a response may look like and how its answer becomes actions is :mod:`worldloop.envs.parsing`
(``parse_response``, ``ActionVocab``, ``PROMPT_FORMATS``, ``MAX_RESPONSE_CHARS``); the text of the
system prompt and of each turn's message is :mod:`worldloop.envs.prompts` (``format_prompt``,
``build_response``, ``user_message``). This module imports both; neither imports it.

Turn semantics of :class:`VisualEnv.step` (the same for every env; decided from VAGEN Tables 16/17
and the issue's "invalid or unparsable text gets no format reward and changes nothing"):

* bad format, empty answer or any unknown action word -> nothing is executed, ``env_reward`` 0,
  ``format_reward`` 0, no step penalty, the step counter does not advance, ``format_ok`` False.
* otherwise ``format_reward`` = 0.5 and the actions run in order; each executed action earns the
  env's own reward for it (``ActionResult.reward``, e.g. Sokoban's +1 box on target) plus
  ``SUCCESS_REWARD`` (+10) if it completes the task, else ``-STEP_PENALTY`` (-0.1: "applied each step
  when the task is not completed"). Execution stops early when the episode terminates or the step
  limit is reached.
* a "step" for ``max_steps`` is one executed action (as in gym-sokoban); ``truncated`` becomes True
  when ``max_steps`` actions have run without termination.
* a step after the episode ended executes nothing and earns nothing (``format_ok`` still reports the
  parse, ``info["reason"] == "episode already ended"``).

Gymnasium conformance (``gymnasium.utils.env_checker.check_env`` passes for every registered env,
tests/test_envs_gymnasium.py; the checker is on at registration):

* ``render_mode`` is gymnasium's ``"rgb_array"`` (image observations; ``render()`` returns the
  uint8 HxWx3 frame) or ``"ansi"`` (text observations; ``render()`` returns the text). The original
  names ``"vision"`` and ``"text"`` are aliases (``RENDER_MODE_ALIASES``) accepted everywhere; the
  env stores the standard name in ``env.render_mode`` and the modality in ``env.vision``.
* ``observation_space`` declares exactly what ``reset``/``step`` return:
  ``Dict(text=Text(charset=TEXT_CHARSET), image=Box(0, 255, (H, W, 3), uint8))`` in rgb_array mode,
  ``Dict(text=Text(...))`` in ansi mode. A text-mode observation therefore has no ``"image"`` key;
  it is an :class:`Observation` (a dict) whose ``obs["image"]`` still answers None, so callers
  written for ``{"text", "image": None}`` keep working. ``(H, W)`` comes from :meth:`VisualEnv._image_shape`.
* ``action_space`` is ``Text(max_length=MAX_RESPONSE_CHARS, charset=TEXT_CHARSET)``: descriptive,
  since ``step`` accepts any text (and None/bytes) and scores what it cannot parse as a format error.
* every observation and info is new data (no array is shared between calls).

Subclass interface (override the ``_`` methods; see :class:`VisualEnv`):

    ACTIONS, ACTION_ALIASES, ACTION_SEP, STATE_FORMATS_SUPPORTED, DEFAULT_MAX_ACTIONS_PER_STEP,
    DEFAULT_MAX_STEPS, DEFAULT_IMAGE_SIZE, SUCCESS_REWARD, STEP_PENALTY   (class attributes)
    _generate(rng, options)            new level from the seeded numpy Generator      (required)
    _apply_action(value) -> ActionResult   one action; say whether the state changed  (required)
    _get_state() -> dict               {"relations", "symbolic", "structured"}        (required)
    _is_success() -> bool                                                             (required)
    _render_image() -> np.ndarray      uint8 HxWx3 (vision mode)                      (required)
    _image_shape() -> (H, W, 3)        shape of every rendered image; default (image_size, image_size, 3)
    _render_text() -> str              text observation (text mode); default: state's symbolic
    _system_intro() -> str             role, rules, symbols, "Actions you can take: ..." (required)
    _expert_actions() -> list[str]     next actions of a competent plan (canonical strings)
    _is_terminal() -> bool             default: success; e.g. FrozenLake hole
    _parse_actions(answer) -> ActionParse   default: ActionVocab over ACTIONS/ACTION_ALIASES;
                                       override for continuous actions (values = parsed objects)
    _state_format_hint() -> str        what <observation>/<prediction> should contain
    _example_fields() -> dict          observation/reasoning/prediction/answer for the prompt example
    _expert_reasoning(actions) -> str
    _turn_context() -> str             extra per-turn text (e.g. an instruction); default ""
    _metrics() -> dict[str, float]     env-specific numbers; default {}
    _snapshot() / _restore(snap)       used to simulate the expert's prediction; default deepcopy
    describe_state(state) -> str       state as text in self.state_format
    move_outlook() -> str | None       what each action runs into, for sft.concise_reasoning outlook; default None
    tempting_dead_end() -> bool | None a move toward the goal ends the episode in failure, for sft.level_pool; default None
"""

from __future__ import annotations

import copy
import json
import string
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import gymnasium
import numpy as np

from worldloop.envs.parsing import (MAX_RESPONSE_CHARS, PROMPT_FORMATS, ActionParse, ActionVocab, parse_response,
                                    uses_observation, uses_prediction)
from worldloop.envs.prompts import build_response, format_prompt, user_message

STATE_FORMATS: tuple[str, ...] = ("natural_language", "symbolic", "structured")
# what a text-mode observation shows: the env's text rendering, or the state text itself
TEXT_OBSERVATIONS: tuple[str, ...] = ("render", "state")
# gymnasium's standard names first; "vision" / "text" are the original names, kept as aliases
RENDER_MODES: tuple[str, ...] = ("rgb_array", "ansi", "vision", "text")
RENDER_MODE_ALIASES: dict[str, str] = {"vision": "rgb_array", "text": "ansi"}
# Characters an observation text may hold: printable ASCII with white space, plus the Unicode blocks
# env texts may draw on (Latin-1 and Latin Extended-A, Greek, punctuation, super/subscripts, letterlike
# symbols, arrows, mathematical operators, box drawing, blocks, geometric shapes, misc symbols).
# gymnasium's default Text charset (letters and digits) rejects even a space.
_UNICODE_BLOCKS = ((0x00A0, 0x017F), (0x0370, 0x03FF), (0x2000, 0x206F), (0x2070, 0x209F), (0x20A0, 0x20BF),
                   (0x2100, 0x214F), (0x2190, 0x21FF), (0x2200, 0x22FF), (0x2500, 0x25FF), (0x2600, 0x26FF))
TEXT_CHARSET: str = string.printable + "".join(chr(c) for lo, hi in _UNICODE_BLOCKS for c in range(lo, hi + 1))
MAX_OBSERVATION_CHARS = 1 << 20
IMAGE_PLACEHOLDER = "<image>"
FORMAT_REWARD = 0.5


# --------------------------------------------------------------------------- helpers for envs


def move_outlook_of(env: Any, env_id: str) -> str:
    """The ``move_outlook()`` text of ``env`` (a gymnasium env, wrapped or not): what each action runs
    into, which ``sft.concise_reasoning: outlook`` demonstrations and grounding write; ValueError naming
    ``env_id`` where the env describes none."""
    outlook = getattr(env.unwrapped, "move_outlook", lambda: None)()
    if outlook is None:
        raise ValueError(f"{env_id} has no move_outlook(): sft.concise_reasoning outlook needs what each move "
                         "runs into")
    return str(outlook)


def observation_parts(obs: Any) -> tuple[str, list[Any]]:
    """An observation ``{"text": str, "image": array | list of arrays | None}`` as (text, images);
    ValueError for anything else."""
    if not isinstance(obs, dict) or not isinstance(obs.get("text"), str):
        raise ValueError(f"observation must be a dict with a str 'text', got {type(obs).__name__}")
    image = obs.get("image")
    return obs["text"], ([] if image is None else list(image) if isinstance(image, (list, tuple)) else [image])


def relative_position(pos: Sequence[int], ref: Sequence[int]) -> str:
    """Where ``pos`` is relative to ``ref`` (both (row, col), row grows downwards), App. D.1 wording.

    ``"above and on the left side of"``, ``"below and at the same column as"``,
    ``"at the same row and to the right of"``, ``"at the same place as"``.
    """
    dr, dc = int(pos[0]) - int(ref[0]), int(pos[1]) - int(ref[1])
    if dr == 0 and dc == 0:
        return "at the same place as"
    if dr == 0:
        return f"at the same row and to the {'left' if dc < 0 else 'right'} of"
    vertical = "above" if dr < 0 else "below"
    if dc == 0:
        return f"{vertical} and at the same column as"
    return f"{vertical} and on the {'left' if dc < 0 else 'right'} side of"


def relation_sentence(name: str, pos: Sequence[int], ref_name: str, ref_pos: Sequence[int]) -> str:
    """``"box0 is above and on the left side of the player"`` (``ref_name`` given as "the player")."""
    return f"{name} is {relative_position(pos, ref_pos)} {ref_name}"


def check_int(name: str, value: Any, lo: int, hi: int | None = None) -> int:
    """``value`` as int in [lo, hi], else ValueError naming the kwarg."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo or (hi is not None and value > hi):
        span = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be an int {span}, got {value!r}")
    return int(value)


def to_plain(obj: Any) -> Any:
    """Recursively convert numpy scalars/arrays and tuples to plain msgpack-able Python."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, (int, float)):
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Mapping):
        return {str(k): to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_plain(v) for v in obj]
    raise TypeError(f"cannot convert {type(obj).__name__} to plain data")


# --------------------------------------------------------------------------- the env


class Observation(dict):
    """An observation dict. It holds exactly the keys of ``observation_space`` (``text``, plus
    ``image`` in rgb_array mode); a missing ``"image"`` reads as None, as it did before text-mode
    observations dropped the key."""

    __slots__ = ()

    def __missing__(self, key: str) -> Any:
        if key == "image":
            return None
        raise KeyError(key)


def canonical_render_mode(render_mode: Any) -> str:
    """``"vision"`` -> ``"rgb_array"``, ``"text"`` -> ``"ansi"``; ValueError for an unknown mode."""
    if render_mode not in RENDER_MODES:
        raise ValueError(f"render_mode must be one of {RENDER_MODES}, got {render_mode!r}")
    return RENDER_MODE_ALIASES.get(render_mode, render_mode)


@dataclass(frozen=True)
class ActionResult:
    """Outcome of one action: did the state change (WMAct "effective"), env-specific reward."""

    changed: bool
    reward: float = 0.0


class VisualEnv(gymnasium.Env):
    """Text-in env with image (or text) observations; see the module docstring for the contract.

    Constructor kwargs (common to all envs): ``render_mode`` "rgb_array" | "ansi" (aliases "vision" |
    "text"), ``prompt_format``,
    ``state_format``, ``max_actions_per_step``, ``image_size`` (side in pixels; None: env default),
    ``max_steps`` (executed actions per episode; None: env default), ``add_example`` (prompt example
    in the system prompt), ``text_observation`` (text mode only: ``"render"``, the env's text
    rendering, or ``"state"``, the true state in ``state_format``). Attributes after ``reset``:
    ``task`` (sub-task label), ``steps``.
    """

    metadata = {"render_modes": list(RENDER_MODES), "render_fps": 4}

    ACTIONS: tuple[str, ...] = ()
    ACTION_ALIASES: Mapping[str, str] = {}
    ACTION_SEP = ","
    STATE_FORMATS_SUPPORTED: tuple[str, ...] = STATE_FORMATS
    DEFAULT_MAX_ACTIONS_PER_STEP = 3
    DEFAULT_MAX_STEPS = 100
    DEFAULT_IMAGE_SIZE = 192
    SUCCESS_REWARD = 10.0
    STEP_PENALTY = 0.1
    # attributes never copied by the default _snapshot (caches, gymnasium bookkeeping)
    _SNAPSHOT_SKIP: frozenset[str] = frozenset({"spec", "_vocab", "_state_cache", "_sprites", "action_space",
                                                "observation_space", "_observation_space"})

    def __init__(
        self,
        *,
        render_mode: str = "vision",
        prompt_format: str = "grounding_worldmodeling",
        state_format: str = "natural_language",
        max_actions_per_step: int | None = None,
        image_size: int | None = None,
        max_steps: int | None = None,
        add_example: bool = True,
        text_observation: str = "render",
    ) -> None:
        super().__init__()
        render_mode = canonical_render_mode(render_mode)
        if text_observation not in TEXT_OBSERVATIONS:
            raise ValueError(f"text_observation must be one of {TEXT_OBSERVATIONS}, got {text_observation!r}")
        if text_observation != "render" and render_mode != "ansi":
            raise ValueError(f"text_observation={text_observation!r} is for render_mode 'text' (ansi); "
                             f"got render_mode {render_mode!r}")
        if prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format must be one of {PROMPT_FORMATS}, got {prompt_format!r}")
        if state_format not in STATE_FORMATS:
            raise ValueError(f"state_format must be one of {STATE_FORMATS}, got {state_format!r}")
        if state_format not in self.STATE_FORMATS_SUPPORTED:
            raise ValueError(
                f"state_format {state_format!r} is not supported by {type(self).__name__} "
                f"(supported: {self.STATE_FORMATS_SUPPORTED})"
            )
        n_act = self.DEFAULT_MAX_ACTIONS_PER_STEP if max_actions_per_step is None else max_actions_per_step
        if isinstance(n_act, bool) or not isinstance(n_act, (int, np.integer)) or n_act < 1:
            raise ValueError(f"max_actions_per_step must be an int >= 1, got {max_actions_per_step!r}")
        size = self.DEFAULT_IMAGE_SIZE if image_size is None else image_size
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or not 16 <= size <= 4096:
            raise ValueError(f"image_size must be an int in [16, 4096], got {image_size!r}")
        limit = self.DEFAULT_MAX_STEPS if max_steps is None else max_steps
        if isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or limit < 1:
            raise ValueError(f"max_steps must be an int >= 1, got {max_steps!r}")
        self.render_mode = render_mode  # the standard name: "rgb_array" or "ansi"
        self.vision = render_mode == "rgb_array"  # image observations
        self.prompt_format = prompt_format
        self.state_format = state_format
        self.max_actions_per_step = int(n_act)
        self.image_size = int(size)
        self.max_steps = int(limit)
        self.add_example = bool(add_example)
        self.text_observation = text_observation
        self.task = "base"
        self.steps = 0
        self._vocab = ActionVocab(self.ACTIONS, self.ACTION_ALIASES) if self.ACTIONS else None
        self._state_cache: dict | None = None
        self._done = False
        self._was_reset = False
        self._last_actions: list[str] | None = None
        # actions are free text (descriptive: step takes any text); the observation space is built on
        # first use, once the subclass has set what its image shape depends on (see _image_shape)
        self.action_space = gymnasium.spaces.Text(max_length=MAX_RESPONSE_CHARS, min_length=0, charset=TEXT_CHARSET)
        self._observation_space: gymnasium.spaces.Dict | None = None

    @property
    def observation_space(self) -> gymnasium.spaces.Dict:  # type: ignore[override]
        """``Dict(text=Text, image=Box(0, 255, _image_shape(), uint8))``; no ``image`` in ansi mode."""
        if self._observation_space is None:
            parts: dict[str, gymnasium.spaces.Space] = {
                "text": gymnasium.spaces.Text(max_length=MAX_OBSERVATION_CHARS, min_length=1, charset=TEXT_CHARSET)}
            if self.vision:
                shape = tuple(int(v) for v in self._image_shape())
                parts["image"] = gymnasium.spaces.Box(0, 255, shape, dtype=np.uint8)
            self._observation_space = gymnasium.spaces.Dict(parts)
        return self._observation_space

    @observation_space.setter
    def observation_space(self, space: gymnasium.spaces.Dict) -> None:
        self._observation_space = space

    def _image_shape(self) -> tuple[int, int, int]:
        """The shape of every image :meth:`_render_image` returns (override when it is not square
        ``image_size``, e.g. a grid of whole cells)."""
        return (self.image_size, self.image_size, 3)

    # ------------------------------------------------------------------ subclass hooks (required)

    def _generate(self, rng: np.random.Generator, options: dict | None) -> None:
        """Build a new episode (level, positions, ...) using only ``rng``."""
        raise NotImplementedError

    def _apply_action(self, value: Any) -> ActionResult:
        """Execute one parsed action (a canonical string for discrete envs)."""
        raise NotImplementedError

    def _get_state(self) -> dict:
        """{"relations": list[str], "symbolic": str | None, "structured": dict} of the current state."""
        raise NotImplementedError

    def _is_success(self) -> bool:
        raise NotImplementedError

    def _render_image(self) -> np.ndarray:
        raise NotImplementedError

    def _system_intro(self) -> str:
        """Role, quick guide, symbols, rules and the "Actions you can take: ..." line."""
        raise NotImplementedError

    # ------------------------------------------------------------------ subclass hooks (optional)

    def _is_terminal(self) -> bool:
        return self._is_success()

    def _render_text(self) -> str:
        return str(self._current_state().get("symbolic") or "")

    def _parse_actions(self, answer: str) -> ActionParse:
        if self._vocab is None:
            raise NotImplementedError(f"{type(self).__name__} has no ACTIONS: override _parse_actions")
        return self._vocab.parse(answer, self.max_actions_per_step)

    def _expert_actions(self) -> list[str]:
        raise NotImplementedError

    def _expert_reasoning(self, actions: Sequence[str]) -> str:
        return f"Following the shortest plan, the next action(s) should be {', '.join(actions)}."

    def move_outlook(self) -> str | None:
        """What each action would move the agent into, from the true state, as the reasoning of a
        demonstration that looks before it moves (``sft.concise_reasoning: outlook``); None where the env
        does not describe it."""
        return None

    def tempting_dead_end(self) -> bool | None:
        """Whether a move that brings the agent closer to its goal ends the episode in failure (FrozenLake: a
        hole on the way), from the true state: the levels ``sft.level_pool`` prefers as demonstrations, where the
        answer must follow the reading and not the goal's direction alone; None where the env does not say."""
        return None

    def _state_format_hint(self) -> str:
        return ""

    def _example_fields(self) -> dict[str, str]:
        """observation / reasoning / prediction / answer (/ think) texts of the prompt example."""
        return {}

    def _turn_context(self) -> str:
        return ""

    def _metrics(self) -> dict[str, float]:
        return {}

    def _snapshot(self) -> Any:
        return {k: copy.deepcopy(v) for k, v in vars(self).items() if k not in self._SNAPSHOT_SKIP}

    def _restore(self, snap: Any) -> None:
        vars(self).update(snap)
        self._state_cache = None

    # ------------------------------------------------------------------ state text

    def describe_state(self, state: Mapping[str, Any]) -> str:
        """``state`` as text in ``self.state_format`` (sentences / symbol grid / JSON dict)."""
        if self.state_format == "symbolic":
            return str(state.get("symbolic") or "")
        if self.state_format == "structured":
            return json.dumps(state.get("structured") or {}, separators=(", ", ": "))
        rel = [str(r) for r in state.get("relations") or []]
        return ". ".join(rel) + ("." if rel else "")

    # ------------------------------------------------------------------ prompts

    def format_instructions(self, *, example: bool) -> str:
        ex = None
        if example:
            f = self._example_fields()
            if f.get("answer"):
                ex = build_response(self.prompt_format, answer=f["answer"], think=f.get("think"),
                                    observation=f.get("observation"), reasoning=f.get("reasoning"),
                                    prediction=f.get("prediction"))
        return format_prompt(self.prompt_format, self.max_actions_per_step, self.ACTION_SEP, example=ex,
                             state_hint=self._state_format_hint(), action_line=self._action_line())

    def _action_line(self) -> str | None:
        """The "You can take up to N action(s)..." line; None keeps the default wording."""
        return None

    def system_prompt(self) -> str:
        """System message: the env's guide plus the format instructions with an example."""
        return f"{self._system_intro().rstrip()}\n{self.format_instructions(example=self.add_example)}"

    def _observation(self, initial: bool) -> Observation:
        if self.vision:
            slot = IMAGE_PLACEHOLDER
        else:
            slot = self._text_slot()
        text = user_message(slot, initial=initial, valid_actions=self._last_actions, context=self._turn_context(),
                            format_text=self.format_instructions(example=False))
        obs = Observation(text=text)
        if self.vision:  # a fresh array every time: renderers may return a cached one
            obs["image"] = np.array(self._render_image(), dtype=np.uint8, order="C", copy=True)
        return obs

    # ------------------------------------------------------------------ gymnasium API

    def _current_state(self) -> dict:
        if self._state_cache is None:
            state = to_plain(self._get_state())
            self._state_cache = {
                "relations": [str(r) for r in state.get("relations") or []],
                "symbolic": state.get("symbolic"),
                "structured": state.get("structured") or {},
            }
            outlook = self.move_outlook()
            if outlook is not None:  # the truth an outlook reasoning is scored against (judge/rule/outlook.py)
                self._state_cache["outlook"] = str(outlook)
        return self._state_cache

    def _base_info(self) -> dict:
        return {"state": copy.deepcopy(self._current_state()), "success": bool(self._is_success()),
                "task": self.task, "metrics": {k: float(v) for k, v in self._metrics().items()},
                "steps": self.steps}

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        super().reset(seed=seed)
        self.steps = 0
        self._done = False
        self._last_actions = None
        self._state_cache = None
        self._generate(self.np_random, options)
        self._state_cache = None
        self._was_reset = True
        return self._observation(initial=True), self._base_info()

    def step(self, response: Any) -> tuple[dict, float, bool, bool, dict]:
        if not self._was_reset:
            raise RuntimeError("call reset() before step()")
        parsed = parse_response(response, self.prompt_format)
        reason = parsed.reason
        format_ok = parsed.format_ok
        actions: list[str] = []
        unknown: list[str] = []
        executed = effective = 0
        env_reward = 0.0
        if self._done:
            reason = "episode already ended"
        elif format_ok:
            try:
                ap = self._parse_actions(parsed.answer or "")
            except Exception as e:  # a subclass parser must not take the env down on odd text
                ap = ActionParse(reason=f"unparsable answer: {type(e).__name__}")
            unknown = list(ap.unknown)
            if not ap.ok:
                format_ok, reason = False, ap.reason or "no action in the answer"
            else:
                actions = list(ap.actions[: self.max_actions_per_step])
                values = list(ap.values if ap.values is not None else ap.actions)[: len(actions)]
                for value in values:
                    result = self._apply_action(value)
                    self._state_cache = None
                    executed += 1
                    self.steps += 1
                    effective += int(bool(result.changed))
                    r = float(result.reward)
                    if self._is_success():
                        r += self.SUCCESS_REWARD
                    else:
                        r -= self.STEP_PENALTY
                    env_reward += r
                    if self._is_terminal() or self.steps >= self.max_steps:
                        break
        format_reward = FORMAT_REWARD if format_ok and not self._done else 0.0
        terminated = bool(self._is_terminal())
        truncated = bool(not terminated and self.steps >= self.max_steps)
        self._done = self._done or terminated or truncated
        self._last_actions = actions[:executed]
        env_reward = round(env_reward, 10)
        info = self._base_info()
        info.update({
            "format_ok": bool(format_ok), "reason": reason, "actions": actions, "unknown_actions": unknown,
            "actions_executed": executed, "actions_effective": effective,
            "env_reward": env_reward, "format_reward": format_reward,
            "think": parsed.think, "observation": parsed.observation, "reasoning": parsed.reasoning,
            "prediction": parsed.prediction, "answer": parsed.answer,
        })
        return self._observation(initial=False), env_reward + format_reward, terminated, truncated, info

    def render(self) -> np.ndarray | str:
        """The current frame, uint8 HxWx3 (rgb_array / vision mode), or the text observation's
        state text (ansi / text mode)."""
        if self.vision:
            return np.array(self._render_image(), dtype=np.uint8, order="C", copy=True)
        return self._text_slot()

    def _text_slot(self) -> str:
        """The state part of a text-mode observation: the env's own text rendering (a symbol grid,
        ``text_observation="render"``), or the true state in ``state_format`` (``"state"``: the
        very text an ``<observation>`` is judged against, so perception is handed to the policy)."""
        if self.text_observation == "state":
            return self.describe_state(self._current_state())
        return self._render_text()

    # ------------------------------------------------------------------ expert

    def simulate(self, values: Iterable[Any]) -> dict:
        """The state after executing ``values`` from the current state, leaving the env unchanged."""
        snap = self._snapshot()
        try:
            for v in values:
                self._apply_action(v)
                self._state_cache = None
                if self._is_terminal():
                    break
            return copy.deepcopy(self._current_state())
        finally:
            self._restore(snap)
            self._state_cache = None

    def expert_response(self, distinct_moves: bool = False) -> str:
        """A well-formed response: true observation, true prediction, the expert's next actions.

        The actions are the first ``max_actions_per_step`` of the expert's plan; with
        ``distinct_moves`` the plan's actions up to the first one that repeats an action already
        taken this turn (a closed-loop demonstrator: one step per direction, then it looks again,
        so each turn's answer follows from the relations it observed; it may need more turns)."""
        actions = [str(a) for a in self._expert_actions()][: self.max_actions_per_step]
        if distinct_moves:
            actions = actions[: next((i for i, a in enumerate(actions) if a in actions[:i]), len(actions))]
        if not actions and self.ACTIONS:
            actions = [self.ACTIONS[0]]
        observation = prediction = None
        if uses_observation(self.prompt_format):
            observation = self.describe_state(self._current_state())
        if uses_prediction(self.prompt_format):
            parsed = self._parse_actions(self.ACTION_SEP.join(actions))
            values = parsed.values if parsed.values is not None else parsed.actions
            prediction = self.describe_state(self.simulate(values))
        return build_response(self.prompt_format, answer=self.ACTION_SEP.join(actions),
                              observation=observation, reasoning=self._expert_reasoning(actions),
                              prediction=prediction)
