"""The config's cross-field rules, all in one place: what no single field can check alone.

A field's own bound stands on the field (:mod:`worldloop.common.contracts.config`); a rule that ties two
or more keys together is a function here, listed in :data:`CROSS_CHECKS` in the order it runs.
Its docstring is the rule in prose: ``tools/gen_config_docs.py`` copies it into
``docs/configuration.md``. Each raises :class:`ConfigError` on the key to change.

:func:`pass_rule_mode` runs first: it hands ``judge.rule_mode`` to the envs whose prompt must ask
for what the judge scores. The seed-range helpers (:func:`training_seed_ranges`,
:func:`check_held_out_seeds`) are also used by the evaluation benches.

The functions take the loaded ``Config`` (typed loosely here: this module sits below the schema).

Three constants below belong to layers above the contracts, yet stay here, because a rule here needs
them and a contract imports nothing above it (``tools/check_layers.py``): ``SFT_PROBE_SEEDS`` and
``GROUNDING_EVAL_BOARDS`` size seed ranges the checks keep apart, and the bootstrap
(``worldloop/bootstrap/pipeline.py``) imports them from here, so each has one value;
``RELATION_PROMPT_ENVS`` is a copy of the grid env family's declaration
(``worldloop.envs.grid.truth``, ``GridFamily.relation_prompts``, which owns it), applied at load time,
before any env is imported; ``tests/test_env_family_registry.py`` checks that the copy equals the
family's declaration and what the env classes offer.
"""

from __future__ import annotations

from typing import Any, Callable

from worldloop.common.contracts.algorithms import estimator_spec
from worldloop.common.contracts.config_fields import ConfigError

SFT_PROBE_SEEDS = 8  # format probes played after the demonstrations (worldloop/bootstrap/pipeline.py warm_start)
GROUNDING_EVAL_BOARDS = 256  # held-out boards of grounding pre-training (worldloop/bootstrap/grounding.py)
# the envs whose prompt follows judge.rule_mode (their kwarg relation_prompt, envs/grid/grid_env.py), per mode:
# the grid family's GridFamily.relation_prompts (envs/grid/truth.py), copied (see the module docstring)
RELATION_PROMPT_ENVS = {"vagen": ("worldloop/Sokoban-v0", "worldloop/FrozenLake-v0"),
                        "local": ("worldloop/FrozenLake-v0",)}


def pass_rule_mode(cfg: Any) -> None:
    """`judge.rule_mode: vagen` puts `relation_prompt: vagen` into the kwargs of every Sokoban and
    FrozenLake env in `actor.envs`, and `judge.rule_mode: local` puts `relation_prompt: local` into
    those of every FrozenLake env (Sokoban keeps its default relations there), so that the prompt
    asks for exactly the relations the judge scores (the actors, the SFT demonstrations, grounding
    pre-training and `worldloop eval` all build their envs from there); an explicit
    `relation_prompt` that contradicts `judge.rule_mode` is an error."""
    envs = {e for ids in RELATION_PROMPT_ENVS.values() for e in ids}
    for i, spec in enumerate(cfg.actor.envs):
        if spec.id not in envs:
            continue
        want = cfg.judge.rule_mode if spec.id in RELATION_PROMPT_ENVS.get(cfg.judge.rule_mode, ()) else "default"
        have = spec.kwargs.get("relation_prompt", want)
        if have != want:
            raise ConfigError(f"actor.envs[{i}].kwargs.relation_prompt",
                              f"is {have!r} but judge.rule_mode is {cfg.judge.rule_mode!r}: the prompt must ask for what "
                              "the judge scores (set judge.rule_mode and leave relation_prompt out, the config passes it)")
        if want != "default":
            spec.kwargs["relation_prompt"] = want


# --------------------------------------------------------------------------- batch sizes


def check_mini_batch(cfg: Any) -> None:
    """`trainer.ppo_mini_batch_size` divides `trainer.train_batch_size`, and
    `trainer.micro_batch_size` divides `trainer.ppo_mini_batch_size`."""
    t = cfg.trainer
    if t.train_batch_size % t.ppo_mini_batch_size:
        raise ConfigError("trainer.ppo_mini_batch_size",
                          f"must divide trainer.train_batch_size ({t.train_batch_size}), got {t.ppo_mini_batch_size}")
    if t.ppo_mini_batch_size % t.micro_batch_size:
        raise ConfigError("trainer.micro_batch_size",
                          f"must divide trainer.ppo_mini_batch_size ({t.ppo_mini_batch_size}), got {t.micro_batch_size}")


def held_group_size(cfg: Any) -> int:
    """The GRPO group size the learner's reader holds members for until a group is whole
    (``trainer.filter_groups``, or ``trainer.whole_groups`` with estimator grpo or gigpo), or 0 when
    it batches in arrival order (no groups, or neither knob applies)."""
    t, n = cfg.trainer, cfg.actor.n_samples_per_seed
    grouped = t.filter_groups or (t.whole_groups and estimator_spec(t.estimator).grouped)
    return n if grouped and n >= 2 else 0


def check_groups(cfg: Any) -> None:
    """`trainer.filter_groups` needs groups (`actor.n_samples_per_seed` >= 2). When the learner
    batches whole groups (`trainer.filter_groups`, or `trainer.whole_groups` with estimator grpo or
    gigpo and groups of 2 or more), `trainer.train_batch_size` is a multiple of `actor.n_samples_per_seed`."""
    t = cfg.trainer
    if t.filter_groups and cfg.actor.n_samples_per_seed < 2:
        raise ConfigError("trainer.filter_groups", "needs groups: set actor.n_samples_per_seed >= 2 "
                          f"(got {cfg.actor.n_samples_per_seed})")
    size = held_group_size(cfg)
    if size and t.train_batch_size % size:
        key = "trainer.filter_groups" if t.filter_groups else "trainer.whole_groups"
        raise ConfigError(key, f"trains whole groups: trainer.train_batch_size ({t.train_batch_size}) must be a "
                          f"multiple of actor.n_samples_per_seed ({size})"
                          + ("" if t.filter_groups else "; or set trainer.whole_groups: false"))


def check_kl_loss(cfg: Any) -> None:
    """The `kl` (k1) estimator cannot be a loss term (`trainer.kl_in_reward: false` with
    `trainer.kl_coef` > 0): its gradient on fixed samples lowers every sampled token's probability
    (a tiny run's KL term went to -20 and the policy collapsed to one repeated token); use
    `low_var_kl` or `mse` there, or keep the KL in the reward."""
    t = cfg.trainer
    if not t.kl_in_reward and t.kl_coef > 0 and t.kl_estimator == "kl":
        raise ConfigError("trainer.kl_estimator", "the 'kl' (k1) estimator cannot be a loss term "
                          "(trainer.kl_in_reward: false): its gradient lowers every sampled token's probability; "
                          "use low_var_kl or mse, or keep the KL in the reward")


def check_off_policy(cfg: Any) -> None:
    """`trainer.off_policy_low` is below `trainer.off_policy_high` (each field already keeps 1 inside
    the band, so on-policy tokens are never rejected; equal bounds would keep only ratios of exactly
    1). The band is read only by `trainer.off_policy` `mis` and `icepop`: with another mode a band
    set away from its defaults is an error (it would do nothing)."""
    t = cfg.trainer
    if not t.off_policy_low < t.off_policy_high:
        raise ConfigError("trainer.off_policy_low", f"must be below trainer.off_policy_high ({t.off_policy_high}), "
                          f"got {t.off_policy_low}: the accepted ratio band [low, high] would be empty or one point")
    fields = type(t).model_fields
    if t.off_policy not in ("mis", "icepop"):
        for key in ("off_policy_low", "off_policy_high"):
            if getattr(t, key) != fields[key].default:
                raise ConfigError(f"trainer.{key}", f"is only read by trainer.off_policy mis or icepop (it is "
                                  f"{t.off_policy!r}): remove it or choose one of those")


def check_observation_advantage(cfg: Any) -> None:
    """`trainer.observation_advantage: grounding` needs the judge's grounding scores
    (`judge.enabled`), `trainer.reasoning_advantage: outlook` its outlook scores. They and estimator
    `gigpo` compare turns within GRPO groups, so they need
    groups (`actor.n_samples_per_seed` >= 2): alone, a turn's baseline is itself."""
    t = cfg.trainer
    if t.observation_advantage == "grounding" and not cfg.judge.enabled:
        raise ConfigError("trainer.observation_advantage", "grounding needs the judge's grounding scores: set judge.enabled "
                          "true, or observation_advantage task")
    if t.reasoning_advantage == "outlook" and not cfg.judge.enabled:
        raise ConfigError("trainer.reasoning_advantage", "outlook needs the judge's outlook scores: set judge.enabled "
                          "true, or reasoning_advantage task")
    step_groups = estimator_spec(t.estimator).step_groups
    spans = {"trainer.observation_advantage": t.observation_advantage == "grounding",
             "trainer.reasoning_advantage": t.reasoning_advantage == "outlook"}
    if (any(spans.values()) or step_groups) and cfg.actor.n_samples_per_seed < 2:
        key = "trainer.estimator" if step_groups else next(k for k, on in spans.items() if on)
        raise ConfigError(key, "compares turns within GRPO groups: set actor.n_samples_per_seed >= 2 "
                          f"(got {cfg.actor.n_samples_per_seed})")


def check_env_weights(cfg: Any) -> None:
    """The `weight`s of `actor.envs` have a positive sum (each is >= 0: some env must be drawn)."""
    if sum(spec.weight for spec in cfg.actor.envs) <= 0:
        raise ConfigError("actor.envs", "the envs' weights must have a positive sum (each is >= 0), got "
                          f"{[spec.weight for spec in cfg.actor.envs]}")


# --------------------------------------------------------------------------- seed ranges


def _rl_seeds(cfg: Any) -> tuple[str, int, int]:
    return ("the RL seeds [actor.seed_start, actor.seed_end)", cfg.actor.seed_start, cfg.actor.seed_end)


def _rl_and_eval_seeds(cfg: Any) -> list[tuple[str, int, int]]:
    return [_rl_seeds(cfg),
            ("the held-out eval seeds [eval.seed_start, eval.seed_start + eval.episodes)", cfg.eval.seed_start,
             cfg.eval.seed_start + cfg.eval.episodes)]


def _check_disjoint(key: str, label: str, lo: int, hi: int, others: list[tuple[str, int, int]]) -> None:
    """ConfigError on ``key`` when the seed range [lo, hi) overlaps any of ``others`` (name, lo, hi)."""
    for what, lo2, hi2 in others:
        if lo < hi2 and lo2 < hi:
            raise ConfigError(key, f"{label} [{lo}, {hi}) overlap {what} = [{lo2}, {hi2})")


def _demonstration_seeds(cfg: Any) -> tuple[int, int]:
    """[lo, hi) of the SFT demonstrations (drawn from ``sft.level_pool`` x episodes seeds) and the format probes
    played after them."""
    return cfg.sft.seed_start, cfg.sft.seed_start + cfg.sft.level_pool * cfg.sft.episodes + SFT_PROBE_SEEDS


def _grounding_seeds(cfg: Any) -> tuple[int, int]:
    """[lo, hi) of the grounding pre-training levels and the boards it is evaluated on."""
    m = cfg.model
    return m.tiny_grounding_seed_start, (m.tiny_grounding_seed_start + m.tiny_grounding_steps * m.tiny_grounding_batch_size
                                         + GROUNDING_EVAL_BOARDS)


def check_rl_seeds(cfg: Any) -> None:
    """The RL seeds [`actor.seed_start`, `actor.seed_end`) are a non-empty range, and
    `eval.seed_start` lies outside it (held-out levels are never trained on)."""
    if cfg.actor.seed_end <= cfg.actor.seed_start:
        raise ConfigError("actor.seed_end", "must be greater than actor.seed_start")
    if cfg.actor.seed_start <= cfg.eval.seed_start < cfg.actor.seed_end:
        raise ConfigError("eval.seed_start", "must lie outside the training seed range [actor.seed_start, actor.seed_end)")


def check_demonstration_seeds(cfg: Any) -> None:
    """With `sft.enabled`, the demonstration seeds [`sft.seed_start`, `sft.seed_start` +
    `sft.level_pool` x `sft.episodes` + `SFT_PROBE_SEEDS` = 8 format probes) overlap neither the RL seeds nor the held-out eval seeds
    [`eval.seed_start`, `eval.seed_start` + `eval.episodes`)."""
    if not cfg.sft.enabled:
        return
    _check_disjoint("sft.seed_start", "demonstration seeds", *_demonstration_seeds(cfg), _rl_and_eval_seeds(cfg))


def check_grounding_seeds(cfg: Any) -> None:
    """With `model.tiny_grounding_steps` > 0, the grounding pre-training levels
    [`model.tiny_grounding_seed_start`, + steps x `model.tiny_grounding_batch_size` + `GROUNDING_EVAL_BOARDS` =
    256 held-out boards) overlap none of the RL, held-out eval or (with `sft.enabled`) demonstration seeds."""
    if not cfg.model.tiny_grounding_steps:
        return
    others = _rl_and_eval_seeds(cfg)
    if cfg.sft.enabled:
        others.append(("the SFT demonstration seeds", *_demonstration_seeds(cfg)))
    _check_disjoint("model.tiny_grounding_seed_start", "grounding pre-training seeds", *_grounding_seeds(cfg), others)


def check_evaluator_seeds(cfg: Any) -> None:
    """With `trainer.eval_every` > 0, the run evaluator's held-out seeds [`eval.seed_start`, +
    the larger of `trainer.eval_episodes` and `trainer.final_eval_episodes`) overlap none of the RL,
    demonstration or grounding pre-training seeds."""
    t = cfg.trainer
    if t.eval_every <= 0:
        return
    n = max(t.eval_episodes, t.final_eval_episodes or 0)
    _check_disjoint("eval.seed_start", "the run evaluator's held-out seeds", cfg.eval.seed_start, cfg.eval.seed_start + n,
                    training_seed_ranges(cfg))


def training_seed_ranges(cfg: Any) -> list[tuple[str, int, int]]:
    """(what, lo, hi) of every seed range a run trains on: RL, and the SFT demonstrations and
    grounding pre-training levels where they are on. Held-out seeds must miss all of them."""
    out = [_rl_seeds(cfg)]
    if cfg.sft.enabled:
        out.append(("the SFT demonstration seeds", *_demonstration_seeds(cfg)))
    if cfg.model.tiny_grounding_steps:
        out.append(("the grounding pre-training seeds", *_grounding_seeds(cfg)))
    return out


def check_held_out_seeds(cfg: Any, lo: int, n: int, key: str = "eval.seed_start") -> None:
    """ConfigError on ``key`` when the held-out seeds [lo, lo + n) overlap a training range."""
    _check_disjoint(key, "held-out seeds", lo, lo + n, training_seed_ranges(cfg))


# --------------------------------------------------------------------------- lengths


def check_lengths(cfg: Any) -> None:
    """`actor.max_new_tokens` is less than `model.max_model_len`: a turn's reply has to fit the
    context with its prompt."""
    if cfg.actor.max_new_tokens >= cfg.model.max_model_len:
        raise ConfigError("actor.max_new_tokens", f"must be less than model.max_model_len ({cfg.model.max_model_len}), "
                                                  f"got {cfg.actor.max_new_tokens}")


def check_lora(cfg: Any) -> None:
    """`model.lora.rank` > 0 (LoRA) trains with `trainer.zero_stage` 0-2 (the adapters are small;
    ZeRO-3's sharded base weights would have to be gathered for every merge). The learner then
    publishes adapter-only versions, which every actor backend applies: `hf`, `vllm` and the
    inference servers of `actor.backend: server` (`worldloop serve`, which serve each version as
    their LoRA adapter). vLLM adapts the language model only, so with `vllm` or `server`
    `model.lora.vision` must be false (`worldloop serve` checks it too, whatever `actor.backend`)."""
    if cfg.model.lora.rank == 0:
        return
    if cfg.trainer.zero_stage == 3:
        raise ConfigError("trainer.zero_stage", "LoRA (model.lora.rank > 0) runs with ZeRO stage 0-2, got 3")
    if cfg.actor.backend in ("vllm", "server") and cfg.model.lora.vision:
        raise ConfigError("model.lora.vision", f"the {cfg.actor.backend} backend (vLLM) applies LoRA adapters to the "
                                               "language model only")


# --------------------------------------------------------------------------- the weight channel


def check_curve_keys(cfg: Any) -> None:
    """ZeroMQ CURVE keys come in pairs: an actor's client key (`weights.curve_client_secret`) needs
    the server's public key (`weights.curve_server_public`), and a learner that admits only some
    client keys (`weights.curve_client_public`) needs the server's secret key
    (`weights.curve_server_secret`). Each side names only its own files: an actor never needs the
    server's secret key."""
    w = cfg.weights
    if w.curve_client_secret and not w.curve_server_public:
        raise ConfigError("weights.curve_server_public", "an actor's CURVE client key needs the server's public key file")
    if w.curve_client_public and not w.curve_server_secret:
        raise ConfigError("weights.curve_server_secret", "admitting CURVE client keys needs the server's secret key file")


CROSS_CHECKS: tuple[Callable[[Any], None], ...] = (
    check_mini_batch, check_groups, check_kl_loss, check_off_policy, check_observation_advantage, check_env_weights,
    check_rl_seeds, check_demonstration_seeds, check_grounding_seeds, check_evaluator_seeds, check_lengths, check_lora,
    check_curve_keys,
)


def cross_check(cfg: Any) -> None:
    """Run every rule of :data:`CROSS_CHECKS`; the first broken one raises."""
    for check in CROSS_CHECKS:
        check(cfg)
