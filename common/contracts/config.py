"""One typed configuration tree for every worldloop process.

Loaded from YAML (``load_config(path, overrides)``), with ``key.sub=value`` overrides from the
command line (the value is parsed as YAML, so ``actor.envs=[{id: worldloop/Sokoban-v0}]`` and
``judge.base_url=null`` work). Every key is checked against the sections below: an unknown key,
a value of the wrong type or out of its bound raises :class:`ConfigError` naming the dotted key
and the reason, so a bad config fails at start-up, never an hour into a run.

Each field holds its type, default, bound and one-line doc together (pydantic ``Field``; the
rules for declaring one are in :mod:`worldloop.common.contracts.config_fields`). Rules across fields live in
:mod:`worldloop.common.contracts.config_checks`; files, presets and overrides in
:mod:`worldloop.common.contracts.config_load`. ``docs/configuration.md`` is generated from this schema
(``python tools/gen_config_docs.py``).

Each section belongs to one role; a role adds its own keys to its own section only. Defaults
follow Table 22 of the VAGEN paper unless noted.
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr, ValidationError

from worldloop.common.contracts.config_checks import (  # noqa: F401  (re-exported)
    GROUNDING_EVAL_BOARDS, RELATION_PROMPT_ENVS, SFT_PROBE_SEEDS, check_held_out_seeds, cross_check, held_group_size,
    pass_rule_mode, training_seed_ranges,
)
from worldloop.common.contracts.config_fields import ConfigError, Float, Rule, Section, config_error
from worldloop.common.contracts.config_trainer import MAX_RUN_S, MAX_WAIT_S, TrainerConfig  # noqa: F401  (re-exported)
from worldloop.common.contracts.config_load import (  # noqa: F401  (re-exported)
    env_label, get_key, parse_override, preset_names, read_config_file, resolve_config_path, run_dir_of, to_dict,
    with_overrides,
)

SCORERS = ("rule", "llm", "hybrid")
LOGGERS = ("jsonl", "tensorboard", "wandb")


# --------------------------------------------------------------------------- sections


class RunConfig(Section):
    """The run as a whole: its name, folder, seed and logging."""

    name: str = Field("worldloop", description="the run's name: the wandb run's name, and the learner's run directory "
                                               "runs/<name> when run.run_dir is null and it runs without `worldloop up`")
    run_dir: str | None = Field(None, description="where metrics.jsonl, plots, checkpoints and logs go; "
                                                  "null = runs/<config>-<time> (`worldloop up`)")
    seed: int = Field(0, ge=0, lt=2**32, json_schema_extra={"note": "numpy's and vLLM's seed range"},
                      description="the run's seed: each actor's training seeds are drawn from sha256(run.seed, actor_id); "
                                     "vLLM and keyed evaluation sampling start from it")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="the processes' log level")
    loggers: Annotated[list[str], Rule(f"must list distinct names out of {', '.join(LOGGERS)}",
                                       lambda v: set(v) <= set(LOGGERS) and len(set(v)) == len(v))] = Field(
        default_factory=lambda: ["jsonl"],
        description="where the learner's per-step metrics go (learner/trackers.py): jsonl (metrics.jsonl, always written), "
                    "tensorboard (<run_dir>/tensorboard), wandb (honours WANDB_MODE=offline)")


class RedisConfig(Section):
    """The Redis server that carries the streams, the control record and the counters."""

    url: Annotated[str | None, Rule("must start with redis://, rediss://, unix://, redis+cluster:// or rediss+cluster://",
                                    lambda v: v is None or v.startswith(("redis://", "rediss://", "unix://",
                                                                         "redis+cluster://", "rediss+cluster://")))] = Field(
        None, description="redis://[user:password@]host:port/db, rediss://... or unix://...; a Redis Cluster: "
                          "redis+cluster://[user:password@]host:port (any one node; rediss+cluster:// with TLS); "
                          "null = `worldloop up` starts a local server")
    namespace: Annotated[str, Rule("must be non-empty and hold no { or } (every key is {namespace}:..., a cluster "
                                   "hash tag)", lambda v: bool(v) and "{" not in v and "}" not in v)] = Field(
        "worldloop", description="prefix of every key and stream of the run ({namespace}:rollouts, ...), so several "
                                 "runs can share one Redis or cluster")
    max_backlog: int = Field(512, ge=1, description="backpressure: a producer waits while a stream holds this many "
                                                    "undelivered + pending entries")
    block_ms: int = Field(1000, ge=1, le=MAX_WAIT_S * 1000, json_schema_extra={"unit": "ms", "note": "0 would block forever"},
                          description="how long one XREADGROUP blocks waiting for entries (the roles cap it at 1000 ms)")
    # A live judge refreshes the idle time of the entries it holds every claim_idle_ms / 3 (judge/process.py).
    # Below ~1 s one slow loop step (a Redis round trip, a stats flush, a burst of scoring on the event loop, a
    # refresh that failed once) is no longer small against that period, and judges reclaim each other's live
    # work (issue 31: 10 ms did). Tests that need a fast reclaim pass claim_idle_ms to StreamConsumer directly.
    claim_idle_ms: int = Field(60_000, ge=1000, le=MAX_WAIT_S * 1000, json_schema_extra={
        "unit": "ms", "note": "a live judge refreshes its entries every third of it; below 1 s judges steal live work"},
        description="an entry pending this long in a consumer's list is reclaimed by another consumer (its own is "
                    "taken for dead); live judges refresh the entries they work on every claim_idle_ms / 3")
    reconnect_max_s: Float = Field(30.0, gt=0, le=MAX_WAIT_S, json_schema_extra={"unit": "seconds", "note": "0 would retry in a busy loop"},
                                   description="backoff cap while Redis is unreachable")
    socket_timeout_s: Float = Field(10.0, gt=0, le=MAX_WAIT_S, json_schema_extra={
        "unit": "seconds", "note": "0 would make the socket non-blocking: every command fails at once as if Redis were down"},
        description="timeout of one Redis command (and of connecting, at most 5 s)")
    startup_timeout_s: Float = Field(30.0, gt=0, le=MAX_WAIT_S, description="a process that has never reached Redis gives up after this "
                                     "long with \"cannot reach Redis at ..., check redis.url\" (a wrong URL); once "
                                     "connected it reconnects for as long as it takes")
    max_deliveries: int = Field(5, ge=2, json_schema_extra={"note": "1 would dead-letter every reclaimed entry"},
                                description="an entry delivered this many times and never acked (a poison entry that kills "
                                            "or wedges each consumer that takes it) goes to the dead-letter stream with the "
                                            "reason, its admission budget given back")
    max_message_mb: int = Field(64, ge=1, le=512, json_schema_extra={"note": "Redis's own limit of one value"},
                                description="a payload larger than this is dead-lettered when it is read (its "
                                                      "first 64 KiB are kept)")
    deadletter_maxlen: int = Field(10_000, ge=100, description="the dead-letter stream keeps about this many newest "
                                                               "records (XADD MAXLEN ~)")
    appendfsync: Literal["always", "everysec"] = Field(
        "everysec", description="fsync policy of the Redis `worldloop up` starts (deploy/: WORLDLOOP_REDIS_APPENDFSYNC): "
                                "always = a host crash loses no acknowledged write; everysec = it may lose the last "
                                "second of them (docs/architecture.md \"Durability\"); an external redis.url keeps its own")


class WeightsConfig(Section):
    """The learner's ZeroMQ weight channel to the actors."""

    host: str = Field("127.0.0.1", description="where actors reach the learner")
    bind: str = Field("127.0.0.1", description="where the learner binds its sockets (\"0.0.0.0\" across machines)")
    pub_port: int = Field(5555, ge=0, lt=65536, json_schema_extra={"note": "a TCP port"},
                          description="PUB socket: version announcements")
    fetch_port: int = Field(5556, ge=0, lt=65536, json_schema_extra={"note": "a TCP port"},
                            description="ROUTER socket: chunked fetch of the latest version")
    chunk_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="bytes per fetched chunk of a weight set")
    delta: bool = Field(True, description="send each version also as its changed bytes against the one before it, to "
                                          "subscribers that hold that one (they keep its encoding: one more copy of the "
                                          "weights in host memory); the rebuilt set is checked against the new version's "
                                          "hash")
    # ZeroMQ CURVE: paths to key files made by `zmq.auth.create_certificates`
    curve_server_public: str | None = Field(None, description="CURVE: the server's public .key file (actors); "
                                                              "all curve_* null = plaintext")
    curve_server_secret: str | None = Field(None, description="CURVE: the server's .key_secret file (learner)")
    curve_client_public: str | None = Field(None, description="CURVE (learner): the only client .key (or a folder of them) "
                                                              "it admits; null = any client")
    curve_client_secret: str | None = Field(None, description="CURVE (actors): the client's .key_secret file; "
                                                              "null = an ephemeral client key")
    fetch_timeout_s: Float = Field(30.0, gt=0, le=MAX_WAIT_S, description="an actor gives up when the learner has not answered for this long")
    # a manifest from a buggy or hostile publisher must not make an actor reserve terabytes
    max_bytes: int = Field(0, ge=0, json_schema_extra={"note": "0 = derived from the model directory"},
                           description="the largest weight set an actor accepts before allocating for it; 0 = 4x the model "
                                       "directory's weight files (*.safetensors, *.bin) + 64 MiB (room for a float32 set "
                                       "sent to a bfloat16 actor)")


class MetricsConfig(Section):
    """Each process's Prometheus endpoint."""

    enabled: bool = Field(True, description="serve /metrics")
    host: str = Field("127.0.0.1", description="the address /metrics binds to")
    port: int = Field(0, ge=0, lt=65536, json_schema_extra={"note": "a TCP port; 0 = ephemeral"},
                      description="0 = an ephemeral port, announced in the log and in Redis")


class LoraConfig(Section):
    """LoRA adapters on the policy (learner/lora.py): only the adapters train and travel to the actors."""

    rank: int = Field(0, ge=0, le=1024, json_schema_extra={"note": "0 = off: full weights"},
                      description="LoRA rank r of every adapted linear layer (0: no LoRA, the full weights train)")
    alpha: Float = Field(32.0, gt=0, description="LoRA alpha: the adapter's output is scaled by alpha / rank")
    dropout: Float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input while training")
    target_modules: Annotated[list[str], Rule("must list at least one distinct, non-empty module name",
                                              lambda v: len(v) >= 1 and len(set(v)) == len(v) and all(v))] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="the names (last part) of the linear layers that get an adapter (Qwen2 attention and MLP)")
    vision: bool = Field(False, description="adapt the vision tower's matching layers too; false = the vision tower "
                                            "(and its merger) stays frozen at the base weights")


class ModelConfig(Section):
    """The policy model, and how `worldloop up` makes the embedded tiny one."""

    # worldloop/bootstrap/store.py: shipped (worldloop/warmstarts/), cached ($XDG_CACHE_HOME/worldloop/models) or built
    path: str | None = Field(None, description="a local HF model directory (Qwen2.5-VL family or a text-only causal "
                                               "LM; no hub downloads), used as it is when it exists; null = the warm "
                                               "start of the config's recipe (the tiny model, grounding, SFT: shipped "
                                               "with the package, cached on this machine, or made on the spot)")
    make_tiny_if_missing: bool = Field(True, description="when `path` is null or does not exist, use the warm start of "
                                                         "the config's recipe (shipped, cached or made on the spot; "
                                                         "nothing is written to `path`); false = a missing model is "
                                                         "an error")
    tiny_copy_pretrain_steps: int = Field(0, ge=0, description="steps of in-context copy pre-training of a newly made "
                                                               "tiny model before SFT (0: none)")
    tiny_grounding_steps: int = Field(0, ge=0, description="steps of grounding pre-training of a newly made tiny model "
                                                           "before SFT (first-turn image of a fresh level -> the true state "
                                                           "description, worldloop/bootstrap/grounding.py; 0: none)")
    tiny_grounding_lr: Float = Field(3e-3, gt=0, description="grounding pre-training: learning rate")
    tiny_grounding_batch_size: int = Field(32, ge=1, description="grounding pre-training: levels per step")
    tiny_grounding_seed_start: int = Field(30_000_000, ge=0, description="grounding pre-training: the first seed of "
                                           "its levels (a range disjoint from RL, SFT and eval seeds)")
    # the system prompt is 60 % of the tokens; the image-to-answer distance is the same either way
    tiny_grounding_agent_every: int = Field(4, ge=0, json_schema_extra={"note": "0 = never"},
                                            description="every n-th grounding step shows the whole first turn the actors send "
                                                        "(the env's system prompt too) to tiny_grounding_agent_batch_size "
                                                        "levels; the other steps leave the system prompt out (0: never)")
    tiny_grounding_agent_batch_size: int = Field(8, ge=1, description="levels per whole-first-turn grounding step")
    # the tiny model's random-init tower tells every tile apart; training it from scratch at the tiny
    # presets' learning rates collapses it
    freeze_vision: bool = Field(False, description="keep the vision tower (and its merger) at its initial weights in "
                                                   "grounding pre-training, SFT and the learner")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="the dtype the actors load the model in; auto = float32 on CPU, bfloat16 on CUDA")
    max_model_len: int = Field(4096, ge=64, le=1 << 24, description="context length in tokens; an episode that would exceed it ends "
                                                 "(end_reason \"context\")")
    max_image_side: int = Field(224, ge=28, le=8192, json_schema_extra={"note": "28: one patch of the vision tower"},
                                description="images are resized so that neither side exceeds this (pixels) before "
                                                 "the vision tower")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters on the policy")


class EnvSpec(Section):
    """One env of `actor.envs`."""

    id: str = Field("worldloop/Sokoban-v0", description="a registered gymnasium id")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="the env's keyword arguments")
    train_kwargs: dict[str, Any] = Field(default_factory=dict,
                                         description="kwargs the actors' training episodes alone lay over `kwargs` (a "
                                                     "training curriculum, e.g. Sokoban's max_actions_to_succeed); the "
                                                     "run's evaluator, `worldloop eval`, SFT demonstrations and grounding "
                                                     "pre-training play `kwargs` as they are")
    weight: Float = Field(1.0, ge=0, description="sampling weight among the envs of an actor (0 = never drawn)")
    name: str | None = Field(None, description="label in metrics; null = the id without prefix and version")

    def training_kwargs(self) -> dict[str, Any]:
        """What the actors' training episodes are made with: ``kwargs`` with ``train_kwargs`` over them."""
        return {**self.kwargs, **self.train_kwargs}


class ActorConfig(Section):
    """The actors: envs, sampling, seeds, admission and the generation backend."""

    num_envs: int = Field(8, ge=1, description="episodes an actor plays at once")
    envs: Annotated[list[EnvSpec], Rule("must list at least one env", lambda v: len(v) >= 1)] = Field(
        default_factory=lambda: [EnvSpec()], description="the envs an actor plays, drawn by weight")
    max_turns: int = Field(3, ge=1, description="turns per episode")
    n_samples_per_seed: int = Field(1, ge=1, description="episodes per level (a GRPO group)")
    backend: Literal["hf", "vllm", "server"] = Field(
        "hf", description="generation backend: Hugging Face generate, in-process vLLM, or vLLM inference servers "
                          "(`worldloop serve`; docs/backends.md)")
    servers: Annotated[list[str], Rule("must list base URLs that start with http:// or https://",
                                       lambda v: all(u.startswith(("http://", "https://")) for u in v))] = Field(
        default_factory=list, description="actor.backend=server: base URLs (http://host:port) of running inference "
                                          "servers; empty = `worldloop up` starts one on this machine")
    server_timeout_s: Float = Field(600.0, gt=0, le=MAX_WAIT_S, description="one generation request to a server (a weight load's "
                                                             "drain and pause included)")
    server_retry_s: Float = Field(300.0, gt=0, le=MAX_WAIT_S, description="a request whose server failed is sent again to any usable "
                                                           "server for this long; then its episode is dropped and its "
                                                           "admission refunded")
    server_startup_timeout_s: Float = Field(900.0, gt=0, le=MAX_WAIT_S, description="an actor waits this long at start for a ready "
                                                                     "server")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="where the actor's model runs; auto = cuda when visible")
    hf_decode: Literal["loop", "cached", "generate"] = Field(
        "cached", description="actor.backend=hf (and local evaluations): loop = worldloop's decode loop for Qwen2.5-VL "
                            "(actor/hf_decode.py: generate's tokens and log-probs bit for bit, in less CPU; other models "
                            "use generate); cached = the loop with each episode's keys and values kept between its turns "
                            "(actor/hf_episode_kv.py, CPU: only new tokens are prefilled; generate's distribution, not "
                            "its bits); generate = transformers' generate")
    temperature: Float = Field(0.7, ge=0, description="sampling temperature")
    top_p: Float = Field(0.95, gt=0, le=1, description="nucleus sampling mass")
    max_new_tokens: int = Field(200, ge=1, description="tokens generated per turn at most (less than model.max_model_len)")
    seed_start: int = Field(0, ge=0, lt=2**63, description="training seeds are drawn from [seed_start, seed_end); eval uses seeds >= "
                                           "eval.seed_start")
    seed_end: int = Field(1_000_000, ge=1, le=2**63, json_schema_extra={"note": "a message's seed is below 2^63"},
                          description="the end (exclusive) of the training seed range")
    # common/transport/admission.py: the budget (v + trainer.max_staleness + 1) * trainer.train_batch_size keeps anything from going stale
    admission: bool = Field(True, description="rollout admission: an episode starts only while the run-wide budget "
                                              "(v + trainer.max_staleness + 1) * trainer.train_batch_size allows it; "
                                              "false = actors generate freely and the learner drops what is too old")
    admission_lease_s: Float = Field(120.0, gt=0, le=MAX_WAIT_S, description="an admitted episode whose actor stops renewing its lease "
                                                              "(killed, partitioned) gives its budget back after this long")
    vllm_gpu_memory_utilization: Float = Field(0.5, gt=0, le=1, description="vLLM: the share of GPU memory it may take")
    vllm_enforce_eager: bool = Field(True, description="vLLM: run eagerly (no CUDA graphs)")
    vllm_kv_cache_gib: Float | None = Field(None, gt=0, description="vLLM KV-cache size in GiB; null = from "
                                                                    "vllm_gpu_memory_utilization on GPU, 1 GiB on CPU")
    actor_id: str | None = Field(None, description="the actor's name; null = <hostname>-<pid>")
    # actor/episodes.py: each episode runs its own turn loop. lockstep by default: on 2 CPU cores the
    # per-episode loop ran at 0.56-0.65x lockstep on a mixed suite (docs/benchmarks.md, Rollouts)
    loop: Literal["episode", "lockstep"] = Field(
        "lockstep", description="episode: each episode's next request is ready as soon as its env has stepped, and the "
                               "ready ones go out together within batch_wait_ms (servers get one request per episode "
                               "turn, hf and vllm one batched call); lockstep: one batched call per turn for every "
                               "live episode, after every env has stepped")
    batch_wait_ms: Float = Field(50.0, ge=0, le=60_000, json_schema_extra={"unit": "milliseconds"},
                                 description="loop episode: after the first ready request, how long at most the "
                                             "batcher waits for the other episodes' (those stepping their envs) before "
                                             "it generates (hf, vllm) or sends the batch to the servers")
    weight_update: Literal["interrupt", "wait"] = Field(
        "interrupt", description="how inference servers load a new version: interrupt = at once, requests in flight "
                                 "continue on the new weights (each token keeps the version and log-prob it was "
                                 "sampled with); wait = after the requests in flight finish. hf and vllm apply a "
                                 "version between two batched calls either way")
    env_timeout_s: Float = Field(120.0, gt=0, le=MAX_WAIT_S, description="loop episode: an env reset or step that takes "
                                                                        "longer ends its episode (end_reason "
                                                                        "env_timeout); the others go on")


class ServeConfig(Section):
    """`worldloop serve`: a vLLM inference server for actor.backend=server; the model, dtype, context and
    KV-cache settings come from model.* and actor.vllm_* (actor/server/launch.py)."""

    host: str = Field("127.0.0.1", description="where the server listens")
    port: int = Field(8000, gt=0, lt=65536, json_schema_extra={"note": "a TCP port"},
                      description="the server's port; `worldloop up` picks a free one for the server it starts")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs one server spans (vLLM tensor parallel)")
    extra_args: list[str] = Field(default_factory=list, description="appended to vllm serve's arguments as they are")
    # common/secrets.py server_api_key: the key itself is never in the config, a log or a command line
    api_key_env: str = Field("WORLDLOOP_SERVE_API_KEY", description="the environment variable that holds the servers' API "
                                                                  "key (never logged): a server requires it as "
                                                                  "`Authorization: Bearer <key>` (vLLM's --api-key, given "
                                                                  "as VLLM_API_KEY, off the command line) and the actors "
                                                                  "send it; unset or empty = no key")
    api_key_file: str | None = Field(None, description="a file whose first line is the servers' API key, read instead of "
                                                       "api_key_env's variable; null = the variable")


class JudgeConfig(Section):
    """The judges: which scorers score which env, and the LLM endpoint they may call."""

    enabled: bool = Field(True, description="score the reasoning; false = actors push straight to the learner's stream")
    scorers: Annotated[dict[str, list[str]], Rule(f"must name scorers out of {', '.join(SCORERS)}",
                                                  lambda v: all(s in SCORERS for names in v.values() for s in names))] = Field(
        default_factory=lambda: {"default": ["rule"]},
        description="scorer names per env name (\"default\" applies to envs not listed): rule, llm, hybrid")
    # vagen: VAGEN's code (judge/vagen_score.py) scores target, box and hole relative to the player, both axes
    rule_mode: Literal["f1", "vagen", "local"] = Field(
        "f1", description="how `rule` (and `hybrid`'s extracted facts) score Sokoban/FrozenLake descriptions: f1 = per-axis "
                          "relation facts over all pairs (judge/rule/); vagen = VAGEN's code (judge/vagen_score.py), and "
                          "those envs then get relation_prompt=vagen; local = FrozenLake's goal and the holes next to the "
                          "player, item by item (judge/local_score.py), and FrozenLake gets relation_prompt=local: the "
                          "prompt asks for exactly what is scored")
    beta_grounding: Float = Field(0.5, description="weight of the grounding score in a turn's reasoning reward")
    beta_worldmodeling: Float = Field(0.5, description="weight of the world-modeling score in a turn's reasoning reward")
    concurrency: int = Field(16, ge=1, description="LLM requests in flight per judge process at most")
    timeout_s: Float = Field(30.0, gt=0, le=MAX_WAIT_S, description="per LLM request")
    max_retries: int = Field(3, ge=0, description="retries of a failed LLM request (exponential backoff)")
    backoff_s: Float = Field(0.5, ge=0, le=MAX_WAIT_S, description="first backoff of an LLM retry (doubled each attempt, jittered)")
    base_url: str | None = Field(None, description="any OpenAI-compatible endpoint; null = the OpenAI API")
    model: str = Field("gpt-4o-mini", description="the judge LLM's model name")
    api_key_env: str = Field("OPENAI_API_KEY", description="the environment variable the API key is read from (never logged)")
    cache_size: int = Field(10_000, ge=0, json_schema_extra={"note": "0 = no cache"},
                            description="identical LLM requests are answered from an LRU of this many entries")
    repetition_top_k: int = Field(5, ge=0, json_schema_extra={"note": "0 = no repetition penalty"},
                                  description="repetition penalty (VAGEN App. D.1.2): a part that repeats one of the agent's "
                                              "top_k most frequent sentences is penalised")
    repetition_f1_threshold: Float = Field(0.7, ge=0, le=1, description="repetition penalty: only parts scoring below "
                                                                       "this are penalised (a correct part never is)")
    repetition_penalty: Float = Field(0.1, description="repetition penalty: subtracted from the part's score")
    fallback_score: Float = Field(0.0, description="the score of an LLM scorer whose endpoint stays down (flagged fallback)")
    batch_size: int = Field(8, ge=1, description="trajectories read per XREADGROUP (and held in flight at most)")
    gate_threshold: Float = Field(0.5, ge=0, le=1, description="Argos Eq. 9 gate when several scorers apply: the first "
                                                               "listed is the gate; below the threshold the gate's score "
                                                               "stands alone, at or above it the weighted mean of all "
                                                               "applicable scorers")
    scorer_weights: Annotated[dict[str, Float], Rule(f"keys must be {'/'.join(SCORERS)} with weights > 0",
                                                     lambda v: all(k in SCORERS and w > 0 for k, w in v.items()))] = Field(
        default_factory=lambda: {"rule": 1.0, "llm": 1.0, "hybrid": 1.0},
        description="the weights of the gate's weighted mean, per scorer")
    max_tokens: int = Field(512, ge=1, le=1 << 20, description="judge reply length (llm: think + verdict; hybrid: the JSON list)")
    dedup_window_s: Float = Field(86400.0, gt=0, le=MAX_WAIT_S, description="trajectory ids already forwarded to `scored` are remembered "
                                                             "this long")


class SFTConfig(Section):
    """The warm start on solver demonstrations that `worldloop up` runs on a tiny model it has just
    made (a real checkpoint is never touched); the defaults are sized for that tiny model: 64
    Sokoban episodes x 20 epochs take ~80 s on 2 CPU cores and reach 100% well-formed answers."""

    enabled: bool = Field(True, description="warm-start a newly made tiny model on demonstrations")
    episodes: int = Field(64, ge=1, description="demonstration episodes")
    epochs: int = Field(20, ge=0, description="passes over the demonstrations")
    lr: Float = Field(5e-3, gt=0, description="learning rate")
    batch_size: int = Field(8, ge=1, description="demonstrations per step")
    seed_start: int = Field(5_000_000, ge=0, lt=2**63, description="demonstrations (and the format probes after them) are played on "
                                                         "seeds seed_start, seed_start+1, ... (disjoint from the RL and "
                                                         "held-out eval seeds)")
    answer_style: Literal["expert", "concise"] = Field(
        "expert", description="expert: the env's expert_response() as is; concise: the same answer with the observation and "
                              "prediction cut to their first observation_relations sentences and an empty reasoning")
    observation_relations: int = Field(2, ge=1, description="concise: sentences kept of the observation and prediction "
                                                            "(all of them where the env's relation_prompt is local: "
                                                            "exactly what its prompt asks for)")
    # plan: the model picks its move right after reading the board, then predicts and answers from that choice
    # (docs/learning-history.md "What the presets do, and why": Sokoban)
    concise_reasoning: Literal["empty", "plan", "outlook"] = Field(
        "empty", description="the concise reasoning: empty, or plan = the turn's actions (as the answer writes them) before "
                             "the prediction, or outlook = what each move would run into (the env's move_outlook(): "
                             "FrozenLake), so that the answer follows from the agent's own words")
    level_pool: int = Field(
        1, ge=1, le=8, description="demonstrations are drawn from level_pool x episodes seeds: first every level whose "
                                   "first state tempts a dead end (a move toward the goal that fails: the env's "
                                   "tempting_dead_end(), FrozenLake's hole on the way), then the others, each in seed "
                                   "order; 1: the first episodes seeds as they come")
    turn_plan: Literal["prefix", "distinct"] = Field(
        "prefix", description="how much of its plan the demonstrator commits per turn: prefix = the first "
                              "max_actions_per_step actions (the env's expert); distinct = up to the first repeated move, "
                              "then it looks again (one step per direction: the answer follows from the observed relations)")


class UpConfig(Section):
    """`worldloop up`: the processes it starts and its time budget."""

    num_actors: int = Field(2, ge=0, description="actor processes")
    num_judges: int = Field(1, ge=0, description="judge processes")
    time_limit_s: Float | None = Field(None, gt=0, le=MAX_RUN_S, json_schema_extra={"unit": "seconds", "note": "no limit"},
                                       description="the whole run (model, grounding, SFT, RL, final evaluation) should end "
                                                   "within this: once the model is ready the learner gets trainer.time_limit_s "
                                                   "= what is left minus up.final_reserve_s, or less if the config asks for "
                                                   "less; null = trainer.total_steps alone decides")
    final_reserve_s: Float = Field(60.0, ge=0, le=MAX_WAIT_S, json_schema_extra={"unit": "seconds"},
                                   description="time kept back from the learner for the final held-out evaluation and shutdown; "
                                               "the learner keeps back more once an in-run evaluation's CPU seconds, "
                                               "scaled to trainer.final_eval_episodes, say the final one needs more")
    final_eval_max_share: Float = Field(0.25, gt=0, le=1,
                                        description="the most of up.time_limit_s the final evaluation may keep back from the "
                                                    "learner (up.final_reserve_s included), however long it is estimated to "
                                                    "take; beyond it the final evaluation is cut at its deadline (fewer "
                                                    "episodes, said in its record), so a slow or loaded machine still trains")
    progress_interval_s: Float = Field(2.0, gt=0, le=3600, description="seconds between progress lines on the terminal")


class EvalConfig(Section):
    """`worldloop eval` and the held-out seeds of every evaluation."""

    episodes: int = Field(32, ge=1, description="episodes per env")
    seed_start: int = Field(10_000_000, ge=0, lt=2**63, description="the first held-out seed (disjoint from actor.seed_start..seed_end)")
    concurrency: int = Field(8, ge=1, description="episodes played (requests in flight) at once")
    max_tokens: int = Field(400, ge=1, le=1 << 20, description="tokens per reply (Table 21: 150/400)")
    temperature: Float = Field(0.7, ge=0, description="sampling temperature")
    single_turn: bool = Field(False, description="WMAct protocol: one turn that may hold the whole plan")
    output: str | None = Field(None, description="the results folder; null = runs/eval-<model>-<time>")
    max_turns: int | None = Field(None, ge=1, description="turns per episode; null = the paper's value per env (VAGEN "
                                                          "Tables 7-15; actor.max_turns otherwise)")
    top_p: Float = Field(1.0, gt=0, le=1, description="nucleus sampling mass (the APIs' default; the same for local and "
                                                      "remote models)")
    # keyed: two models compared on the same seeds share their noise (common random numbers)
    sampling: Literal["keyed", "batch"] = Field(
        "keyed", description="local models: keyed draws each turn's sampling noise from (run.seed, env, seed, turn) alone, "
                             "so an episode does not depend on its batch; batch seeds each batched call instead "
                             "(before 2026-11-26)")
    prompt_format: str | None = Field(None, description="reasoning strategy; null = the env's default")
    state_format: str | None = Field(None, description="state representation; null = the env's default")
    render_mode: Literal["vision", "text"] = Field("vision", description="observations as images or as text")
    timeout_s: Float = Field(120.0, gt=0, le=MAX_WAIT_S, description="per request to an OpenAI-compatible endpoint")
    max_retries: int = Field(4, ge=0, description="retries on 429 / 5xx / timeouts / connection errors, exponential backoff")
    backoff_s: Float = Field(1.0, ge=0, le=MAX_WAIT_S, description="first backoff of a retry")
    api_key_env: str = Field("OPENAI_API_KEY", description="the environment variable the API key is read from (never logged)")


class Config(Section):
    """The whole tree: one section per role or concern."""

    run: RunConfig = Field(default_factory=RunConfig, description="the run")
    redis: RedisConfig = Field(default_factory=RedisConfig, description="Redis")
    weights: WeightsConfig = Field(default_factory=WeightsConfig, description="the weight channel")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="Prometheus")
    model: ModelConfig = Field(default_factory=ModelConfig, description="the model")
    actor: ActorConfig = Field(default_factory=ActorConfig, description="the actors")
    serve: ServeConfig = Field(default_factory=ServeConfig, description="worldloop serve")
    judge: JudgeConfig = Field(default_factory=JudgeConfig, description="the judges")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="the learner")
    sft: SFTConfig = Field(default_factory=SFTConfig, description="the SFT warm start")
    up: UpConfig = Field(default_factory=UpConfig, description="worldloop up")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="evaluation")
    # set by the loader: the file the config came from (not a key in YAML)
    _source: str | None = PrivateAttr(None)

    @property
    def source(self) -> str | None:
        """The file the config was read from (a preset's path inside the package), or None."""
        return self._source

    @source.setter
    def source(self, value: str | None) -> None:
        self._source = value


# --------------------------------------------------------------------------- public API


def config_from_dict(data: dict | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Validate a config tree (with overrides applied) against the schema, then the cross-field rules."""
    try:
        cfg = Config.model_validate(with_overrides(data, overrides))
    except ValidationError as e:
        raise config_error(e, Config) from None
    pass_rule_mode(cfg)
    cross_check(cfg)
    return cfg


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a YAML file or preset (or only defaults when ``path`` is None) and apply overrides."""
    data, p = read_config_file(path) if path is not None else ({}, None)
    cfg = config_from_dict(data, overrides)
    cfg.source = str(p) if p is not None else None
    return cfg
