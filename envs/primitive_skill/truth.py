"""The primitive_skill family's truth: coordinates within 10 units count (VAGEN App. D.1).

PrimitiveSkill's states use the shared formats (a structured dict of object positions, relation
sentences); the family owns its env id, the coordinate tolerance (a predicted position within +-10
units of the true one is right), the YES/NO prompts of App. D.1.1 (used also when the text is a
dict: they state the tolerance) and the paper's turn limit.
"""
from __future__ import annotations

from worldloop.envs.family import PROMPT_FORMAT, PROMPT_PREDICTION_FIRST, EnvFamily

CRITERIA = """1. If the {what} includes coordinates, they don't need to be exact matches with the groundtruth
2. For coordinate values, consider them correct if they are within these error tolerances:
 - For x and y coordinates: within +10 or -10 units of groundtruth
 - For z coordinates: within +10 or -10 units of groundtruth"""

PRIMITIVESKILL_GROUNDING = f"""Compare the description of the current state with the groundtruth current state information.
Answer YES if the description reasonably matches the current state information, or NO if it doesn't.

Context
You are evaluating whether an agent's description accurately reflects the actual state. The description should capture the meaningful relationships and positions relevant for decision-making in the task.

Important evaluation criteria:
{CRITERIA.format(what="description")}
3. The overall spatial relationships and object identifications should be correct
4. If the description includes a dict-formatted state information, that's good but not required

Groundtruth Current State Information:
{{state_information_dict}}

State Description:
{{natural_language_description}}

Think step by step:
1. Identify the key objects and their positions in the groundtruth information
2. Check if the description correctly identifies these objects
3. For any coordinates mentioned, check if they are within the acceptable error range
4. Determine if the overall spatial understanding is correct, even if specific numbers differ slightly
5. If coordinates in the description differ from groundtruth but are within the error tolerance, consider them correct

{PROMPT_FORMAT}"""

PRIMITIVESKILL_WORLDMODELING = f"""Compare the prediction of the next state with the groundtruth next state information.
Answer YES if the prediction reasonably matches the next state information, or NO if it doesn't.

Context
You are evaluating whether an agent's prediction of the next state is accurate. The prediction should capture the meaningful changes and relationships that will result from the planned actions.

{PROMPT_PREDICTION_FIRST}

Important evaluation criteria:
{CRITERIA.format(what="prediction")}
3. The overall predicted movements and resulting spatial relationships should be correct
4. If the prediction includes a dict-formatted state information, that's good but not required

# Groundtruth Next State Information:
{{state_information_dict}}

# Next State Prediction:
{{natural_language_description}}

Think step by step:
1. Identify the key objects and their positions in the groundtruth next state information
2. Check if the prediction correctly anticipates these object positions
3. For any coordinates mentioned, check if they are within the acceptable error range
4. Determine if the overall predicted movement and resulting state is correct, even if specific numbers differ slightly
5. If coordinates in the prediction differ from groundtruth but are within the error tolerance, consider them correct

{PROMPT_FORMAT}"""


class PrimitiveSkillFamily(EnvFamily):
    name = "primitive_skill"
    env_ids = {"worldloop/PrimitiveSkill-v0": "worldloop.envs.primitive_skill.env:PrimitiveSkillEnv"}
    coord_tolerance = 10.0  # App. D.1: within +-10 units
    prompts = {"primitiveskill": {"grounding": PRIMITIVESKILL_GROUNDING, "worldmodeling": PRIMITIVESKILL_WORLDMODELING}}
    own_prompt_always = True
    paper_max_turns = {"PrimitiveSkill": 3}  # VAGEN Table 13


FAMILY = PrimitiveSkillFamily()
