"""One typed configuration tree for every worldloop process.

Loaded from YAML (``load_config(path, overrides)``), with ``key.sub=value``
overrides from the command line (the value is parsed as YAML, so
``actor.envs=[{id: worldloop/Sokoban-v0}]`` and ``judge.base_url=null`` work).
Every key is checked against the dataclasses below: an unknown key or a value
of the wrong type raises :class:`ConfigError` naming the dotted key and the
reason, so a bad config fails at start-up, never an hour into a run.

Each section belongs to one role; a role adds its own keys to its own
dataclass only. Defaults follow Table 22 of the VAGEN paper unless noted.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A configuration key is unknown or its value is invalid."""

    def __init__(self, key: str, reason: str):
        self.key = key
        self.reason = reason
        super().__init__(f"config key '{key}': {reason}")


# --------------------------------------------------------------------------- sections


@dataclass
class RunConfig:
    name: str = "worldloop"
    # where metrics.jsonl, plots, checkpoints and logs go; null = runs/<config>-<time>
    run_dir: str | None = None
    seed: int = 0
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    # where the learner's per-step metrics go (learner/trackers.py): jsonl (metrics.jsonl, always
    # written), tensorboard (<run_dir>/tensorboard), wandb (honours WANDB_MODE=offline)
    loggers: list[str] = field(default_factory=lambda: ["jsonl"])


@dataclass
class RedisConfig:
    # redis://[user:password@]host:port/db or rediss://...; null = `worldloop up` starts a local server
    url: str | None = None
    # every key and stream of a run is prefixed with this, so several runs can share one Redis
    namespace: str = "worldloop"
    # backpressure: a producer waits while a stream holds this many undelivered+pending entries
    max_backlog: int = 512
    block_ms: int = 1000  # XREADGROUP block time
    claim_idle_ms: int = 60_000  # reclaim messages pending longer than this from dead consumers
    reconnect_max_s: float = 30.0  # backoff cap while Redis is unreachable
    socket_timeout_s: float = 10.0
    # a process that has never reached Redis gives up after this long with "cannot reach Redis at
    # ..., check redis.url" (a wrong URL); once connected it reconnects for as long as it takes
    startup_timeout_s: float = 30.0
    # an entry delivered this many times and never acked (a poison entry that kills or wedges each
    # consumer that takes it) goes to the dead-letter stream with the reason, its budget given back
    max_deliveries: int = 5
    # a payload larger than this is dead-lettered when it is read (its first 64 KiB are kept)
    max_message_mb: int = 64
    # the dead-letter stream keeps about this many newest records (XADD MAXLEN ~)
    deadletter_maxlen: int = 10_000
    # fsync policy of the Redis `worldloop up` starts (deploy/: WORLDLOOP_REDIS_APPENDFSYNC): always =
    # a host crash loses no acknowledged write; everysec = it may lose the last second of them
    # (docs/architecture.md "Durability"); an external redis.url keeps its own setting
    appendfsync: Literal["always", "everysec"] = "everysec"


@dataclass
class WeightsConfig:
    host: str = "127.0.0.1"  # where actors reach the learner
    bind: str = "127.0.0.1"  # where the learner binds its sockets ("0.0.0.0" across machines)
    pub_port: int = 5555  # PUB: version announcements
    fetch_port: int = 5556  # ROUTER: chunked fetch of the latest version
    chunk_bytes: int = 4 * 1024 * 1024
    # ZeroMQ CURVE (paths to key files made by `zmq.auth.create_certificates`); all null = plaintext
    curve_server_public: str | None = None  # server .key (actors)
    curve_server_secret: str | None = None  # server .key_secret (learner)
    curve_client_public: str | None = None  # learner: the only client .key (or folder of them) it admits; null = any
    curve_client_secret: str | None = None  # client .key_secret (actors); null = an ephemeral client key
    fetch_timeout_s: float = 30.0  # an actor gives up when the learner has not answered for this long
    # the largest weight set an actor accepts before allocating for it (a manifest from a buggy or
    # hostile publisher must not make it reserve terabytes); 0 = 4x the model directory's weight
    # files (*.safetensors, *.bin) + 64 MiB (room for a float32 set sent to a bfloat16 actor)
    max_bytes: int = 0


@dataclass
class MetricsConfig:
    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = 0  # 0 = an ephemeral port, announced in the log and in Redis


@dataclass
class ModelConfig:
    # a local HF model directory (Qwen2.5-VL family or a text-only causal LM); no hub downloads
    path: str = "models/tiny-qwen2.5-vl"
    # build the embedded tiny model (local tokenizer + small Qwen2.5-VL config) if `path` is missing
    make_tiny_if_missing: bool = True
    # steps of in-context copy pre-training of a newly made tiny model before SFT (0: none)
    tiny_copy_pretrain_steps: int = 0
    # steps of grounding pre-training of a newly made tiny model before SFT (worldloop/grounding.py:
    # first-turn image of a fresh level -> the true state description; 0: none), its learning rate,
    # levels per step, and the first seed of its levels (a range disjoint from RL, SFT and eval seeds)
    tiny_grounding_steps: int = 0
    tiny_grounding_lr: float = 3e-3
    tiny_grounding_batch_size: int = 32
    tiny_grounding_seed_start: int = 30_000_000
    # every n-th grounding step shows the whole first turn the actors send (the env's system prompt
    # too) to tiny_grounding_agent_batch_size levels; the other steps leave the system prompt out
    # (0: never). The system prompt is 60 % of the tokens, the image-to-answer distance is the same.
    tiny_grounding_agent_every: int = 4
    tiny_grounding_agent_batch_size: int = 8
    # keep the vision tower (and its merger) at its initial weights in grounding pre-training, SFT
    # and the learner: the tiny model's random-init tower tells every tile apart, and training it
    # from scratch at the tiny presets' learning rates collapses it
    freeze_vision: bool = False
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: int = 4096
    # images are resized so that neither side exceeds this (pixels) before the vision tower
    max_image_side: int = 224


@dataclass
class EnvSpec:
    id: str = "worldloop/Sokoban-v0"  # a registered gymnasium id
    kwargs: dict[str, Any] = field(default_factory=dict)
    # kwargs the actors' training episodes alone lay over `kwargs` (a training curriculum, e.g.
    # Sokoban's max_actions_to_succeed); the run's evaluator, `worldloop eval`, SFT demonstrations and
    # grounding pre-training play `kwargs` as they are
    train_kwargs: dict[str, Any] = field(default_factory=dict)
    weight: float = 1.0  # sampling weight among envs of an actor
    name: str | None = None  # label in metrics; default: id without prefix/version

    def training_kwargs(self) -> dict[str, Any]:
        """What the actors' training episodes are made with: ``kwargs`` with ``train_kwargs`` over them."""
        return {**self.kwargs, **self.train_kwargs}


@dataclass
class ActorConfig:
    num_envs: int = 8
    envs: list[EnvSpec] = field(default_factory=lambda: [EnvSpec()])
    max_turns: int = 3
    n_samples_per_seed: int = 1
    backend: Literal["hf", "vllm"] = "hf"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    temperature: float = 0.7
    top_p: float = 0.95
    max_new_tokens: int = 200
    # training seeds are drawn from [seed_start, seed_end); eval uses seeds >= eval.seed_start
    seed_start: int = 0
    seed_end: int = 1_000_000
    # rollout admission (common/admission.py): an episode starts only while the run-wide budget
    # (v + trainer.max_staleness + 1) * trainer.train_batch_size allows it, so nothing goes stale;
    # false = actors generate freely and the learner drops what is too old
    admission: bool = True
    # an admitted episode whose actor stops renewing its lease (killed, partitioned) gives its
    # budget back after this long
    admission_lease_s: float = 120.0
    vllm_gpu_memory_utilization: float = 0.5
    vllm_enforce_eager: bool = True
    # vLLM KV-cache size in GiB; null = from vllm_gpu_memory_utilization on GPU, 1 GiB on CPU
    vllm_kv_cache_gib: float | None = None
    actor_id: str | None = None  # default: <hostname>-<pid>


@dataclass
class JudgeConfig:
    enabled: bool = True
    # scorer names per env name ("default" applies to envs not listed): rule | llm | hybrid
    scorers: dict[str, list[str]] = field(default_factory=lambda: {"default": ["rule"]})
    # how `rule` (and `hybrid`'s extracted facts) score Sokoban/FrozenLake descriptions: f1 = per-axis
    # relation facts over all pairs (judge/rule.py); vagen = VAGEN's code (judge/vagen_score.py): target,
    # box, hole relative to the player, both axes; the config then gives those envs
    # relation_prompt=vagen so that their prompt asks for exactly these relations
    rule_mode: Literal["f1", "vagen"] = "f1"
    beta_grounding: float = 0.5
    beta_worldmodeling: float = 0.5
    concurrency: int = 16
    timeout_s: float = 30.0
    max_retries: int = 3
    backoff_s: float = 0.5
    base_url: str | None = None  # any OpenAI-compatible endpoint
    model: str = "gpt-4o-mini"
    api_key_env: str = "OPENAI_API_KEY"  # the key is read from this variable, never logged
    cache_size: int = 10_000
    repetition_top_k: int = 5
    repetition_f1_threshold: float = 0.7
    repetition_penalty: float = 0.1
    fallback_score: float = 0.0
    batch_size: int = 8  # trajectories read per XREADGROUP (and held in flight at most)
    # Argos Eq. 9 gate when several scorers apply: the first listed is the gate; below the threshold
    # the gate's score stands alone, at or above it the weighted mean of all applicable scorers
    gate_threshold: float = 0.5
    scorer_weights: dict[str, float] = field(default_factory=lambda: {"rule": 1.0, "llm": 1.0, "hybrid": 1.0})
    max_tokens: int = 512  # judge reply length (llm: think + verdict; hybrid: the JSON list)
    dedup_window_s: float = 86400.0  # trajectory ids already forwarded to `scored` are remembered this long


@dataclass
class TrainerConfig:
    estimator: Literal["masked_gae", "bilevel_gae", "turn_ppo", "grpo", "vanilla_ppo"] = "bilevel_gae"
    total_steps: int = 100
    train_batch_size: int = 128  # trajectories per update
    ppo_mini_batch_size: int = 32
    micro_batch_size: int = 4  # sequences per forward; accumulation = mini / micro
    # > 0: micro-batches are formed by this token budget instead (rows x longest incl. padding;
    # rows sorted by length within each mini-batch, learner/trainer.py); 0 = micro_batch_size rows
    micro_batch_tokens: int = 0
    ppo_epochs: int = 1
    actor_lr: float = 1e-6
    critic_lr: float = 1e-5
    kl_coef: float = 0.001
    clip_ratio: float = 0.2
    value_clip: float = 0.2
    entropy_coef: float = 0.0
    max_grad_norm: float = 1.0
    gamma: float = 1.0  # masked_gae / vanilla_ppo
    lam: float = 1.0
    gamma_token: float = 1.0
    lam_token: float = 1.0
    gamma_turn: float = 0.95
    lam_turn: float = 1.0
    # bilevel_gae: the turn-end token's -kl_coef*KL stays on its own turn (own_turn) or joins that turn's
    # turn-level reward and so reaches earlier turns discounted (turn_reward: VAGEN's code)
    bilevel_kl_routing: Literal["own_turn", "turn_reward"] = "own_turn"
    # grpo: divide (R - group mean) by the group's std (Argos Eq. 10) or not (verl's
    # norm_adv_by_std_in_grpo=False, "Dr. GRPO"): then groups that differ only by shaping terms stay small
    grpo_norm_by_std: bool = True
    # DAPO's dynamic sampling: the learner trains only on GRPO groups (actor.n_samples_per_seed
    # episodes of one level) whose episodes differ in task success, and drops the all-solved and
    # all-failed ones (reason "uninformative"), giving their admission budget back so the actors
    # play more levels instead (learner/data.py)
    filter_groups: bool = False
    # GRPO's baseline is the mean of a whole group. Actors push each episode when it ends (a solved
    # one turns earlier than a failed one), so a batch cut from the stream in arrival order splits
    # groups, and a fragment of only successes or only failures gets advantage 0. With whole_groups
    # the learner holds each group's members until all are in (or known lost) and batches hold whole
    # groups; only with estimator grpo and actor.n_samples_per_seed >= 2 (learner/data.py)
    whole_groups: bool = True
    whiten_advantages: bool = True
    # how the policy loss averages over a PPO mini-batch (verl's loss_agg_mode): token-mean (every
    # generated token weighs the same: VAGEN Alg. 1), seq-mean-token-mean (every trajectory weighs the
    # same whatever its length), seq-mean-token-sum (Dr. GRPO: per-trajectory token sums, averaged)
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    max_staleness: int = 4  # drop trajectories whose oldest turn is further behind than this
    importance_weight_cap: float = 2.0  # truncation of pi_prox / pi_behaviour
    wmact_rescale: bool = False  # WMAct Eq. 4: R * N_eff / N
    anneal_max_turns: bool = False  # WMAct Eq. 5
    anneal_every: int = 10  # tau
    zero_stage: Literal[0, 1, 2, 3] = 0
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto = bf16 on GPU, fp32 on CPU
    gradient_checkpointing: bool = False
    checkpoint_every: int = 10
    keep_checkpoints: int = 3
    resume: bool = False
    # one learner per namespace: its lease in Redis expires this long after its last renewal (every
    # third of it); a learner restarted on the same host takes over a dead one's lease at once
    lease_ttl_s: float = 30.0
    use_critic: bool = True  # false for grpo
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto = cuda:<LOCAL_RANK> when visible, else cpu
    # KL to the frozen reference: -kl_coef * KL as a per-token reward (VAGEN), or a loss term
    kl_in_reward: bool = True
    kl_estimator: Literal["kl", "abs", "mse", "low_var_kl"] = "kl"
    # stream entries are acked only after a checkpoint holds their update; when the payload bytes
    # held pending pass this, the learner checkpoints early (see learner/data.py)
    max_pending_mb: int = 1024
    # held-out evaluation while training (worldloop/evaluator.py, started by `worldloop up`): every
    # eval_every policy versions, eval_episodes seeds per env from eval.seed_start on; 0 = off
    eval_every: int = 0
    eval_episodes: int = 32
    # after the last step the learner waits up to this long for a live evaluator's evaluation of
    # the final version, so that TensorBoard/wandb get it too (no live evaluator: no wait); 0 = never
    final_eval_wait_s: float = 300.0
    # wall-clock budget of the learner's updates, in seconds from its first step (PyTorch Lightning's
    # max_time): no update starts that would end past it (judged by the slowest of the last few
    # updates), and the learner then finishes as after total_steps (final checkpoint, run stopped);
    # null = none. A restarted learner counts from its restart. `worldloop up` sets it from up.time_limit_s
    time_limit_s: float | None = None
    # every sample_every steps the trackers get a few episodes of the batch (images, text, rewards
    # per turn) and <run_dir>/samples.jsonl holds them (worldloop show); 0 = off
    sample_every: int = 0


@dataclass
class SFTConfig:
    # warm start on solver demonstrations, only when `worldloop up` has just made the embedded tiny
    # model (a real checkpoint is never touched); the defaults are sized for that tiny model:
    # 64 Sokoban episodes x 20 epochs take ~80 s on 2 CPU cores and reach 100% well-formed answers
    enabled: bool = True
    episodes: int = 64
    epochs: int = 20
    lr: float = 5e-3
    batch_size: int = 8
    # demonstrations (and the format probes after them) are played on seeds seed_start,
    # seed_start+1, ...; this range must not overlap the RL seeds [actor.seed_start, actor.seed_end)
    # nor the held-out eval seeds [eval.seed_start, eval.seed_start + eval.episodes)
    seed_start: int = 5_000_000
    # expert: the env's expert_response() as is; concise: the same answer with the observation and
    # prediction cut to their first `observation_relations` sentences and an empty reasoning
    answer_style: Literal["expert", "concise"] = "expert"
    observation_relations: int = 2
    # the concise reasoning: empty, or plan = the turn's actions (as the answer writes them) before the
    # prediction, so the model picks its move right after reading the board and then predicts and
    # answers from that choice (README "What the presets do": Sokoban)
    concise_reasoning: Literal["empty", "plan"] = "empty"
    # how much of its plan the demonstrator commits per turn: prefix = the first
    # max_actions_per_step actions (the env's expert); distinct = up to the first repeated move, then it
    # looks again (one step per direction: the answer follows from the observed relations)
    turn_plan: Literal["prefix", "distinct"] = "prefix"


@dataclass
class UpConfig:
    num_actors: int = 2
    num_judges: int = 1
    # the whole `worldloop up` (model, grounding, SFT, RL, final evaluation) should end within this
    # many seconds: after the model is ready, the learner gets trainer.time_limit_s = what is left
    # minus up.final_reserve_s (the final held-out evaluation and shutdown), or less if the config
    # asks for less; null = no budget (trainer.total_steps alone decides)
    time_limit_s: float | None = None
    final_reserve_s: float = 60.0
    progress_interval_s: float = 2.0


@dataclass
class EvalConfig:
    episodes: int = 32
    seed_start: int = 10_000_000  # held-out seeds, disjoint from actor.seed_start..seed_end
    concurrency: int = 8
    max_tokens: int = 400  # Table 21: 150/400
    temperature: float = 0.7
    single_turn: bool = False  # WMAct protocol
    output: str | None = None
    # turns per episode; null = the paper's value per env (VAGEN Tables 7-15; actor.max_turns otherwise)
    max_turns: int | None = None
    top_p: float = 1.0  # the APIs' default; the same for local and remote models
    # local models: "keyed" draws each turn's sampling noise from (run.seed, env, seed, turn) alone, so
    # an episode does not depend on its batch and two models compared on the same seeds share their
    # noise (common random numbers); "batch" seeds each batched call instead (before 2026-11-26)
    sampling: Literal["keyed", "batch"] = "keyed"
    prompt_format: str | None = None  # reasoning strategy; null = the env's default
    state_format: str | None = None  # state representation; null = the env's default
    render_mode: Literal["vision", "text"] = "vision"
    timeout_s: float = 120.0  # per request to an OpenAI-compatible endpoint
    max_retries: int = 4  # on 429 / 5xx / timeouts / connection errors, exponential backoff
    backoff_s: float = 1.0
    api_key_env: str = "OPENAI_API_KEY"  # the key is read from this variable, never logged


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    up: UpConfig = field(default_factory=UpConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    # set by the loader: the file the config came from (not a key in YAML)
    source: str | None = field(default=None, metadata={"internal": True})


# --------------------------------------------------------------------------- checks

# value checks beyond types: dotted key -> (predicate, reason)
_CHECKS: dict[str, tuple[typing.Callable[[Any], bool], str]] = {
    "redis.max_backlog": (lambda v: v >= 1, "must be >= 1"),
    "redis.startup_timeout_s": (lambda v: v > 0, "must be > 0"),
    "redis.max_deliveries": (lambda v: v >= 2, "must be >= 2 (1 would dead-letter every reclaimed entry)"),
    "redis.max_message_mb": (lambda v: v >= 1, "must be >= 1"),
    "redis.deadletter_maxlen": (lambda v: v >= 100, "must be >= 100"),
    "trainer.lease_ttl_s": (lambda v: v >= 3, "must be >= 3 seconds (renewed every third of it)"),
    "redis.url": (
        lambda v: v is None or v.startswith(("redis://", "rediss://", "unix://")),
        "must start with redis://, rediss:// or unix://",
    ),
    "weights.chunk_bytes": (lambda v: v >= 1024, "must be >= 1024"),
    "weights.pub_port": (lambda v: 0 <= v < 65536, "must be a TCP port"),
    "weights.fetch_port": (lambda v: 0 <= v < 65536, "must be a TCP port"),
    "weights.fetch_timeout_s": (lambda v: v > 0, "must be > 0"),
    "weights.max_bytes": (lambda v: v >= 0, "must be >= 0 (0 = derived from the model directory)"),
    "metrics.port": (lambda v: 0 <= v < 65536, "must be a TCP port (0 = ephemeral)"),
    "actor.num_envs": (lambda v: v >= 1, "must be >= 1"),
    "trainer.eval_every": (lambda v: v >= 0, "must be >= 0 (0 = no evaluation during training)"),
    "trainer.eval_episodes": (lambda v: v >= 1, "must be >= 1"),
    "trainer.final_eval_wait_s": (lambda v: v >= 0, "must be >= 0 seconds (0 = do not wait)"),
    "trainer.sample_every": (lambda v: v >= 0, "must be >= 0 (0 = no sampled episodes)"),
    "trainer.time_limit_s": (lambda v: v is None or v > 0, "must be > 0 seconds or null (no limit)"),
    "up.time_limit_s": (lambda v: v is None or v > 0, "must be > 0 seconds or null (no limit)"),
    "up.final_reserve_s": (lambda v: v >= 0, "must be >= 0 seconds"),
    "run.loggers": (lambda v: set(v) <= {"jsonl", "tensorboard", "wandb"} and len(set(v)) == len(v),
                    "must list distinct names out of jsonl, tensorboard, wandb"),
    "actor.admission_lease_s": (lambda v: v > 0, "must be > 0"),
    "actor.envs": (lambda v: len(v) >= 1, "must list at least one env"),
    "actor.max_turns": (lambda v: v >= 1, "must be >= 1"),
    "actor.n_samples_per_seed": (lambda v: v >= 1, "must be >= 1"),
    "actor.temperature": (lambda v: v >= 0, "must be >= 0"),
    "actor.top_p": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
    "actor.max_new_tokens": (lambda v: v >= 1, "must be >= 1"),
    "actor.vllm_kv_cache_gib": (lambda v: v is None or v > 0, "must be > 0 or null"),
    "judge.concurrency": (lambda v: v >= 1, "must be >= 1"),
    "judge.timeout_s": (lambda v: v > 0, "must be > 0"),
    "judge.max_retries": (lambda v: v >= 0, "must be >= 0"),
    "judge.backoff_s": (lambda v: v >= 0, "must be >= 0"),
    "judge.cache_size": (lambda v: v >= 0, "must be >= 0 (0 = no cache)"),
    "judge.batch_size": (lambda v: v >= 1, "must be >= 1"),
    "judge.gate_threshold": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    "judge.scorer_weights": (lambda v: all(k in ("rule", "llm", "hybrid") and w > 0 for k, w in v.items()),
                             "keys must be rule/llm/hybrid with weights > 0"),
    "judge.max_tokens": (lambda v: v >= 1, "must be >= 1"),
    "judge.dedup_window_s": (lambda v: v > 0, "must be > 0"),
    "judge.repetition_top_k": (lambda v: v >= 0, "must be >= 0 (0 = no repetition penalty)"),
    "trainer.train_batch_size": (lambda v: v >= 1, "must be >= 1"),
    "trainer.ppo_mini_batch_size": (lambda v: v >= 1, "must be >= 1"),
    "trainer.micro_batch_size": (lambda v: v >= 1, "must be >= 1"),
    "trainer.micro_batch_tokens": (lambda v: v >= 0, "must be >= 0 (0 = micro_batch_size trajectories per micro-batch)"),
    "trainer.clip_ratio": (lambda v: v > 0, "must be > 0"),
    "trainer.max_staleness": (lambda v: v >= 0, "must be >= 0"),
    "trainer.importance_weight_cap": (lambda v: v >= 1.0, "must be >= 1"),
    "trainer.gamma": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    "trainer.lam": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    "trainer.gamma_token": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    "trainer.lam_token": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    "trainer.gamma_turn": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    "trainer.lam_turn": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    "trainer.anneal_every": (lambda v: v >= 1, "must be >= 1"),
    "trainer.checkpoint_every": (lambda v: v >= 1, "must be >= 1"),
    "trainer.keep_checkpoints": (lambda v: v >= 1, "must be >= 1"),
    "trainer.max_pending_mb": (lambda v: v >= 1, "must be >= 1"),
    "trainer.total_steps": (lambda v: v >= 1, "must be >= 1"),
    "trainer.ppo_epochs": (lambda v: v >= 1, "must be >= 1"),
    "up.num_actors": (lambda v: v >= 0, "must be >= 0"),
    "up.num_judges": (lambda v: v >= 0, "must be >= 0"),
    "eval.episodes": (lambda v: v >= 1, "must be >= 1"),
    "model.tiny_copy_pretrain_steps": (lambda v: v >= 0, "must be >= 0"),
    "model.tiny_grounding_steps": (lambda v: v >= 0, "must be >= 0"),
    "model.tiny_grounding_lr": (lambda v: v > 0, "must be > 0"),
    "model.tiny_grounding_batch_size": (lambda v: v >= 1, "must be >= 1"),
    "model.tiny_grounding_seed_start": (lambda v: v >= 0, "must be >= 0"),
    "model.tiny_grounding_agent_every": (lambda v: v >= 0, "must be >= 0 (0 = never)"),
    "model.tiny_grounding_agent_batch_size": (lambda v: v >= 1, "must be >= 1"),
    "sft.episodes": (lambda v: v >= 1, "must be >= 1"),
    "sft.epochs": (lambda v: v >= 0, "must be >= 0"),
    "sft.lr": (lambda v: v > 0, "must be > 0"),
    "sft.batch_size": (lambda v: v >= 1, "must be >= 1"),
    "sft.seed_start": (lambda v: v >= 0, "must be >= 0"),
    "sft.observation_relations": (lambda v: v >= 1, "must be >= 1"),
    "eval.concurrency": (lambda v: v >= 1, "must be >= 1"),
    "eval.max_tokens": (lambda v: v >= 1, "must be >= 1"),
    "eval.temperature": (lambda v: v >= 0, "must be >= 0"),
    "eval.top_p": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
    "eval.max_turns": (lambda v: v is None or v >= 1, "must be >= 1 or null"),
    "eval.timeout_s": (lambda v: v > 0, "must be > 0"),
    "eval.max_retries": (lambda v: v >= 0, "must be >= 0"),
    "eval.backoff_s": (lambda v: v >= 0, "must be >= 0"),
}


def _cross_checks(cfg: Config) -> None:
    t = cfg.trainer
    if t.train_batch_size % t.ppo_mini_batch_size:
        raise ConfigError(
            "trainer.ppo_mini_batch_size",
            f"must divide trainer.train_batch_size ({t.train_batch_size}), got {t.ppo_mini_batch_size}",
        )
    if t.ppo_mini_batch_size % t.micro_batch_size:
        raise ConfigError(
            "trainer.micro_batch_size",
            f"must divide trainer.ppo_mini_batch_size ({t.ppo_mini_batch_size}), got {t.micro_batch_size}",
        )
    if t.filter_groups and cfg.actor.n_samples_per_seed < 2:
        raise ConfigError("trainer.filter_groups", "needs groups: set actor.n_samples_per_seed >= 2 "
                          f"(got {cfg.actor.n_samples_per_seed})")
    size = held_group_size(cfg)
    if size and t.train_batch_size % size:
        key = "trainer.filter_groups" if t.filter_groups else "trainer.whole_groups"
        raise ConfigError(key, f"trains whole groups: trainer.train_batch_size ({t.train_batch_size}) must be a "
                          f"multiple of actor.n_samples_per_seed ({size})"
                          + ("" if t.filter_groups else "; or set trainer.whole_groups: false"))
    if not t.kl_in_reward and t.kl_coef > 0 and t.kl_estimator == "kl":
        # E_pi[log pi - log ref] is the KL, but its gradient on fixed samples is grad log pi(a):
        # minimising it lowers the probability of every sampled token (measured: a tiny run's KL
        # term went to -20 and the policy collapsed to one repeated token)
        raise ConfigError("trainer.kl_estimator", "the 'kl' (k1) estimator cannot be a loss term "
                          "(trainer.kl_in_reward: false): its gradient lowers every sampled token's probability; "
                          "use low_var_kl or mse, or keep the KL in the reward")
    if cfg.actor.seed_end <= cfg.actor.seed_start:
        raise ConfigError("actor.seed_end", "must be greater than actor.seed_start")
    if cfg.actor.seed_start <= cfg.eval.seed_start < cfg.actor.seed_end:
        raise ConfigError("eval.seed_start", "must lie outside the training seed range [actor.seed_start, actor.seed_end)")
    _check_demonstration_seeds(cfg)
    _check_grounding_seeds(cfg)
    for name in cfg.judge.scorers.values():
        for s in name:
            if s not in ("rule", "llm", "hybrid"):
                raise ConfigError("judge.scorers", f"unknown scorer '{s}' (known: rule, llm, hybrid)")
    # CURVE: the learner holds the server's secret key file (and optionally the client keys it
    # admits); an actor holds only the server's public key file (and optionally its own client key)
    w = cfg.weights
    if w.curve_client_secret and not w.curve_server_public:
        raise ConfigError("weights.curve_server_public", "an actor's CURVE client key needs the server's public key file")
    if w.curve_client_public and not w.curve_server_secret:
        raise ConfigError("weights.curve_server_secret", "admitting CURVE client keys needs the server's secret key file")


SFT_PROBE_SEEDS = 8  # format probes played after the demonstrations (worldloop/sft.py warm_start)


def _rl_seeds(cfg: Config) -> tuple[str, int, int]:
    return ("the RL seeds [actor.seed_start, actor.seed_end)", cfg.actor.seed_start, cfg.actor.seed_end)


def _rl_and_eval_seeds(cfg: Config) -> list[tuple[str, int, int]]:
    return [_rl_seeds(cfg),
            ("the held-out eval seeds [eval.seed_start, eval.seed_start + eval.episodes)", cfg.eval.seed_start,
             cfg.eval.seed_start + cfg.eval.episodes)]


def _check_disjoint(key: str, label: str, lo: int, hi: int, others: list[tuple[str, int, int]]) -> None:
    """ConfigError on ``key`` when the seed range [lo, hi) overlaps any of ``others`` (name, lo, hi)."""
    for what, lo2, hi2 in others:
        if lo < hi2 and lo2 < hi:
            raise ConfigError(key, f"{label} [{lo}, {hi}) overlap {what} = [{lo2}, {hi2})")


def _demonstration_seeds(cfg: Config) -> tuple[int, int]:
    """[lo, hi) of the SFT demonstrations and the format probes played after them."""
    return cfg.sft.seed_start, cfg.sft.seed_start + cfg.sft.episodes + SFT_PROBE_SEEDS


def _check_demonstration_seeds(cfg: Config) -> None:
    """SFT demonstrations must be played on seeds that RL and the held-out evaluation never see."""
    if not cfg.sft.enabled:
        return
    _check_disjoint("sft.seed_start", "demonstration seeds", *_demonstration_seeds(cfg), _rl_and_eval_seeds(cfg))


GROUNDING_EVAL_BOARDS = 128  # held-out boards of grounding pre-training (worldloop/grounding.py)


def _grounding_seeds(cfg: Config) -> tuple[int, int]:
    """[lo, hi) of the grounding pre-training levels and the boards it is evaluated on."""
    m = cfg.model
    return m.tiny_grounding_seed_start, (m.tiny_grounding_seed_start + m.tiny_grounding_steps * m.tiny_grounding_batch_size
                                         + GROUNDING_EVAL_BOARDS)


def _check_grounding_seeds(cfg: Config) -> None:
    """The levels of grounding pre-training must be none of the RL, demonstration or held-out levels."""
    if not cfg.model.tiny_grounding_steps:
        return
    others = _rl_and_eval_seeds(cfg)
    if cfg.sft.enabled:
        others.append(("the SFT demonstration seeds", *_demonstration_seeds(cfg)))
    _check_disjoint("model.tiny_grounding_seed_start", "grounding pre-training seeds", *_grounding_seeds(cfg), others)


def held_group_size(cfg: Config) -> int:
    """The GRPO group size the learner's reader holds members for until a group is whole
    (``trainer.filter_groups``, or ``trainer.whole_groups`` with estimator grpo), or 0 when it
    batches in arrival order (no groups, or neither knob applies)."""
    t, n = cfg.trainer, cfg.actor.n_samples_per_seed
    grouped = t.filter_groups or (t.whole_groups and t.estimator == "grpo")
    return n if grouped and n >= 2 else 0


def training_seed_ranges(cfg: Config) -> list[tuple[str, int, int]]:
    """(what, lo, hi) of every seed range a run trains on: RL, and the SFT demonstrations and
    grounding pre-training levels where they are on. Held-out seeds must miss all of them."""
    out = [_rl_seeds(cfg)]
    if cfg.sft.enabled:
        out.append(("the SFT demonstration seeds", *_demonstration_seeds(cfg)))
    if cfg.model.tiny_grounding_steps:
        out.append(("the grounding pre-training seeds", *_grounding_seeds(cfg)))
    return out


def check_held_out_seeds(cfg: Config, lo: int, n: int, key: str = "eval.seed_start") -> None:
    """ConfigError on ``key`` when the held-out seeds [lo, lo + n) overlap a training range."""
    _check_disjoint(key, "held-out seeds", lo, lo + n, training_seed_ranges(cfg))


# --------------------------------------------------------------------------- coercion


_FLOAT_TEXT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(key: str, tp: Any, value: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; return the typed value."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(key, a, value)
            except ConfigError as e:
                errors.append(e.reason)
        raise ConfigError(key, "; ".join(errors) if errors else f"got {value!r}")
    if origin is Literal:
        if value in args:
            return value
        raise ConfigError(key, f"must be one of {list(args)}, got {value!r}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(key, f"expected a list, got {type(value).__name__} {value!r}")
        return [_coerce(f"{key}[{i}]", args[0], v) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a mapping, got {type(value).__name__} {value!r}")
        return {_coerce(f"{key}.<key>", args[0], k): _coerce(f"{key}.{k}", args[1], v) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a mapping for section {tp.__name__}, got {value!r}")
        return _build(tp, value, key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(key, f"expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(key, f"expected an integer, got {type(value).__name__} {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _FLOAT_TEXT.fullmatch(value.strip()):
            return float(value)  # YAML 1.1 reads 1e-6 (no dot) as a string
        raise ConfigError(key, f"expected a number, got {type(value).__name__} {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(key, f"expected a string, got {type(value).__name__} {value!r}")
    raise ConfigError(key, f"unsupported type {_type_name(tp)}")


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _build(cls: type, data: dict, prefix: str = "") -> Any:
    hints = _hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    kwargs = {}
    for k, v in data.items():
        dotted = f"{prefix}.{k}" if prefix else str(k)
        if k not in known:
            raise ConfigError(dotted, f"unknown key (known keys here: {', '.join(sorted(known))})")
        kwargs[k] = _coerce(dotted, hints[k], v)
        if dotted in _CHECKS:
            ok, reason = _CHECKS[dotted]
            if not ok(kwargs[k]):
                raise ConfigError(dotted, f"{reason}, got {v!r}")
    return cls(**kwargs)


def _validate_defaults(cfg: Config) -> None:
    """Run value checks on every key, including defaults and values set in code."""
    for dotted, (ok, reason) in _CHECKS.items():
        value = get_key(cfg, dotted)
        if not ok(value):
            raise ConfigError(dotted, f"{reason}, got {value!r}")
    _cross_checks(cfg)


# --------------------------------------------------------------------------- public API


def get_key(cfg: Any, dotted: str) -> Any:
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def parse_override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise ConfigError(text, "an override must look like key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(text, "an override must name a key before '='")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(key, f"value {raw!r} is not valid YAML: {e}") from None
    return key, value


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for i, p in enumerate(parts[:-1]):
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        elif not isinstance(nxt, dict):
            raise ConfigError(".".join(parts[: i + 1]), "is a value, not a section; cannot set a sub-key")
        node = nxt
    node[parts[-1]] = value


# the envs whose prompt follows judge.rule_mode (their kwarg relation_prompt, envs/grid_env.py)
RELATION_PROMPT_ENVS = ("worldloop/Sokoban-v0", "worldloop/FrozenLake-v0")


def _pass_rule_mode(cfg: Config) -> None:
    """judge.rule_mode vagen: relation_prompt=vagen into the kwargs of the Sokoban/FrozenLake envs (the
    actors, the SFT demonstrations and `worldloop eval` all build them from actor.envs); an explicit
    relation_prompt that contradicts judge.rule_mode fails."""
    want = "vagen" if cfg.judge.rule_mode == "vagen" else "default"
    for i, spec in enumerate(cfg.actor.envs):
        if spec.id not in RELATION_PROMPT_ENVS:
            continue
        have = spec.kwargs.get("relation_prompt", want)
        if have != want:
            raise ConfigError(f"actor.envs[{i}].kwargs.relation_prompt",
                              f"is {have!r} but judge.rule_mode is {cfg.judge.rule_mode!r}: the prompt must ask for what "
                              "the judge scores (set judge.rule_mode and leave relation_prompt out, the config passes it)")
        if want == "vagen":
            spec.kwargs["relation_prompt"] = "vagen"


def config_from_dict(data: dict | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    tree: dict = dict(data or {})
    if not isinstance(tree, dict):
        raise ConfigError("<root>", "the config file must be a mapping of sections")
    tree = _deep_copy(tree)
    for ov in overrides:
        k, v = parse_override(ov)
        _set_dotted(tree, k, v)
    cfg = _build(Config, tree)
    _pass_rule_mode(cfg)
    _validate_defaults(cfg)
    return cfg


def _deep_copy(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _deep_copy(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_deep_copy(v) for v in x]
    return x


def preset_names() -> list[str]:
    """The presets shipped in the package (``worldloop.configs``), without ``.yaml``."""
    return sorted(f.name[: -len(".yaml")] for f in resources.files("worldloop.configs").iterdir() if f.name.endswith(".yaml"))


def resolve_config_path(path: str | os.PathLike) -> Path:
    """A config file: ``path`` itself when it exists, else the shipped preset of that name
    (``tiny-sokoban`` or ``tiny-sokoban.yaml``), so presets work from a non-editable install."""
    p = Path(path)
    if p.exists():
        return p
    name = p.name[: -len(".yaml")] if p.name.endswith(".yaml") else p.name
    if str(p) in (name, name + ".yaml", f"configs/{name}.yaml"):
        preset = resources.files("worldloop.configs") / f"{name}.yaml"
        if preset.is_file():
            return Path(str(preset))
    raise ConfigError("<file>", f"config file {str(p)!r} does not exist and is not a preset (presets: {', '.join(preset_names())})")


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a YAML file (or only defaults when ``path`` is None) and apply overrides."""
    data: dict = {}
    p = None
    if path is not None:
        p = resolve_config_path(path)
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError("<file>", f"{p} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError("<root>", f"{p} must hold a mapping of sections, got {type(data).__name__}")
    cfg = config_from_dict(data, overrides)
    cfg.source = str(p) if p is not None else None  # the file read (a preset's path inside the package)
    return cfg


def to_dict(cfg: Any) -> dict:
    """The config as plain data (for logs, the run directory and child processes)."""
    out = dataclasses.asdict(cfg)
    out.pop("source", None)
    return out


def env_label(spec: EnvSpec) -> str:
    """Short env name used in metrics labels: worldloop/Sokoban-v0 -> sokoban."""
    if spec.name:
        return spec.name
    base = spec.id.split("/")[-1]
    return base.split("-v")[0].lower()
