"""The svg family's truth: the image elements the agent sees, and the similarity once rendered.

An SVG state (``state["structured"]``) lists the target image's elements (``target_elements``) and,
after the agent's code rendered, its own rendering's (``rendered_elements``) and the measured
``similarity``. The judge compares a text's (shape, colour) elements and predicted similarity with
them; a similarity within ``SIMILARITY_TOLERANCE`` of the measured one is right. This reading wins
over comparing number tuples (a similarity of 0.8 is not a coordinate). What an LLM judge is shown
is the env's sentences about the elements. ``worldloop eval`` reports SVG by its similarity metrics,
not by success.
"""
from __future__ import annotations

from worldloop.envs.family import PROMPT_FORMAT, PROMPT_PREDICTION_FIRST, EnvFamily, FamilyTruth

SIMILARITY_TOLERANCE = 0.1  # a predicted similarity this close to the measured one is right

SVG_GROUNDING = f"""Compare the description of the image with the groundtruth list of the elements the image shows.
Answer YES if the description identifies the main elements with their correct shapes and colors and roughly correct positions, or NO if it misses them or gets them wrong.

Groundtruth Current State Information:
{{state_information_dict}}

State Description:
{{natural_language_description}}

{PROMPT_FORMAT}"""

SVG_WORLDMODELING = f"""Compare the prediction of the image that the agent's SVG code will render with the groundtruth rendering.
Answer YES if the predicted elements match the rendered ones in shape and color and any predicted similarity is within 0.1 of the measured one, or NO otherwise.

{PROMPT_PREDICTION_FIRST}

Groundtruth Next State Information:
{{state_information_dict}}

Next State Prediction:
{{natural_language_description}}

{PROMPT_FORMAT}"""


class SVGFamily(EnvFamily):
    name = "svg"
    env_ids = {"worldloop/SVG-v0": "worldloop.envs.svg.env:SVGEnv"}
    prompts = {"svg": {"grounding": SVG_GROUNDING, "worldmodeling": SVG_WORLDMODELING}}
    own_prompt_always = True
    paper_max_turns = {"SVG": 2}  # VAGEN Table 15
    similarity_metrics = {"SVG": ("dino", "dreamsim", "pixel_similarity")}

    def truth(self, relations: list[str], symbolic: str | None, structured: dict) -> FamilyTruth | None:
        if not isinstance(structured.get("target_elements"), list):
            return None
        return FamilyTruth("svg", "elements", elements=structured, tolerance=SIMILARITY_TOLERANCE,
                           info=relations or structured, before_coordinates=True)


FAMILY = SVGFamily()
