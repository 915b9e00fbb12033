"""The learner's section of the configuration (``trainer``): PPO/GRPO updates, off-policy
correction, checkpoints and the evaluation while training. Split from
:mod:`worldloop.common.contracts.config` (which re-exports :class:`TrainerConfig`) so that each file
stays readable; the field rules are those of :mod:`worldloop.common.contracts.config_fields`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from worldloop.common.contracts.algorithms import ESTIMATOR_NAMES, KL_ESTIMATOR_NAMES, OFF_POLICY_NAMES
from worldloop.common.contracts.config_fields import Float, Rule, Section

# the longest wait any duration key takes (*_s, *_ms), and the longest run: longer values are typos,
# and some would overflow where they are used (socket timeouts, Redis expiries and ZeroMQ polls in ms)
MAX_WAIT_S = 30 * 86_400
MAX_RUN_S = 366 * 86_400


class TrainerConfig(Section):
    """The learner's PPO/GRPO updates, checkpoints and evaluation while training."""

    estimator: Literal[ESTIMATOR_NAMES] = Field(
        "bilevel_gae", description="the advantage estimator (learner/advantages.py); gigpo = grpo plus a per-turn baseline "
                                   "over the group's turns that started from the same state")
    total_steps: int = Field(100, ge=1, description="policy updates in the run")
    train_batch_size: int = Field(128, ge=1, description="trajectories per update")
    ppo_mini_batch_size: int = Field(32, ge=1, description="trajectories per optimizer step")
    micro_batch_size: int = Field(4, ge=1, description="sequences per forward; gradient accumulation = mini / micro")
    micro_batch_tokens: Annotated[int | Literal["auto"], Rule("must be auto or >= 0 (0 = micro_batch_size trajectories "
                                                           "per micro-batch)", lambda v: v == "auto" or v >= 0)] = Field(
        0, description="> 0: micro-batches are formed by this token budget instead (rows x longest incl. padding; rows "
                       "sorted by length within each mini-batch, learner/trainer.py); 0 = micro_batch_size rows; auto: "
                       "on CUDA the budget the GPU's free memory holds by the memory model (learner/memory.py), on CPU "
                       "micro_batch_size x the update's longest trajectory")
    # on by default since its varlen attention (learner/varlen.py): on the CPU packed rows ran at 1.01-1.30x the
    # padded ones' tokens/s, the same losses within 1e-5 (docs/benchmarks.md "Packed vs padded micro-batches").
    # The earlier block-diagonal mask ran at 0.69x on an H100; the varlen path has not run on a GPU yet.
    packing: bool = Field(True, description="pack whole trajectories end to end into one row per micro-batch "
                                            "(position ids restart per trajectory, M-RoPE ids per trajectory, varlen "
                                            "attention within each trajectory, learner/varlen.py; no padding but the "
                                            "pad_to_multiple rounding); false = padded rows (learner/microbatch.py)")
    vision_cache: bool = Field(True, description="a frozen vision tower (model.freeze_vision) runs once per image per "
                                                 "update: its image features are kept for the update's other passes "
                                                 "and shared by the models whose towers are equal (learner/vision.py); "
                                                 "false = every pass runs the tower")
    proximal_from_first_pass: bool = Field(True, description="the proximal log-probs of the first PPO mini-batch "
                                                             "are its first training forward's (the same weights and "
                                                             "inputs), so the no-grad proximal pass runs on the other "
                                                             "rows only; applies without a reference model, with "
                                                             "off_policy cap and no dropout (learner/trainer.py)")
    pad_to_multiple: Annotated[int | Literal["auto"], Rule("must be auto or an integer in [1, 4096]",
                                                        lambda v: v == "auto" or 1 <= v <= 4096)] = Field(
        "auto", description="every micro-batch is right-padded to a multiple of this many tokens so that its shapes "
                            "repeat (kernels and attention plans are reused); auto = 128 on CUDA, 8 on CPU")
    logprob_chunk_tokens: int = Field(512, ge=1, le=1 << 20,
                                      description="the LM head and its log-softmax run on this many loss tokens at a "
                                                  "time, forward and backward, so no micro-batch holds full-vocabulary "
                                                  "logits (common/contracts/logprobs.py)")
    liger: bool | Literal["auto"] = Field(
        "auto", description="Liger Kernel (the `gpu` extra): fused RMSNorm, RoPE, SwiGLU and linear log-prob on Qwen2 / "
                            "Qwen2.5-VL; auto = on when the learner runs on CUDA and liger_kernel imports; true (YAML's "
                            "`on`) fails at start without either; false (`off`): the plain path (learner/kernels.py)")
    ppo_epochs: int = Field(1, ge=1, description="passes over each batch")
    actor_lr: Float = Field(1e-6, description="the policy's learning rate")
    critic_lr: Float = Field(1e-5, description="the critic's learning rate")
    kl_coef: Float = Field(0.001, description="weight of the KL to the frozen reference (see kl_in_reward)")
    clip_ratio: Float = Field(0.2, gt=0, description="PPO's clip range of the probability ratio")
    value_clip: Float = Field(0.2, description="clip range of the critic's value update")
    entropy_coef: Float = Field(0.0, description="weight of the entropy bonus in the policy loss")
    max_grad_norm: Float = Field(1.0, description="gradient clipping norm")
    gamma: Float = Field(1.0, ge=0, le=1, description="discount (masked_gae, vanilla_ppo)")
    lam: Float = Field(1.0, ge=0, le=1, description="GAE lambda (masked_gae, vanilla_ppo)")
    gamma_token: Float = Field(1.0, ge=0, le=1, description="bilevel_gae / turn_ppo: discount between tokens of a turn")
    lam_token: Float = Field(1.0, ge=0, le=1, description="bilevel_gae / turn_ppo: GAE lambda between tokens of a turn")
    gamma_turn: Float = Field(0.95, ge=0, le=1, description="bilevel_gae / turn_ppo: discount between turns")
    lam_turn: Float = Field(1.0, ge=0, le=1, description="bilevel_gae / turn_ppo: GAE lambda between turns")
    bilevel_kl_routing: Literal["own_turn", "turn_reward"] = Field(
        "own_turn", description="bilevel_gae: the turn-end token's -kl_coef*KL stays on its own turn (own_turn) or joins that "
                                "turn's turn-level reward and so reaches earlier turns discounted (turn_reward: VAGEN's code)")
    # false is verl's norm_adv_by_std_in_grpo=False, "Dr. GRPO"
    grpo_norm_by_std: bool = Field(True, description="grpo, gigpo: divide (R - group mean) by the group's std (Argos Eq. "
                                                     "10; gigpo: also in its step groups), or not: then groups that differ "
                                                     "only by shaping terms stay small")
    # GiGPO (Feng et al. 2025, arXiv 2505.10978): A = A_episode + gigpo_step_weight * A_step
    gigpo_gamma: Float = Field(0.95, ge=0, le=1, description="gigpo: discount of the step return R_t = sum_k gamma^(k-t) r_k "
                                                            "over the turn rewards from turn t on")
    gigpo_step_weight: Float = Field(1.0, ge=0, description="gigpo: weight of the step advantage (R_t - mean over the turns "
                                                           "of the group that started from the same state) added to the "
                                                           "episode advantage")
    # keeps <observation> honest: RL cannot trade the reading for actions (learner/credit.py)
    observation_advantage: Literal["task", "grounding"] = Field(
        "task", description="the advantage of the tokens inside each turn's <observation>: task = the trajectory's (or "
                            "turn's) advantage like every other token; grounding = coef x (the turn's grounding score - "
                            "its mean over observation_baseline), and the other tokens keep the task advantage")
    observation_baseline: Literal["group", "step"] = Field(
        "group", description="observation_advantage grounding: the turns a grounding score is compared with: group = "
                             "every scored turn of its GRPO group; step = those of its group that read the same state "
                             "(a turn alone there gets 0)")
    observation_advantage_coef: Float = Field(1.0, ge=0, description="observation_advantage grounding: the coefficient of "
                                                                    "(grounding score - baseline)")
    # keeps an outlook reasoning honest: RL wore FrozenLake's outlook down when only the observation was paid
    reasoning_advantage: Literal["task", "outlook"] = Field(
        "task", description="the advantage of the tokens inside each turn's <reasoning>: task = like every other token; "
                            "outlook = reasoning_advantage_coef x (the judge's outlook_score of the turn, the share of the "
                            "cells around the player its reasoning names right, - its mean over observation_baseline), "
                            "for turns whose env states an outlook (FrozenLake); the other tokens keep the task advantage")
    reasoning_advantage_coef: Float = Field(1.0, ge=0, description="reasoning_advantage outlook: the coefficient of "
                                                                  "(outlook score - baseline)")
    filter_groups: bool = Field(False, description="DAPO's dynamic sampling: train only on GRPO groups whose episodes differ "
                                                   "in task success; all-solved and all-failed groups are dropped "
                                                   "(\"uninformative\") and their admission budget is given back, so the "
                                                   "actors play more levels instead (learner/data.py)")
    # GRPO's baseline is the mean of a whole group. Actors push each episode when it ends (a solved one
    # earlier than a failed one), so a batch cut from the stream in arrival order splits groups, and a
    # fragment of only successes or only failures gets advantage 0.
    whole_groups: bool = Field(True, description="the learner holds each GRPO group's members until all are in (or known "
                                                 "lost) and batches hold whole groups; only with estimator grpo or gigpo and "
                                                 "actor.n_samples_per_seed >= 2 (learner/data.py)")
    whiten_advantages: bool = Field(True, description="whiten advantages (mean 0, std 1 over the whole "
                                                      "batch's generated tokens); never for grpo or gigpo")
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = Field(
        "token-mean", description="how the policy loss averages over a mini-batch (verl's loss_agg_mode): token-mean (every "
                                  "generated token weighs the same: VAGEN Alg. 1), seq-mean-token-mean (every trajectory "
                                  "weighs the same whatever its length), seq-mean-token-sum (Dr. GRPO: per-trajectory token "
                                  "sums, averaged)")
    max_staleness: int = Field(4, ge=0, description="drop trajectories whose oldest token (a turn's token_versions, else "
                                                    "its policy_version) is further behind the policy than this many "
                                                    "versions")
    importance_weight_cap: Float = Field(2.0, ge=1, description="truncation C of the importance weights (off_policy cap, "
                                                               "tis, seq_is_geo, mis)")
    # learner/offpolicy.py; rho = pi_prox / pi_behaviour per token, the PPO ratio still clipped against pi_prox
    off_policy: Literal[OFF_POLICY_NAMES] = Field(
        "cap", description="the off-policy correction of the policy loss, a weight per token from rho = pi_prox / "
                           "pi_behaviour: cap = min(rho, C); tis = min(rho, C) / its batch mean; seq_is_geo = min(geometric "
                           "mean of the trajectory's rho, C); mis = trajectories whose geometric mean leaves [off_policy_low, "
                           "off_policy_high] rejected, else min(rho, C); icepop = tokens whose rho leaves the band rejected, "
                           "else rho (docs/algorithms.md)")
    off_policy_low: Float = Field(0.5, gt=0, le=1, description="off_policy mis, icepop: the lower bound L of the accepted "
                                                               "ratio band [L, H]")
    off_policy_high: Float = Field(2.0, ge=1, description="off_policy mis, icepop: the upper bound H of the accepted ratio "
                                                          "band [L, H]")
    wmact_rescale: bool = Field(False, description="WMAct Eq. 4: positive env rewards x N_eff / N")
    anneal_max_turns: bool = Field(False, description="WMAct Eq. 5: every anneal_every updates, max turns = ceil((mean + "
                                                      "max turns of the recent episodes) / 2), never raised")
    anneal_every: int = Field(10, ge=1, description="WMAct's tau: updates between max-turn annealings")
    zero_stage: Literal[0, 1, 2, 3] = Field(0, description="DeepSpeed ZeRO stage")
    offload_optimizer: Literal["none", "cpu"] = Field(
        "none", description="ZeRO 1-3: keep the fp32 master weights, AdamW moments and fp32 gradient copy in host "
                            "memory (DeepSpeed offload_optimizer; the client torch AdamW steps on the CPU). What lets "
                            "ZeRO-2 fit Qwen2.5-VL-3B with the vision tower trained on 80 GB (learner/memory.py)")
    precision: Literal["auto", "fp32", "bf16"] = Field("auto", description="auto = bf16 on GPU, fp32 on CPU")
    gradient_checkpointing: bool = Field(False, description="recompute activations in the backward pass (less memory); "
                                                            "activation_checkpointing, when set, takes precedence")
    activation_checkpointing: Literal["full", "selective", "none"] | None = Field(
        None, description="full: every decoder layer recomputed in the backward (one more forward); selective: only "
                          "each layer's self-attention block (its q/k/v/output activations; the MLP's are kept); none; "
                          "unset: full when gradient_checkpointing, else none (learner/kernels.py)")
    checkpoint_every: int = Field(10, ge=1, description="updates between checkpoints")
    keep_checkpoints: int = Field(3, ge=1, description="the newest checkpoints kept on disk")
    resume: bool = Field(False, description="continue from the newest complete checkpoint in the run directory")
    lease_ttl_s: Float = Field(30.0, ge=3, le=MAX_WAIT_S, json_schema_extra={"unit": "seconds", "note": "renewed every third of it"},
                               description="one learner per namespace: its lease in Redis expires this long after its last "
                                           "renewal; a learner restarted on the same host takes over a dead one's lease at once")
    use_critic: bool = Field(True, description="train a critic (false for grpo, gigpo: values are then 0)")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda:<LOCAL_RANK> when visible, else cpu")
    kl_in_reward: bool = Field(True, description="KL to the frozen reference as a per-token reward -kl_coef * KL (VAGEN), "
                                                 "or else as a loss term")
    kl_estimator: Literal[KL_ESTIMATOR_NAMES] = Field("kl", description="the KL estimator (k1, |k1|, k2, k3)")
    # stream entries are acked only after a checkpoint holds their update (learner/data.py)
    max_pending_mb: int = Field(1024, ge=1, description="when the payload bytes held pending (acked only after a "
                                                        "checkpoint holds their update) pass this, the learner "
                                                        "checkpoints early")
    # worldloop/heldout.py, started by `worldloop up`
    eval_every: int = Field(0, ge=0, json_schema_extra={"note": "0 = no evaluation during training"},
                            description="held-out evaluation while training: every eval_every policy versions, "
                                        "eval_episodes seeds per env from eval.seed_start on; 0 = off")
    eval_episodes: int = Field(32, ge=1, description="held-out episodes per env of each evaluation while training")
    final_eval_episodes: int | None = Field(None, ge=1, json_schema_extra={"note": "null = eval_episodes"},
                                            description="held-out episodes per env of the final evaluation, played after "
                                                        "the learner stopped (the first eval_episodes of them are the "
                                                        "in-run seeds); null = eval_episodes")
    final_eval_processes: int = Field(0, ge=0, le=256, json_schema_extra={"note": "0 = one per core the evaluator may use"},
                                      description="processes that play the final evaluation, each a share of its episodes "
                                                  "on one torch thread: the evaluator and copies of it made by fork, "
                                                  "with its weights; 0 = one per core the evaluator may use, 1 = the "
                                                  "evaluator alone. Only an HF backend on the CPU forks (vLLM and CUDA "
                                                  "keep 1); the learner's estimate of the final evaluation divides by it")
    # worldloop/eval/cpu.py: the in-run evaluations' CPU against the sum of every process's heartbeat cpu_s
    eval_cpu_share: Float = Field(0.15, gt=0, le=1, description="the in-run evaluations may take at most this share of "
                                                               "the run's CPU seconds (all processes): an evaluation "
                                                               "starts only while the last one's cost still fits, "
                                                               "otherwise it waits and then takes the newest version; "
                                                               "version 0 and the final evaluation always run")
    eval_nice: int = Field(10, ge=0, le=19, json_schema_extra={"note": "0 = the same priority as the rest of the run"},
                           description="the evaluator lowers its CPU scheduling priority by this much (os.nice), so that "
                                       "the actors and the learner come first")
    final_eval_wait_s: Float = Field(300.0, ge=0, le=MAX_WAIT_S, json_schema_extra={"unit": "seconds", "note": "0 = do not wait"},
                                     description="after the last step the learner waits up to this long for a live "
                                                 "evaluator's evaluation of the final version, so that TensorBoard/wandb get "
                                                 "it too (no live evaluator: no wait)")
    # PyTorch Lightning's max_time; a restarted learner counts from its restart
    time_limit_s: Float | None = Field(None, gt=0, le=MAX_RUN_S, json_schema_extra={"unit": "seconds", "note": "no limit"},
                                       description="wall-clock budget of the updates from the first step: no update starts "
                                                   "that would end past it (judged by the slowest recent update), then the "
                                                   "learner finishes as after total_steps; `worldloop up` sets it from "
                                                   "up.time_limit_s")
    sample_every: int = Field(0, ge=0, json_schema_extra={"note": "0 = no sampled episodes"},
                              description="every sample_every steps the trackers get a few episodes of the batch (images, "
                                          "text, rewards per turn) and <run_dir>/samples.jsonl holds them (worldloop show)")
