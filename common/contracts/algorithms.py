"""The one registry of the learner's algorithms by name: advantage estimators, KL estimators and
off-policy corrections.

A name is written here once. The config's allowed values come from here
(``TrainerConfig.estimator``, ``TrainerConfig.kl_estimator``); the learner registers one
implementation per name (``learner/advantages.py`` ``_FUNCTIONS``, ``learner/losses.py``
``kl_penalty``) and tests check that the two sets are equal. Code that must know what an estimator
needs asks its :class:`EstimatorSpec` (``grouped``, ``reads_values``, ``step_groups``,
``loss_on_observations``), never its name. A new estimator is one entry here and one function in
``learner/advantages.py``; a new KL estimator one entry here and one branch in ``kl_penalty``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EstimatorSpec:
    """What an advantage estimator needs from the rest of the learner."""

    name: str
    # baselines from the GRPO groups of the whole batch (``group_ids``): the batch is gathered whole
    # before the estimator runs, no critic values are read, advantages are not whitened again, and
    # ``trainer.whole_groups`` holds group members until a group is whole
    grouped: bool
    # per-turn step groups as well: the turns of a group that start from the same state (``anchors``)
    step_groups: bool
    # the loss mask also covers the observation tokens after the first response (vanilla PPO)
    loss_on_observations: bool
    summary: str

    @property
    def reads_values(self) -> bool:
        """Whether the estimator reads the critic's values (every estimator but the group ones)."""
        return not self.grouped


_ESTIMATORS = (
    EstimatorSpec("masked_gae", False, False, False, "token-level GAE over the response tokens (observations skipped)"),
    EstimatorSpec("bilevel_gae", False, False, False, "VAGEN Bi-Level GAE: turn-level GAE, then token-level GAE within a turn"),
    EstimatorSpec("turn_ppo", False, False, False, "turn-level GAE, each turn's advantage on all its tokens"),
    EstimatorSpec("grpo", True, False, False, "GRPO: the trajectory reward against its group's mean (and std)"),
    EstimatorSpec("gigpo", True, True, False, "GiGPO: grpo plus a per-turn baseline over the group's turns from the same state"),
    EstimatorSpec("vanilla_ppo", False, False, True, "token-level GAE over every token from the first response on"),
)
ESTIMATORS: dict[str, EstimatorSpec] = {s.name: s for s in _ESTIMATORS}
ESTIMATOR_NAMES: tuple[str, ...] = tuple(ESTIMATORS)

# the KL estimators the config accepts (``trainer.kl_estimator``), with what each computes on
# d = logp - ref; ``kl_penalty`` also takes the aliases k1, k2, k3
KL_ESTIMATORS: dict[str, str] = {
    "kl": "k1: d",
    "abs": "|k1|: |d|",
    "mse": "k2: d^2 / 2",
    "low_var_kl": "k3: exp(-d) + d - 1 (clamped)",
}
KL_ALIASES: dict[str, str] = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}
KL_ESTIMATOR_NAMES: tuple[str, ...] = tuple(KL_ESTIMATORS)

# the off-policy corrections of the policy loss (``trainer.off_policy``), each implemented in
# ``learner/offpolicy.py`` (``offpolicy_weights``; ``cap`` inside ``learner/losses.py`` ``policy_loss``)
OFF_POLICY_MODES: dict[str, str] = {
    "cap": "min(rho, C) per token: decoupled PPO's truncated importance weight (the default)",
    "tis": "min(rho, C) per token, divided by its mean over the batch's loss tokens",
    "seq_is_geo": "min(geometric mean of the trajectory's rho, C) on each of its tokens",
    "mis": "trajectories whose geometric mean rho leaves [low, high] rejected, the rest min(rho, C)",
    "icepop": "tokens whose rho leaves [low, high] rejected, the rest weighted by rho",
}
OFF_POLICY_NAMES: tuple[str, ...] = tuple(OFF_POLICY_MODES)


def estimator_spec(name: str) -> EstimatorSpec:
    """The spec of the estimator ``name``; a ValueError naming the key and the known names otherwise."""
    try:
        return ESTIMATORS[name]
    except (KeyError, TypeError):
        raise ValueError(f"trainer.estimator: unknown {name!r}, expected one of {', '.join(ESTIMATOR_NAMES)}") from None


def kl_estimator_name(kind: str) -> str:
    """The registry name of a KL estimator or its alias; a ValueError naming the known names otherwise."""
    name = KL_ALIASES.get(kind, kind)
    if name not in KL_ESTIMATORS:
        known = ", ".join((*KL_ESTIMATOR_NAMES, *KL_ALIASES))
        raise ValueError(f"kind: unknown KL estimator {kind!r}, expected one of {known}")
    return name
