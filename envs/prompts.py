"""The prompt builders shared by every worldloop environment (VAGEN App. B.1/B.2 wording).

Public API (stable; later changes only add)::

    format_prompt(prompt_format, max_actions, sep=",", *, example=None, state_hint="",
                  action_line=None) -> str     # the format instructions of the system prompt
    build_response(prompt_format, *, answer, think=None, observation=None, reasoning=None,
                   prediction=None) -> str     # a well-formed response (examples, demonstrations)
    user_message(slot, *, initial, valid_actions=None, context="", format_text="") -> str

A response :func:`build_response` writes is one :func:`worldloop.envs.parsing.parse_response` accepts
(tests/test_envs_parser.py round-trips every format). :class:`worldloop.envs.base.VisualEnv` puts
these pieces together into its system prompt and per-turn observations.
"""

from __future__ import annotations

from typing import Sequence

from worldloop.envs.parsing import THINK_FIELDS, uses_observation, uses_prediction

# format -> (description line, format line); wording of VAGEN App. B.1/B.2 and its code
_FORMAT_TEXT: dict[str, tuple[str, str]] = {
    "no_think": ("You should provide only your answer.", "<answer>...</answer>"),
    "free_think": ("You should first give your reasoning, and then your answer.", "<think>...</think><answer>...</answer>"),
    "grounding": (
        "You should first give the description of your observation, then your reasoning, and finally your answer.",
        "<think><observation>...</observation><reasoning>...</reasoning></think><answer>...</answer>",
    ),
    "worldmodeling": (
        "You should first give your reasoning, then predict the next state, and finally your answer.",
        "<think><reasoning>...</reasoning><prediction>...</prediction></think><answer>...</answer>",
    ),
    "grounding_worldmodeling": (
        "You should first give the description of your observation, then your reasoning, then predict the next "
        "state, and finally your answer.",
        "<think><observation>...</observation><reasoning>...</reasoning><prediction>...</prediction></think>"
        "<answer>...</answer>",
    ),
}


def format_prompt(
    prompt_format: str,
    max_actions: int,
    sep: str = ",",
    *,
    example: str | None = None,
    state_hint: str = "",
    action_line: str | None = None,
) -> str:
    """The format instructions of VAGEN App. B.2: action count, description, format, example."""
    description, fmt = _FORMAT_TEXT[prompt_format]
    lines = [action_line if action_line is not None else f"You can take up to {max_actions} action(s) at a time, separated by {sep}."]
    lines.append(description)
    if state_hint and (uses_observation(prompt_format) or uses_prediction(prompt_format)):
        lines.append(state_hint)
    lines += ["Your response should be in the format of:", fmt]
    if example:
        lines.append(f"e.g. {example}")
    return "\n".join(lines)


def build_response(
    prompt_format: str,
    *,
    answer: str,
    think: str | None = None,
    observation: str | None = None,
    reasoning: str | None = None,
    prediction: str | None = None,
) -> str:
    """A well-formed response in ``prompt_format`` (free_think uses ``think`` or else ``reasoning``)."""
    children = THINK_FIELDS[prompt_format]
    if children is None:
        head = f"<think>{think if think is not None else reasoning or ''}</think>"
    elif children:
        values = {"observation": observation, "reasoning": reasoning, "prediction": prediction}
        head = "<think>" + "".join(f"<{c}>{values[c] or ''}</{c}>" for c in children) + "</think>"
    else:
        head = ""
    return f"{head}<answer>{answer}</answer>"


def user_message(
    slot: str,
    *,
    initial: bool,
    valid_actions: Sequence[str] | None = None,
    context: str = "",
    format_text: str = "",
) -> str:
    """The per-turn user message (VAGEN App. B.2): ``slot`` is ``<image>`` or the text observation."""
    if initial:
        head = f"[Initial Observation]:\n{slot}\n"
    else:
        acts = ", ".join(valid_actions) if valid_actions else "none"
        head = f"After your answer, the extracted valid action is {acts}.\nAfter that, the observation is:\n{slot}\n"
    body = (context.strip() + "\n") if context and context.strip() else ""
    tail = f"\n{format_text}" if format_text else ""
    return f"{head}{body}Decide your next action(s).{tail}"
