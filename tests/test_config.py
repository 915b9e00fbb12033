"""The typed config tree: unknown keys, bad types and cross checks name the key; presets load."""

from __future__ import annotations

from pathlib import Path

import pytest

from worldloop.common.contracts.config import Config, ConfigError, config_from_dict, load_config, parse_override, to_dict

ROOT = Path(__file__).resolve().parent.parent


def _error(data: dict | None = None, overrides: tuple[str, ...] = ()) -> ConfigError:
    with pytest.raises(ConfigError, match="^config key '") as ei:
        config_from_dict(data or {}, list(overrides))
    return ei.value


def test_defaults_load() -> None:
    cfg = load_config(None)
    assert isinstance(cfg, Config) and cfg.redis.max_backlog == 512 and cfg.source is None


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_preset_loads(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.source == str(path)
    assert to_dict(cfg)["redis"]["namespace"] == cfg.redis.namespace


def test_unknown_key_is_named() -> None:
    e = _error({"redis": {"max_backlogg": 3}})
    assert e.key == "redis.max_backlogg" and "unknown key" in e.reason and "max_backlog" in e.reason
    assert _error({"nosuchsection": {}}).key == "nosuchsection"
    assert _error(overrides=("trainer.lr=0.1",)).key == "trainer.lr"


@pytest.mark.parametrize("override,key,words", [
    ("redis.max_backlog=lots", "redis.max_backlog", "expected an integer"),
    ("redis.max_backlog=1.5", "redis.max_backlog", "expected an integer"),
    ("actor.temperature=hot", "actor.temperature", "expected a number"),
    ("judge.enabled=1", "judge.enabled", "expected true/false"),
    ("actor.backend=tpu", "actor.backend", "must be one of"),
    ("actor.envs=notalist", "actor.envs", "expected a list"),
    ("actor.envs=[{id: x, weight: heavy}]", "actor.envs[0].weight", "expected a number"),
    ("redis.url=http://x", "redis.url", "must start with redis://"),
    ("redis.max_backlog=0", "redis.max_backlog", "must be >= 1"),
    ("actor.top_p=1.5", "actor.top_p", "(0, 1]"),
    ("weights.max_bytes=-1", "weights.max_bytes", "must be >= 0"),
    ("up.time_limit_s=0", "up.time_limit_s", "must be in (0, 31622400] seconds or null"),
    ("trainer.time_limit_s=-5", "trainer.time_limit_s", "must be in (0, 31622400] seconds or null"),
    ("trainer.micro_batch_tokens=-1", "trainer.micro_batch_tokens", "must be auto or >= 0"),
    ("trainer.micro_batch_tokens=some", "trainer.micro_batch_tokens", "must be one of ['auto']"),
    ("trainer.pad_to_multiple=0", "trainer.pad_to_multiple", "must be auto or an integer in [1, 4096]"),
    ("trainer.pad_to_multiple=8192", "trainer.pad_to_multiple", "must be auto or an integer in [1, 4096]"),
    ("trainer.pad_to_multiple=big", "trainer.pad_to_multiple", "must be one of ['auto']"),
    ("trainer.logprob_chunk_tokens=0", "trainer.logprob_chunk_tokens", "must be in [1, 1048576]"),
    ("trainer.liger=maybe", "trainer.liger", "expected true/false"),
    ("actor.servers=[localhost:8000]", "actor.servers", "http:// or https://"),
    ("actor.server_retry_s=0", "actor.server_retry_s", "must be in (0, 2592000]"),
    ("serve.port=70000", "serve.port", "must be in (0, 65536) (a TCP port)"),
    ("serve.tensor_parallel_size=0", "serve.tensor_parallel_size", "must be >= 1"),
    ("serve.extra_args=--enforce-eager", "serve.extra_args", "expected a list"),
    ("redis.max_deliveries=1", "redis.max_deliveries", "must be >= 2"),
    ("redis.max_message_mb=0", "redis.max_message_mb", "must be in [1, 512]"),
    ("redis.deadletter_maxlen=10", "redis.deadletter_maxlen", "must be >= 100"),
    ("redis.appendfsync=no", "redis.appendfsync", "must be one of"),
    ("trainer.lease_ttl_s=1", "trainer.lease_ttl_s", "must be in [3, 2592000] seconds"),
    # issue 38, finding 13: values that were taken, each refused naming its key and the reason
    ("model.max_model_len=-5", "model.max_model_len", "must be in [64, 16777216]"),
    ("actor.max_new_tokens=1000000000", "actor.max_new_tokens", "must be less than model.max_model_len (4096)"),
    ("redis.max_message_mb=100000", "redis.max_message_mb", "must be in [1, 512] (Redis's own limit of one value)"),
    ("trainer.lease_ttl_s=.inf", "trainer.lease_ttl_s", "must be a finite number (not .inf or .nan), got float inf"),
    # the same kind, found by looking: non-finite numbers anywhere, durations that overflow where used,
    # sizes and lengths out of what anything can take, seeds that numpy/gymnasium/vLLM refuse mid-run
    ("trainer.lease_ttl_s=.nan", "trainer.lease_ttl_s", "must be a finite number"),
    ("judge.scorer_weights={rule: .inf}", "judge.scorer_weights.rule", "must be a finite number"),
    ("actor.temperature=.inf", "actor.temperature", "must be a finite number"),
    ("redis.socket_timeout_s=1e300", "redis.socket_timeout_s", "must be in (0, 2592000] seconds"),
    ("redis.block_ms=4611686018427387904", "redis.block_ms", "must be in [1, 2592000000] ms"),
    ("judge.dedup_window_s=1e12", "judge.dedup_window_s", "must be in (0, 2592000]"),
    ("weights.fetch_timeout_s=1e30", "weights.fetch_timeout_s", "must be in (0, 2592000]"),
    ("up.progress_interval_s=-1", "up.progress_interval_s", "must be in (0, 3600]"),
    ("model.max_image_side=-3", "model.max_image_side", "must be in [28, 8192]"),
    ("judge.max_tokens=1000000000", "judge.max_tokens", "must be in [1, 1048576]"),
    ("eval.max_tokens=0", "eval.max_tokens", "must be in [1, 1048576]"),
    ("run.seed=-1", "run.seed", "must be in [0, 4294967296)"),
    ("run.seed=4294967296", "run.seed", "must be in [0, 4294967296)"),
    ("actor.seed_start=-3", "actor.seed_start", "must be in [0, 9223372036854775808)"),
    ("eval.seed_start=-1", "eval.seed_start", "must be in [0, 9223372036854775808)"),
    ("actor.seed_end=9223372036854775809", "actor.seed_end", "must be in [1, 9223372036854775808]"),
])
def test_bad_value_is_named(override: str, key: str, words: str) -> None:
    e = _error(overrides=(override,))
    assert e.key == key and words in e.reason
    assert key in str(e)


def test_learner_speed_keys_take_auto_or_a_number() -> None:
    cfg = config_from_dict({}, ["trainer.micro_batch_tokens=auto", "trainer.pad_to_multiple=128", "trainer.liger=off"])
    assert (cfg.trainer.micro_batch_tokens, cfg.trainer.pad_to_multiple, cfg.trainer.liger) == ("auto", 128, False)
    assert config_from_dict({}, ["trainer.liger=on"]).trainer.liger is True  # YAML's on/off are booleans
    cfg = config_from_dict({}, [])
    assert (cfg.trainer.micro_batch_tokens, cfg.trainer.pad_to_multiple, cfg.trainer.liger) == (0, "auto", "auto")
    assert cfg.trainer.logprob_chunk_tokens == 512


def test_override_parsing() -> None:
    assert parse_override("a.b=3") == ("a.b", 3)
    assert parse_override("a.b=null") == ("a.b", None)
    assert parse_override("a.b=") == ("a.b", "")
    assert parse_override("a.b=x=y") == ("a.b", "x=y")
    assert parse_override("a.b=[1, 2]") == ("a.b", [1, 2])
    with pytest.raises(ConfigError, match="key.sub=value"):
        parse_override("novalue")
    with pytest.raises(ConfigError, match="an override must name a key before '='"):
        parse_override("=3")
    with pytest.raises(ConfigError, match="value '\\[unclosed' is not valid YAML") as ei:
        parse_override("a.b=[unclosed")
    assert ei.value.key == "a.b"


def test_overrides_apply_on_top_of_file(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("redis:\n  namespace: fromfile\n  max_backlog: 7\n")
    cfg = load_config(f, ["redis.max_backlog=9", "redis.url=rediss://:pw@h:1/0",
                          "actor.envs=[{id: worldloop/FrozenLake-v0, kwargs: {size: 4}}]", "judge.base_url=null"])
    assert (cfg.redis.namespace, cfg.redis.max_backlog, cfg.redis.url) == ("fromfile", 9, "rediss://:pw@h:1/0")
    assert cfg.actor.envs[0].id == "worldloop/FrozenLake-v0" and cfg.actor.envs[0].kwargs == {"size": 4}
    assert cfg.judge.base_url is None
    assert isinstance(load_config(None, ["trainer.kl_coef=1"]).trainer.kl_coef, float)
    # YAML 1.1 reads 1e-6 (no dot) as a string; a float key still takes it
    assert load_config(None, ["trainer.actor_lr=1e-6"]).trainer.actor_lr == 1e-6
    assert _error(overrides=("trainer.actor_lr=1e-6x",)).key == "trainer.actor_lr"
    assert _error(overrides=("trainer.total_steps=1e3",)).key == "trainer.total_steps"  # not for ints
    assert _error(overrides=("redis.max_backlog.x=1",)).key == "redis.max_backlog"


def test_cross_checks() -> None:
    e = _error(overrides=("trainer.train_batch_size=10", "trainer.ppo_mini_batch_size=4"))
    assert e.key == "trainer.ppo_mini_batch_size" and "divide" in e.reason
    e = _error(overrides=("trainer.ppo_mini_batch_size=8", "trainer.micro_batch_size=3"))
    assert e.key == "trainer.micro_batch_size"
    assert _error(overrides=("actor.seed_start=5", "actor.seed_end=5")).key == "actor.seed_end"
    assert _error(overrides=("eval.seed_start=10",)).key == "eval.seed_start"
    assert _error(overrides=("eval.seed_start=0",)).key == "eval.seed_start"  # the first training seed too
    assert load_config(None, ["eval.seed_start=1000000"]).eval.seed_start == 1_000_000  # = actor.seed_end: held out
    e = _error(overrides=("judge.scorers={default: [magic]}",))
    assert e.key == "judge.scorers" and "magic" in e.reason
    assert _error(overrides=("weights.curve_client_secret=/c.key_secret",)).key == "weights.curve_server_public"
    assert _error(overrides=("weights.curve_client_public=/c.key",)).key == "weights.curve_server_secret"
    # each side names only its own files: an actor never needs the server's secret key
    assert load_config(None, ["weights.curve_server_public=/s.key"]).weights.curve_server_secret is None
    # k1 as a loss term lowers every sampled token's probability; in the reward, or k3 as a loss, is fine
    e = _error(overrides=("trainer.kl_in_reward=false", "trainer.kl_coef=0.05"))
    assert e.key == "trainer.kl_estimator" and "low_var_kl" in e.reason
    assert load_config(None, ["trainer.kl_in_reward=false", "trainer.kl_estimator=low_var_kl"]).trainer.kl_coef > 0
    assert load_config(None, ["trainer.kl_in_reward=false", "trainer.kl_coef=0"]).trainer.kl_estimator == "kl"


def test_held_out_seeds_must_miss_every_training_range() -> None:
    from worldloop.common.contracts.config import check_held_out_seeds, training_seed_ranges

    cfg = load_config("configs/tiny-frozenlake.yaml")
    ranges = {what.split(" [")[0]: (lo, hi) for what, lo, hi in training_seed_ranges(cfg)}
    assert ranges == {"the RL seeds": (0, 1_000_000),
                      "the SFT demonstration seeds": (5_000_000, 5_000_000 + cfg.sft.episodes + 8),
                      "the grounding pre-training seeds": (30_000_000, 30_000_000 + 1000 * 32 + 256)}
    check_held_out_seeds(cfg, 10_000_000, 512)  # the bench's held-out seeds
    for lo, what in ((999_999, "RL"), (4_999_999, "demonstration"), (30_032_255, "grounding")):
        with pytest.raises(ConfigError, match=what) as e:
            check_held_out_seeds(cfg, lo, 2, key="--seed-start")
        assert e.value.key == "--seed-start"
    off = load_config("configs/tiny-frozenlake.yaml", ["sft.enabled=false", "model.tiny_grounding_steps=0"])
    assert [w for w, *_ in training_seed_ranges(off)] == ["the RL seeds [actor.seed_start, actor.seed_end)"]
    check_held_out_seeds(off, 5_000_000, 10)


def test_the_run_evaluators_seeds_final_ones_included_miss_every_training_range() -> None:
    # the preset: in-run 64 and final 512 seeds from 10,000,000: [10_000_000, 10_000_512) is held out
    cfg = load_config("configs/tiny-frozenlake.yaml")
    assert (cfg.trainer.eval_episodes, cfg.trainer.final_eval_episodes) == (64, 512)
    # the final evaluation's seeds reach into the grounding levels [30_000_000, ...): 29_999_900 + 512 > 30M
    with pytest.raises(ConfigError, match="run evaluator's held-out seeds") as e:
        load_config("configs/tiny-frozenlake.yaml", ["eval.seed_start=29999900"])
    assert e.value.key == "eval.seed_start"
    load_config("configs/tiny-frozenlake.yaml", ["eval.seed_start=29999900", "trainer.final_eval_episodes=64"])
    load_config("configs/tiny-frozenlake.yaml", ["eval.seed_start=29999900", "trainer.eval_every=0"])  # no evaluator
    with pytest.raises(ConfigError, match=r"must be in \(0, 1\]"):
        load_config(None, ["trainer.eval_cpu_share=0"])
    with pytest.raises(ConfigError, match="trainer.eval_nice"):
        load_config(None, ["trainer.eval_nice=20"])


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("redis: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("just a string\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(scalar)


@pytest.mark.parametrize("override,key,words", [
    # a live judge refreshes its entries every claim_idle_ms / 3: below 1 s judges steal each other's live work
    ("redis.claim_idle_ms=10", "redis.claim_idle_ms", "must be in [1000, 2592000000] ms (a live judge refreshes"),
    ("redis.claim_idle_ms=999", "redis.claim_idle_ms", "must be in [1000, 2592000000] ms"),
    ("redis.block_ms=0", "redis.block_ms", "must be in [1, 2592000000] ms (0 would block forever)"),
    ("redis.socket_timeout_s=0", "redis.socket_timeout_s", "must be in (0, 2592000] seconds (0 would make the socket non-blocking"),
    ("redis.reconnect_max_s=0", "redis.reconnect_max_s", "must be in (0, 2592000] seconds"),
    ("actor.envs=[{id: x, weight: -1}]", "actor.envs[0].weight", "must be >= 0, got -1"),
    ("actor.envs=[{id: x, weight: 0}, {id: y, weight: 0.0}]", "actor.envs", "positive sum"),
    ("actor.vllm_gpu_memory_utilization=0", "actor.vllm_gpu_memory_utilization", "must be in (0, 1]"),
])
def test_new_bounds_are_named(override: str, key: str, words: str) -> None:
    e = _error(overrides=(override,))
    assert e.key == key and words in e.reason, e


def test_the_lowest_accepted_redis_timings_and_the_presets_values() -> None:
    cfg = load_config(None, ["redis.claim_idle_ms=1000", "redis.block_ms=1", "redis.socket_timeout_s=0.1"])
    assert (cfg.redis.claim_idle_ms, cfg.redis.block_ms, cfg.redis.socket_timeout_s) == (1000, 1, 0.1)
    assert load_config("tiny-sokoban").redis.claim_idle_ms == 20_000
    # code may still set a key directly (as the learner's reclaim test does); only loading checks
    cfg.redis.claim_idle_ms = 1
    assert cfg.redis.claim_idle_ms == 1


@pytest.mark.parametrize("override,key,reason", [
    ("judge.scorer_weights={rule: 1, llm: [2]}", "judge.scorer_weights.llm", "expected a number, got list [2]"),
    ("judge.scorers={1: [rule]}", "judge.scorers.<key>", "expected a string, got int 1"),
    ("actor.envs=[{id: x}, {id: y, kwargs: {size: 3}, nope: 1}]", "actor.envs[1].nope",
     "unknown key (known keys here: id, kwargs, name, train_kwargs, weight)"),
    ("actor.envs=[{id: x}, 7]", "actor.envs[1]", "expected a mapping for section EnvSpec, got 7"),
    ("trainer=[1]", "trainer", "expected a mapping for section TrainerConfig, got [1]"),
    ("trainer.loss_agg_mode=mean", "trainer.loss_agg_mode",
     "must be one of ['token-mean', 'seq-mean-token-mean', 'seq-mean-token-sum'], got 'mean'"),
    ("trainer.zero_stage='1'", "trainer.zero_stage", "must be one of [0, 1, 2, 3], got '1'"),
    ("judge.enabled='yes'", "judge.enabled", "expected true/false, got 'yes'"),
    ("judge.enabled=0", "judge.enabled", "expected true/false, got 0"),
    ("trainer.use_critic=1.0", "trainer.use_critic", "expected true/false, got 1.0"),
    ("actor.max_turns=true", "actor.max_turns", "expected an integer, got bool True"),
    ("actor.max_turns=2.0", "actor.max_turns", "expected an integer, got float 2.0"),
    ("trainer.actor_lr=false", "trainer.actor_lr", "expected a number, got bool False"),
    ("run.name=3", "run.name", "expected a string, got int 3"),
    ("judge.scorers={default: [magic]}", "judge.scorers", "must name scorers out of rule, llm, hybrid, got {'default': ['magic']}"),
    ("source=x.yaml", "source", "unknown key (known keys here: actor, eval, judge, metrics, model, redis, run, serve, sft, trainer, up, weights)"),
])
def test_each_kind_of_error_names_the_dotted_key_and_the_reason(override: str, key: str, reason: str) -> None:
    e = _error(overrides=(override,))
    assert (e.key, e.reason) == (key, reason)
    assert str(e) == f"config key '{key}': {reason}"


def test_number_text_is_a_number_everywhere_a_float_goes() -> None:
    cfg = config_from_dict({"judge": {"scorer_weights": {"rule": "1e-3", "llm": 2}}, "trainer": {"critic_lr": "+2E-5"},
                            "up": {"time_limit_s": "3e2"}})
    assert cfg.judge.scorer_weights == {"rule": 1e-3, "llm": 2.0} and isinstance(cfg.judge.scorer_weights["llm"], float)
    assert (cfg.trainer.critic_lr, cfg.up.time_limit_s) == (2e-5, 300.0)
    assert _error({"trainer": {"critic_lr": "inf"}}).key == "trainer.critic_lr"  # only number text, not words


def test_the_resolved_config_round_trips_through_plain_data() -> None:
    cfg = load_config("tiny-sokoban", ["judge.rule_mode=vagen", "trainer.total_steps=7"])
    data = to_dict(cfg)
    assert "source" not in data and data["actor"]["envs"][0]["kwargs"]["relation_prompt"] == "vagen"
    again = config_from_dict(data)
    assert to_dict(again) == data and again.source is None and cfg.source.endswith("tiny-sokoban.yaml")
    cfg.trainer.total_steps = 9  # attributes stay assignable
    assert to_dict(cfg)["trainer"]["total_steps"] == 9 and data["trainer"]["total_steps"] == 7
