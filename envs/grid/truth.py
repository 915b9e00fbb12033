"""The grid family's truth (Sokoban, FrozenLake, Maze, Taxi): what the judge and the evaluator know of it.

The grid envs' states use the shared formats of the env contract (relation sentences, a symbolic
grid, a structured dict), so the family needs no truth code of its own; it owns its env ids, the
words its objects go by, VAGEN's reward rules for Sokoban and FrozenLake (``judge.rule_mode: vagen``),
FrozenLake's ``local`` prompt (``judge.rule_mode: local``), which ``relation_prompt`` follows each rule
mode, the YES/NO prompts of VAGEN App. D.1.1 for Sokoban and FrozenLake (Maze and Taxi use the
judge's default grid prompt) and the paper's turn limits.
"""
from __future__ import annotations

from worldloop.envs.family import PROMPT_EQUIV, PROMPT_FORMAT, PROMPT_PREDICTION_FIRST, EnvFamily, VagenRule

RELATIVE = """1. Relative Relationship Requirements:
 - Must describe at least one relationships BETWEEN entities (player-box, player-target, box-target)
 - Absolute positions like "player is on the left side" are insufficient
 - Need relational descriptions like "player is left of target"
2. Essential Relationships to Check
 - Player-Target relationship (highest priority)
 - Player-Box relationship
 - Box-Target relationship"""


SOKOBAN_GROUNDING = f"""Evaluate whether the description accurately captures the key position relationships in the Sokoban game state.
Answer YES if the directional relationships are correct, or NO if they contain directional errors.

Context
You are evaluating whether the description correctly identifies the directional relationships between:
1. The player and the box(es)
2. The box(es) and the target(s)
The description doesn't need to be perfectly precise or mention every detail - it just needs to have the correct directional relationships (Up, Down, Left, Right).

Example:
Groundtruth Current State Information: ['box0 is at the same row and to the left of the player', 'target0 is above and on the left side of the player', 'target0 is above and on the left side of box0']
State Description: The player is below the box and the target is below the box.
<think>The state description contains spatial relationship information, do further analysis. According to the ground truth data, box0 is at the same row and to the left of the player, target0 is above and on the left side of the player, target0 is above and on the left side of box0. The description states 'The player is below the box and the target is below the box.' The player is actually at the same row as the box (not below), and the target is actually above the box (not below). Both directional relationships are incorrectly identified.</think><answer>NO</answer>

Example:
Groundtruth Current State Information: ['box0 is above and on the right side of the player', 'target0 is above and at the same column as the player', 'target0 is above and on the left side of box0']
State Description: The box is above the player and the target is to the left of the box
<think>The state description contains spatial relationship information, do further analysis. According to the ground truth data, box0 is above and on the right side of the player, target0 is above and at the same column as the player, target0 is above and on the left side of box0. The description states 'The box is above the player and the target is to the left of the box.' It correctly identifies that the box is above the player (box0 is above and on the right side of the player). It also correctly identifies that the target is to the left of the box (target0 is above and on the left side of box0). Both key directional relationships are accurately described.</think><answer>YES</answer>

Groundtruth Current State Information:
{{state_information_dict}}

State Description:
{{natural_language_description}}

Think step by step:
{RELATIVE}
{PROMPT_EQUIV}

{PROMPT_FORMAT}"""

SOKOBAN_WORLDMODELING = f"""Evaluate whether the prediction correctly anticipates the key position relationships that will exist in the next Sokoban state.
Answer YES if the predicted directional relationships are correct, or NO if they contain directional errors.

Context
You are evaluating whether the prediction correctly identifies the directional relationships that will exist after the move:
1. The future position of the player relative to the box(es)
2. The future position of the box(es) relative to the target(s)

{PROMPT_PREDICTION_FIRST}
If the box and target are at same position, this prediction is seen as success immediately (YES)

Example:
Groundtruth Next State Information: ['box0 is above and on the right side of the player', 'target0 is above and on the left side of the player', 'target0 is above and on the left side of box0']
Next State Prediction: The player will be to the left of the box, and the box will be to the right of the target.
<think>The prediction state contains spatial relationship between player and target, do further analysis. According to the ground truth data, box0 is above and on the right side of the player, target0 is above and on the left side of the player, target0 is above and on the left side of box0. The description states 'The player will be to the left of the box, and the box will be to the right of the target.' It correctly identifies that the player is to the left of the box (since box0 is on the right side of the player). It also correctly identifies that the box is to the right of the target (since target0 is on the left side of box0). Therefore, this description correctly identifies the key directional relationships.</think><answer>YES</answer>

Groundtruth Next State Information:
{{state_information_dict}}

Next State Prediction:
{{natural_language_description}}

Think step by step:
{RELATIVE}
{PROMPT_EQUIV}

{PROMPT_FORMAT}"""

FROZENLAKE_GROUNDING = f"""Evaluate whether the description accurately captures the key position relationships in the FrozenLake game state.
Answer YES if the directional relationships are correct, or NO if there are errors.

Context
You are evaluating whether the description correctly identifies:
1. The directional relationship between the player and the goal (MUST Have)
2. The directional relationship between the player and the hole (if present)
The description doesn't need to be perfectly precise - it just needs to have the correct directional relationships between the player and target (Up, Down, Left, Right), and between the player and hole if applicable.

Groundtruth Current State Information:
{{state_information_dict}}

State Description:
{{natural_language_description}}

Think step by step:
1. Player relationship with Goal
 - Goal (Target) MUST include in state description, without target the description is automatically wrong (NO)
 - If there is no direction between player and goal, like "player is right to the target", the description is automatically wrong (NO)
 - This takes highest priority over all other considerations
2. Equivalent Expression Recognition
 - "goal is above player" = "player is below goal"
 - "target is left of box" = "box is right of target"
 - Must recognize these as identical spatial relationships. Absolute position is not allowed
3. Simple Judgment Rule
 - If player at goal -> YES
 - If direction aligns with needed movement -> YES
 - Otherwise -> NO

{PROMPT_FORMAT}"""

FROZENLAKE_WORLDMODELING = f"""Evaluate whether the prediction correctly anticipates the key aspects of the next FrozenLake state.
Answer YES if the prediction accounts for directional relationships and potential holes, or NO if it contains errors.

Context
You are evaluating whether the prediction correctly identifies:
1. The position relationship between the player and the goal after the prediction

{PROMPT_PREDICTION_FIRST}
The prediction doesn't need to perfectly describe every aspect of the next state - it just needs to correctly anticipate the directional relationships (Up, Down, Left, Right) or address any dangers from holes.

Groundtruth Next State Information:
{{state_information_dict}}

Next State Prediction:
{{natural_language_description}}

Think step by step:
1. Player relationship with Goal
 - If player is already at the goal position, the prediction is automatically correct (YES)
 - Goal (Target) MUST include in prediction state, without target the prediction is automatically wrong (NO)
 - If there is no direction between player and goal, like "player is right to the target", the prediction is automatically wrong (NO)
 - This takes highest priority over all other considerations
2. Directional Correctness
 - Evaluate if the predicted movement direction aligns with the relative position between player and goal
 - For example, if player is left of goal, moving right is correct
 - CRITICAL: Recognize equivalent expressions of the same spatial relationship
   * "player is above target" = "target is below player"
   * "player is left of target" = "target is right of player"
   * These are the SAME relationship expressed from different perspectives
3. Simple Judgment Rule
 - If player at goal -> YES
 - If direction aligns with needed movement -> YES
 - Otherwise -> NO

{PROMPT_FORMAT}"""


class GridFamily(EnvFamily):
    name = "grid"
    env_ids = {"worldloop/Sokoban-v0": "worldloop.envs.grid.sokoban:SokobanEnv",
               "worldloop/FrozenLake-v0": "worldloop.envs.grid.frozenlake:FrozenLakeEnv",
               "worldloop/Maze-v0": "worldloop.envs.grid.maze:MazeEnv",
               "worldloop/Taxi-v0": "worldloop.envs.grid.taxi:TaxiEnv"}
    object_types = {"box": "box boxes crate crates",
                    "target": "target targets goal goals destination destinations exit flag storage",
                    "hole": "hole holes pit pits"}
    # VAGEN's object types per env and their weights (Sokoban: plain mean of two F1s)
    vagen = {"sokoban": VagenRule({"target": 0.5, "box": 0.5}, "greedy"),
             "frozenlake": VagenRule({"target": 0.7, "hole": 0.3}, "bipartite")}
    local_envs = ("frozenlake",)  # the envs whose relation_prompt offers "local" (LOCAL_NL_HINT)
    # judge.rule_mode -> the envs whose relation_prompt follows it (VAGEN_NL_HINT / LOCAL_NL_HINT set)
    relation_prompts = {"vagen": ("worldloop/Sokoban-v0", "worldloop/FrozenLake-v0"),
                        "local": ("worldloop/FrozenLake-v0",)}
    prompts = {"sokoban": {"grounding": SOKOBAN_GROUNDING, "worldmodeling": SOKOBAN_WORLDMODELING},
               "frozenlake": {"grounding": FROZENLAKE_GROUNDING, "worldmodeling": FROZENLAKE_WORLDMODELING}}
    paper_max_turns = {"Sokoban": 3, "FrozenLake": 3}  # VAGEN Tables 7 and 9


FAMILY = GridFamily()
