"""The navigation family's truth: the target object's direction, and every visible object's.

A Navigation state (``state["structured"]``, App. D.1) names the target object and its direction to
the agent, and lists the visible objects with theirs. The truth is egocentric relations object vs
agent ("the toaster is ahead"): precision is measured against every visible object (``known``) and
recall only against the target (``essential``): the paper's judge asks for the target's direction, a
wrong claim about another object still costs precision. The words "target", "goal", "object",
"destination" and "item" mean the target; ``CounterTop`` may be written "counter top".
"""
from __future__ import annotations

import re

from worldloop.envs.family import PROMPT_FORMAT, PROMPT_PREDICTION_FIRST, EnvFamily, FamilyTruth

TARGET_KEYS = ("target_obj_type", "target_object_type", "target_type", "target_object", "target_name")
DIRECTION_KEYS = ("target_direction_to_player", "target_direction", "direction_to_target")
ALIASES = ("target", "goal", "object", "destination", "item")

NAVIGATION_GROUNDING = f"""Evaluate whether the description effectively communicates the spatial relationship between the agent and target object, even if the exact directional terms differ.
Answer YES if the overall spatial understanding is correct, or NO if it fundamentally misunderstands the spatial layout.

Context
You are evaluating whether the description effectively conveys where the target object is located relative to the agent. The exact directional terminology (left, right, ahead, etc.) may differ between the state information and the description, but the important factor is whether the description would lead to correct navigation.

Groundtruth Current State Information:
{{state_information_dict}}

State Description:
{{natural_language_description}}

Think step by step:
1. Check if the description contains spatial relationship between agent and target object
 - If no spatial relationship is mentioned, answer NO
2. If spatial relationship exists, check if the predicted direction is consistent with the target direction
 - "ahead/forward" = "ahead"
 - "left" = "left"
 - "right" = "right"
 - Combined directions like "forward-left", "forward-right" are acceptable if they include the correct primary direction
3. The prediction is correct if it mentions moving toward the target in a direction that reasonably aligns with the groundtruth direction

{PROMPT_FORMAT}"""

NAVIGATION_WORLDMODELING = f"""Evaluate whether the prediction effectively anticipates how the agent would navigate toward the target object, even if the exact directional terms differ.
Answer YES if the overall navigation plan is reasonable, or NO if it misunderstands or did not mention the spatial layout.

Context
You are evaluating whether the prediction effectively anticipates how the agent would move to reach the target object. The exact directional terminology (left, right, ahead, etc.) may differ between the state information and the prediction, but the important factor is whether the prediction would lead to successful navigation.

{PROMPT_PREDICTION_FIRST}

# Groundtruth Next State Information:
{{state_information_dict}}

# Next State Prediction:
{{natural_language_description}}

Think step by step:
1. First, check if the prediction explicitly uses EXACT directional terms that appear in the groundtruth state: "ahead", "left", "right", "up", "down".
 - Terms like "move towards", "closer to", "near", "approaching", "in front of", "by", "at" DO NOT qualify
 - "Will be on the left/right/ahead" or "Will move left/right/forward" DO qualify
 - If no exact directional match to groundtruth is present, conclude with NO immediately
2. If explicit direction words exist, verify that they EXACTLY match the target object's direction in the groundtruth:
 - If target is "ahead", prediction must specify "ahead", "forward", "slightly left", OR "slightly right" (special case: we allow slightly left/right for ahead targets)
 - If target is "right", prediction must specify "right"
 - If target is "left", prediction must specify "left"
3. Even if the prediction mentions intermediate objects correctly, it MUST explicitly state the correct final direction to the target object
4. The prediction cannot substitute object references for directions (saying "move to X" instead of "move right")
5. Remember that the prediction was made BEFORE the groundtruth state was determined

{PROMPT_FORMAT}"""


def object_id(name: str) -> tuple[str, list[tuple[str, ...]]]:
    """``CounterTop`` -> id ``countertop`` with surfaces ("countertop",), ("counter", "top")."""
    spaced = re.sub(r"(?<=[a-z])(?=[A-Z])", " ", str(name)).lower()
    words = re.findall(r"[a-z]+", spaced)
    oid = "".join(words) or "object"
    surfaces = [tuple(words)] if len(words) > 1 else []
    return oid, surfaces


class NavigationFamily(EnvFamily):
    name = "navigation"
    env_ids = {"worldloop/Navigation-v0": "worldloop.envs.navigation.env:NavigationEnv"}
    prompts = {"navigation": {"grounding": NAVIGATION_GROUNDING, "worldmodeling": NAVIGATION_WORLDMODELING}}
    paper_max_turns = {"Navigation": 4}  # VAGEN Table 11

    def truth(self, relations: list[str], symbolic: str | None, structured: dict) -> FamilyTruth | None:
        tkey = next((k for k in TARGET_KEYS if isinstance(structured.get(k), str)), None)
        dkey = next((k for k in DIRECTION_KEYS if isinstance(structured.get(k), str)), None)
        if tkey is None or dkey is None:
            return None
        target, surfaces = object_id(structured[tkey])
        ids = ["player", target]
        multi: dict[tuple[str, ...], str] = {s: target for s in surfaces}
        objects: list[tuple[str, str, str]] = [(target, structured[dkey], "player")]
        for o in structured.get("visible_objects") or []:
            if not isinstance(o, dict) or not isinstance(o.get("type"), str):
                continue
            oid, osurf = object_id(o["type"])
            direction = o.get("direction_to_player") or o.get("direction")
            if isinstance(direction, str):
                objects.append((oid, direction, "player"))
            if oid not in ids:
                ids.append(oid)
            multi.update({s: oid for s in osurf})
        return FamilyTruth("navigation", "directions", known=objects, essential=objects[:1], entities=ids,
                           surfaces=multi, aliases={a: target for a in ALIASES}, implicit="player", info=structured)


FAMILY = NavigationFamily()
