"""The learner with real DeepSpeed (CPU, gloo) on the tiny Qwen2.5-VL, a real redis-server and the
real ZeroMQ weight channel: a step on trajectories with images trains, bumps the version, publishes
weights an HFBackend accepts, writes metrics/control, and acks only after a checkpoint; every
estimator runs; micro-batch weighting is the exact token mean; ZeRO stages 1-3 give the same update
as ZeRO-0 (with one rank the partitioning must not change the arithmetic), and under ZeRO-3 the
weights are gathered from the shards into full tensors named like the actor's model."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch

from worldloop.actor.generation import check_state_dict
from worldloop.actor.hf_backend import HFBackend
from worldloop.common.transport.control import read_control
from worldloop.common.contracts.keys import Keys, SCORED_GROUP
from worldloop.common.contracts.modeling import ChatCodec, build_sequence, collate, load_policy, token_logprobs
from worldloop.common.transport.redis_local import LocalRedis
from worldloop.common.contracts.schemas import encode_trajectory
from worldloop.common.transport.streams import StreamProducer, connect
from worldloop.common.transport.weights import WeightSubscriber
from worldloop.learner import checkpoint
from worldloop.learner.engine import init_distributed
from worldloop.learner.process import Learner
from worldloop.testing.trajectories import behaviour_logprobs_from, synthetic_trajectory
from worldloop.testing.learner import tiny_learner_config, train_until_stopped

TEMPERATURE = 0.7  # the actor's sampling temperature (config default)


@pytest.fixture(scope="module")
def model_dir(shared_tiny_model) -> Path:
    return shared_tiny_model(max_image_side=112)


@pytest.fixture(scope="module")
def redis_srv():
    srv = LocalRedis().start()
    yield srv
    srv.close()


def _learner(model_dir: Path, url: str, run_dir: Path, namespace: str):
    cfg = tiny_learner_config(model_dir, url, run_dir, namespace=namespace, total_steps=2, checkpoint_every=2,
                              kl_coef=0.01)
    return Learner(cfg, init_distributed(cfg))


@pytest.fixture(scope="module")
def learner(model_dir, redis_srv, tmp_path_factory):
    """One learner shared by the tests that each train it further (any order): none of them asks what
    state it is in, only that their own update moves the policy."""
    lrn = _learner(model_dir, redis_srv.url, tmp_path_factory.mktemp("run"), "step")
    yield lrn
    lrn.close()


@pytest.fixture
def fresh_learner(model_dir, redis_srv, tmp_path):
    """A learner of its own at step 0 with the initial weights (namespace step-fresh), for the test
    whose numbers depend on that (importance weight 1, KL 0, version 1 after its first step)."""
    lrn = _learner(model_dir, redis_srv.url, tmp_path / "run", "step-fresh")
    yield lrn
    lrn.close()


def _trajectories(model_dir: Path, n: int, prefix: str) -> list[dict]:
    codec = ChatCodec(model_dir, max_image_side=112)
    score = behaviour_logprobs_from(load_policy(model_dir), codec, TEMPERATURE)
    return [synthetic_trajectory(codec, trajectory_id=f"{prefix}{i}", seed=i, turns=2, response_tokens=6,
                                 env_reward=float(i % 2), success=i % 2 == 1, logprobs=score) for i in range(n)]


def _logprobs(model, model_dir: Path, traj: dict) -> torch.Tensor:
    codec = ChatCodec(model_dir, max_image_side=112)
    batch = collate([build_sequence(traj)], codec)
    with torch.no_grad():  # the learner's distribution: prompt-only tokens masked, as the actors sample
        return token_logprobs(model, batch, temperature=TEMPERATURE, masked_ids=codec.prompt_only_ids)[0][0]


@pytest.mark.slow
def test_step_trains_publishes_and_an_actor_loads_the_weights(fresh_learner, model_dir, redis_srv):
    learner = fresh_learner
    keys = Keys("step-fresh")
    trajs = _trajectories(model_dir, 8, "s")
    prod = StreamProducer(redis_srv.url, keys.scored, 100)
    for t in trajs:
        prod.add(encode_trajectory(t))
    sub = WeightSubscriber("127.0.0.1", learner.publisher.pub_port, learner.publisher.fetch_port, fetch_timeout_s=30)
    v0, initial = sub.fetch(min_version=-1)
    assert v0 == 0 and learner.version == 0
    before = {k: v.clone() for k, v in initial.items()}

    rec = learner.step()
    assert rec["step"] == 1 and rec["policy_version"] == 1 and learner.version == 1
    # behaviour log-probs came from the same weights at the same temperature: importance weight 1
    assert rec["importance_weight"]["mean"] == pytest.approx(1.0, abs=1e-4)
    assert rec["importance_weight"]["max"] == pytest.approx(1.0, abs=1e-3)
    assert rec["importance_weight"]["min"] == pytest.approx(1.0, abs=1e-3)
    assert rec["staleness_mean"] == 0.0 and rec["trajectories"] == 4
    # the same weights sampled every token (v0, the version trained from): no mismatch, nothing masked
    mm = rec["mismatch"]
    assert mm["current_tokens"] == mm["tokens"] == rec["response_tokens"]
    assert mm["kl_k3"] == pytest.approx(0.0, abs=1e-6) and mm["kl_current"] == pytest.approx(0.0, abs=1e-4)
    assert mm["masked_token_fraction"] == 0.0 and mm["ratio_p50"] == pytest.approx(1.0, abs=1e-3)
    assert rec["reward"]["total"] == pytest.approx((0 + 1 + 0 + 1) * 2 / 4 + 2 * 0.5)  # env 0/1 per turn, format 0.5 per turn
    assert rec["success_rate"] == {"all": 0.5, "sokoban": 0.5}
    assert rec["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before the first update
    assert set(rec["step_seconds"]) == {"wait", "forward", "backward", "publish", "checkpoint"}
    assert rec["tokens"] > rec["response_tokens"] > 0 and rec["tokens_per_s"] > 0
    assert math.isfinite(rec["losses"]["policy"]) and math.isfinite(rec["losses"]["value"])

    version, tensors = sub.fetch(min_version=0)
    assert version == 1
    changed = [k for k in tensors if not torch.equal(tensors[k], before[k])]
    assert any("visual" in k for k in changed) and any("language_model.layers" in k for k in changed)

    backend = HFBackend(model_dir, max_image_side=112)
    backend.update_weights(tensors, version)  # names and shapes checked against the actor's model
    assert backend.version == 1
    probe = trajs[6]  # not trained on yet
    actor_lp = _logprobs(backend.model, model_dir, probe)
    learner_lp = _logprobs(learner.models.policy_hf, model_dir, probe)
    initial_lp = _logprobs(load_policy(model_dir), model_dir, probe)
    assert torch.allclose(actor_lp, learner_lp, atol=1e-5)
    assert not torch.allclose(actor_lp, initial_lp, atol=1e-3)
    # the module the learner trains through masks the prompt-only tokens, as the actors' backends do
    policy_module = getattr(learner.models.policy, "module", learner.models.policy)
    assert policy_module.masked_ids == ChatCodec(model_dir, max_image_side=112).prompt_only_ids == (1, 9, 10, 11, 12, 13)
    sub.close()

    r = connect(redis_srv.url)
    assert read_control(r, keys)["policy_version"] == 1 and read_control(r, keys)["max_turns"] == 3
    # no checkpoint yet (every 2 steps): the 4 trained entries are still pending, not acked
    assert r.xpending(keys.scored, SCORED_GROUP)["pending"] == 4
    assert checkpoint.latest(learner.ckpt_dir) is None

    rec2 = learner.step()
    assert rec2["step"] == 2 and rec2["policy_version"] == 2 and rec2["staleness_mean"] == 1.0  # v0 data at v1
    assert rec2["kl"] != 0.0  # the policy moved away from the reference
    assert rec2["importance_weight"]["mean"] != pytest.approx(1.0, abs=1e-6)  # behaviour = v0, proximal = v1
    path = checkpoint.latest(learner.ckpt_dir)
    state = checkpoint.read_state(path)
    assert state["step"] == 2 and state["policy_version"] == 2
    assert sorted(state["trained"]) == sorted(f"s{i}" for i in range(8))
    assert r.xpending(keys.scored, SCORED_GROUP)["pending"] == 0 and r.xlen(keys.scored) == 0
    # the checkpoint's hf/ folder is a loadable model holding the step-2 weights
    exported = load_policy(path / "hf")
    assert torch.allclose(_logprobs(exported, model_dir, probe), _logprobs(learner.models.policy_hf, model_dir, probe), atol=1e-5)

    lines = [json.loads(x) for x in (learner.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and lines[-1]["pending_entries"] == 0
    assert json.loads((learner.run_dir / "versions.json").read_text())["torch"] == torch.__version__
    ledger = [json.loads(x) for x in (learner.run_dir / "learner_ledger.jsonl").read_text().splitlines()]
    assert [sorted(x["trained"]) for x in ledger] == [[f"s{i}" for i in range(4)], [f"s{i}" for i in range(4, 8)]]


def test_micro_batch_weighting_gives_the_exact_mini_batch_token_mean():
    """Two micro-batches of different token counts accumulate to the gradient of the token mean
    over the whole mini-batch (DeepSpeed's 1/accumulation scaling undone by the trainer)."""
    import deepspeed

    from worldloop.common.contracts.config import load_config
    from worldloop.learner.engine import init_distributed
    from worldloop.learner.trainer import micro_loss_scale

    init_distributed(load_config(None, []))  # a world of one (gloo), whatever ran before this test
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False)
    ref = torch.nn.Linear(3, 1, bias=False)
    ref.load_state_dict(model.state_dict())
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), config={
        "train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 0}, "steps_per_print": 10**9})
    x = [torch.randn(5, 3), torch.randn(2, 3)]  # 5 "tokens" in the first micro-batch, 2 in the second
    n_global = 7.0
    for xi in x:
        loss = engine(xi).pow(2).mean()  # the per-micro token mean, as policy_loss returns it
        engine.backward(loss * micro_loss_scale(xi.shape[0], n_global, world_size=1, accumulation=2))
        engine.step()
    # by hand: one SGD step (lr 1) on the token mean over all 7 tokens
    full = torch.cat(x)
    ref(full).pow(2).sum().div(7.0).backward()
    expected = ref.weight.detach() - ref.weight.grad
    assert torch.allclose(engine.module.weight.detach(), expected, atol=1e-6)


@pytest.mark.parametrize("estimator, extra", [
    ("masked_gae", {}),
    ("turn_ppo", {}),
    ("vanilla_ppo", {}),
    ("grpo", {}),
    ("gigpo", {}),
    ("bilevel_gae", {"kl_in_reward": False, "kl_estimator": "low_var_kl", "entropy_coef": 0.01, "ppo_epochs": 2}),
])
def test_every_estimator_runs_a_real_update(learner, model_dir, estimator, extra):
    """Each estimator (and KL as a loss term, the entropy bonus, two PPO epochs) through the
    DeepSpeed update: finite losses, and the policy moves."""
    t = learner.cfg.trainer
    saved = {k: getattr(t, k) for k in ("estimator", *extra)}
    trajs = _trajectories(model_dir, 4, f"{estimator}-")
    for i, x in enumerate(trajs):
        x.group_id = f"g{i // 2}"  # grpo: two groups of two with different rewards inside
    probe = trajs[0]
    before = _logprobs(learner.models.policy_hf, model_dir, probe)
    try:
        t.estimator = estimator
        for k, v in extra.items():
            setattr(t, k, v)
        stats = learner.trainer.update(trajs, step=100)
    finally:
        for k, v in saved.items():
            setattr(t, k, v)
    assert math.isfinite(stats["policy_loss"]) and math.isfinite(stats["value_loss"])
    if estimator == "grpo":  # group-normalised, not whitened: +-1/sqrt(2) for two different scores
        assert stats["advantage_max"] == pytest.approx(1 / math.sqrt(2), rel=1e-3)
    if estimator == "gigpo":
        # the two rows of a group share their state at each turn (synthetic states depend on the turn):
        # episode +-1/sqrt(2) plus step (R_t of 0.5 vs 1.5 per turn) +-1/sqrt(2) -> +-sqrt(2)
        assert stats["advantage_max"] == pytest.approx(math.sqrt(2), rel=1e-3)
        assert stats["advantage_min"] == pytest.approx(-math.sqrt(2), rel=1e-3)
        assert stats["credit"]["step_groups"] == {"turns": 8, "shared": 8, "shared_fraction": 1.0}
    else:
        assert "credit" not in stats
    if "kl_in_reward" in extra:
        assert "policy_kl_loss" in stats
    assert not torch.allclose(before, _logprobs(learner.models.policy_hf, model_dir, probe), atol=1e-6)


def test_icepop_and_the_mismatch_on_a_real_update(learner, model_dir):
    """trainer.off_policy icepop through the DeepSpeed update, with behaviour log-probs that are the
    policy's own (rho = 1 up to numerics) except one trajectory's, lowered by ln 4 (rho = 4, outside
    the band [0.5, 2]); the first 3 response tokens of another's second turn came from the version
    before (token_versions). The mismatch numbers follow by hand; the policy still moves."""
    t = learner.cfg.trainer
    codec = ChatCodec(model_dir, max_image_side=112)
    score = behaviour_logprobs_from(learner.models.policy_hf, codec, TEMPERATURE)
    trajs = [synthetic_trajectory(codec, trajectory_id=f"icepop-{i}", seed=i, turns=2, response_tokens=6, policy_version=9,
                                  env_reward=float(i % 2), success=i % 2 == 1, logprobs=score) for i in range(4)]
    for turn in trajs[1].turns:
        turn.logprobs = [lp - math.log(4) for lp in turn.logprobs]
    mixed = trajs[2].turns[1]
    mixed.token_versions = [8] * 3 + [9] * (len(mixed.response_ids) - 3)
    mixed.policy_version = 8
    n = sum(len(turn.response_ids) for x in trajs for turn in x.turns)  # 4 x 2 x (6 + <|im_end|>) = 56
    probe = trajs[0]
    before = _logprobs(learner.models.policy_hf, model_dir, probe)
    saved = (t.off_policy, t.estimator)
    try:
        t.off_policy, t.estimator = "icepop", "masked_gae"
        stats = learner.trainer.update(trajs, step=200, version=9)
    finally:
        t.off_policy, t.estimator = saved
    mm = stats["mismatch"]
    assert n == 56 and mm["tokens"] == n and mm["current_tokens"] == n - 3
    # trajectory 1's 14 tokens have rho = 4: rejected, a quarter of the tokens and of the trajectories
    assert mm["masked_token_fraction"] == pytest.approx(14 / 56)
    assert mm["masked_sequence_fraction"] == pytest.approx(1 / 4)
    # k1 = mean(-ln rho) = -14 ln 4 / 56; over the v9 tokens -14 ln 4 / 53 (numerics: well below 1e-3)
    assert mm["kl"] == pytest.approx(-math.log(4) / 4, abs=1e-3)
    assert mm["kl_current"] == pytest.approx(-14 * math.log(4) / 53, abs=1e-3)
    # 42 ratios of 1, then 14 of 4: p50 at position 27.5 is 1, p95 at 52.25 is 4
    assert mm["ratio_p50"] == pytest.approx(1.0, abs=1e-3) and mm["ratio_p95"] == pytest.approx(4.0, rel=1e-3)
    assert math.isfinite(stats["policy_loss"])
    assert not torch.allclose(before, _logprobs(learner.models.policy_hf, model_dir, probe), atol=1e-6)


# --------------------------------------------------------------------------- observation advantage

OBSERVED = ("<think><observation>box0 is above the player.</observation><reasoning>Left ice, Up hole.</reasoning>"
            "</think><answer>Up</answer>")


def _observed(model_dir: Path, n: int, prefix: str) -> list:
    """Trajectories whose responses hold an observation and an outlook; grounding scores 1.0 in odd rows,
    0.0 in even ones; outlook scores 0.25 in rows 0, 1 and 0.75 in rows 2, 3."""
    codec = ChatCodec(model_dir, max_image_side=112)
    trajs = _trajectories(model_dir, n, prefix)
    for i, x in enumerate(trajs):
        x.group_id = f"g{i // 2}"
        for turn in x.turns:
            turn.response_ids = codec.encode_response(OBSERVED)
            turn.logprobs = [-2.0] * len(turn.response_ids)
            turn.grounding_score = float(i % 2)
            turn.outlook_score = 0.25 if i < 2 else 0.75
    return trajs


def test_observation_advantage_replaces_only_the_observation_tokens(learner, model_dir):
    """On the real trainer: off (task) the advantages are returned untouched; grounding puts
    coef x (g - group mean) on each turn's observation tokens and leaves every other token as it was."""
    from worldloop.learner.credit import observation_token_span

    t, trainer = learner.cfg.trainer, learner.trainer
    trajs = _observed(model_dir, 4, "obs-")
    batch = collate([build_sequence(x) for x in trajs], learner.models.codec)
    mask = batch["response_mask"]
    raw = torch.randn(mask.shape) * mask
    white = torch.randn(mask.shape) * mask
    assert t.observation_advantage == "task"
    out_raw, out_white, credit = trainer._credit(trajs, raw, white, mask)
    assert out_raw is raw and out_white is white and credit == {}
    saved = (t.observation_advantage, t.observation_advantage_coef)
    try:
        t.observation_advantage, t.observation_advantage_coef = "grounding", 3.0
        out_raw, out_white, credit = trainer._credit(trajs, raw, white, mask)
    finally:
        t.observation_advantage, t.observation_advantage_coef = saved
    s, e = observation_token_span(trajs[0].turns[0].response_ids, learner.models.codec.tokenizer)
    obs = torch.zeros(mask.shape, dtype=torch.bool)
    want = torch.zeros(mask.shape)
    for b, x in enumerate(build_sequence(y) for y in trajs):
        for start, _ in x.turn_spans:
            obs[b, start + s : start + e] = True
            want[b, start + s : start + e] = 3.0 * ((b % 2) - 0.5)  # groups of (0.0, 1.0): mean 0.5
    assert torch.equal(out_raw[obs], want[obs]) and torch.equal(out_white[obs], want[obs])
    assert torch.equal(out_raw[~obs], raw[~obs]) and torch.equal(out_white[~obs], white[~obs])
    assert credit == {"observation": {"turns": 8, "tokens": 8.0 * (e - s)}}
    # reasoning_advantage outlook as well: the reasoning tokens get 2 x (o - group mean); the
    # observation tokens as before
    from worldloop.learner.credit import REASONING, tag_token_span

    saved = (t.observation_advantage, t.observation_advantage_coef, t.reasoning_advantage, t.reasoning_advantage_coef)
    for x in trajs:  # one row of each group changes its outlook score: g0 (0.25, 1.0), g1 (0.75, 0.0)
        for turn in x.turns:
            turn.outlook_score = {"g0": {0: 0.25, 1: 1.0}, "g1": {2: 0.75, 3: 0.0}}[x.group_id][trajs.index(x)]
    try:
        (t.observation_advantage, t.observation_advantage_coef, t.reasoning_advantage,
         t.reasoning_advantage_coef) = "grounding", 3.0, "outlook", 2.0
        out_raw, out_white, credit = trainer._credit(trajs, raw, white, mask)
    finally:
        t.observation_advantage, t.observation_advantage_coef, t.reasoning_advantage, t.reasoning_advantage_coef = saved
    rs, re_ = tag_token_span(trajs[0].turns[0].response_ids, learner.models.codec.tokenizer, REASONING)
    assert rs >= e  # the reasoning comes after the observation
    rsn = torch.zeros(mask.shape, dtype=torch.bool)
    for b, x in enumerate(build_sequence(y) for y in trajs):
        for start, _ in x.turn_spans:
            rsn[b, start + rs : start + re_] = True
            want[b, start + rs : start + re_] = 2.0 * {0: -0.375, 1: 0.375, 2: 0.375, 3: -0.375}[b]
    touched = obs | rsn
    assert torch.equal(out_raw[touched], want[touched]) and torch.equal(out_white[touched], want[touched])
    assert torch.equal(out_raw[~touched], raw[~touched])
    assert credit["reasoning"] == {"turns": 8, "tokens": 8.0 * (re_ - rs)}


def test_gigpo_with_the_grounding_observation_advantage_runs_a_real_update(learner, model_dir):
    t = learner.cfg.trainer
    saved = {k: getattr(t, k) for k in ("estimator", "observation_advantage", "observation_advantage_coef")}
    trajs = _observed(model_dir, 4, "gobs-")
    probe = trajs[0]
    before = _logprobs(learner.models.policy_hf, model_dir, probe)
    try:
        t.estimator, t.observation_advantage, t.observation_advantage_coef = "gigpo", "grounding", 10.0
        stats = learner.trainer.update(trajs, step=101)
    finally:
        for k, v in saved.items():
            setattr(t, k, v)
    assert math.isfinite(stats["policy_loss"])
    # observation tokens: 10 x (g - 0.5) = +-5; the task tokens: +-sqrt(2) as above
    assert stats["advantage_max"] == pytest.approx(5.0) and stats["advantage_min"] == pytest.approx(-5.0)
    assert stats["credit"]["observation"]["turns"] == 8 and stats["credit"]["observation"]["tokens"] > 0
    assert stats["credit"]["step_groups"]["shared"] == 8
    assert not torch.allclose(before, _logprobs(learner.models.policy_hf, model_dir, probe), atol=1e-6)


# --------------------------------------------------------------------------- ZeRO stages


def _one_update(stage: int, model_dir: Path, redis_url: str, run_dir: Path) -> tuple[dict, dict]:
    codec = ChatCodec(model_dir, max_image_side=112)
    ns = f"zero{stage}"
    prod = StreamProducer(redis_url, Keys(ns).scored, 100)
    for i in range(4):
        prod.add(encode_trajectory(synthetic_trajectory(codec, trajectory_id=f"z{i}", seed=i, env_reward=float(i))))
    cfg = tiny_learner_config(model_dir, redis_url, run_dir, namespace=ns, zero_stage=stage, total_steps=1)
    lrn = Learner(cfg, init_distributed(cfg))
    try:
        rec = lrn.step()
        sub = WeightSubscriber("127.0.0.1", lrn.publisher.pub_port, lrn.publisher.fetch_port, fetch_timeout_s=30)
        version, tensors = sub.fetch(min_version=0)
        sub.close()
        assert version == 1
        return rec, {k: v.clone() for k, v in tensors.items()}
    finally:
        lrn.close()


@pytest.fixture(scope="module")
def baseline(model_dir, redis_srv, tmp_path_factory):
    return _one_update(0, model_dir, redis_srv.url, tmp_path_factory.mktemp("z0"))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_matches_stage_0(stage, baseline, model_dir, redis_srv, tmp_path):
    rec0, w0 = baseline
    rec, w = _one_update(stage, model_dir, redis_srv.url, tmp_path)
    assert rec["policy_version"] == 1
    for key in ("policy", "value"):
        assert rec["losses"][key] == pytest.approx(rec0["losses"][key], rel=1e-4, abs=1e-6)
    assert rec["grad_norm"]["policy"] == pytest.approx(rec0["grad_norm"]["policy"], rel=1e-3)
    assert set(w) == set(w0)
    initial = load_policy(model_dir)
    check_state_dict(initial, w)  # every name known, every parameter covered, shapes right
    for k, t in w.items():
        assert t.shape == initial.state_dict()[k].shape, k  # full tensors, not ZeRO-3 shards
        # Adam's first step moves a weight by about lr = 1e-3; ZeRO's flattened reductions change the
        # float rounding of tiny gradients, so compare to 2% of one step
        assert torch.allclose(t, w0[k], atol=2e-5), k
    assert any(not torch.equal(t, initial.state_dict()[k]) for k, t in w.items())


@pytest.mark.slow
def test_a_kill_between_checkpoint_and_ledger_loses_no_lineage_and_the_end_stops_the_run(model_dir, redis_srv, tmp_path):
    """The ledger can never disagree with the checkpoint: a kill right after a checkpoint, before the
    step's ledger and metrics lines were appended, is repaired by --resume from the checkpoint's own
    copy of those lines. A learner that reaches total_steps sets run_state stopped (actors stop); a
    resumed one sets it back to running."""
    ns = "lineage"
    keys = Keys(ns)
    r = connect(redis_srv.url)
    cfg = tiny_learner_config(model_dir, redis_srv.url, tmp_path / "run", namespace=ns, total_steps=2, checkpoint_every=2)
    prod = StreamProducer(redis_srv.url, keys.scored, 100)
    for t in _trajectories(model_dir, 8, "L"):
        prod.add(encode_trajectory(t))
    lrn = Learner(cfg, init_distributed(cfg))
    try:
        assert read_control(r, keys)["run_state"] == "running"
        assert lrn.run_loop() == 0
    finally:
        lrn.close()
    assert read_control(r, keys)["run_state"] == "stopped"
    ledger_path, metrics_path = lrn.run_dir / "learner_ledger.jsonl", lrn.run_dir / "metrics.jsonl"
    ledger = [json.loads(x) for x in ledger_path.read_text().splitlines()]
    assert [x["step"] for x in ledger] == [1, 2]
    # the kill: step 2's checkpoint (and its acks) happened, its two lines never reached the files
    ledger_path.write_text(json.dumps(ledger[0]) + "\n")
    metrics_path.write_text(metrics_path.read_text().splitlines()[0] + "\n")

    cfg2 = tiny_learner_config(model_dir, redis_srv.url, tmp_path / "run", namespace=ns, total_steps=3, checkpoint_every=2)
    cfg2.trainer.resume = True
    again = Learner(cfg2, init_distributed(cfg2))
    try:
        repaired = [json.loads(x) for x in ledger_path.read_text().splitlines()]
        assert repaired == ledger  # step 2's line is back, ids and entries as trained
        lines = [json.loads(x) for x in metrics_path.read_text().splitlines()]
        assert [x["step"] for x in lines] == [1, 2] and lines[1].get("repaired") is True
        assert read_control(r, keys)["run_state"] == "running"  # resumed after the end: producing again
        assert again.step_no == 2 and again.version == 2
    finally:
        again.close()


@pytest.mark.slow
def test_time_limit_stops_the_learner_like_total_steps(model_dir, redis_srv, tmp_path):
    """trainer.time_limit_s: no update starts that would end past it; the learner then checkpoints
    and stops the run as after total_steps (the data for more updates is there)."""
    ns = "timelimit"
    keys = Keys(ns)
    cfg = tiny_learner_config(model_dir, redis_srv.url, tmp_path / "run", namespace=ns, total_steps=5, checkpoint_every=5)
    cfg.trainer.time_limit_s = 1e-3  # any update ends past it, but the first always runs
    lrn, rc = train_until_stopped(cfg, _trajectories(model_dir, 3 * cfg.trainer.train_batch_size, "T"))
    assert rc == 0
    assert lrn.step_no == 1 and lrn.version == 1
    assert read_control(connect(redis_srv.url), keys)["run_state"] == "stopped"
    assert [json.loads(x)["step"] for x in (lrn.run_dir / "learner_ledger.jsonl").read_text().splitlines()] == [1]
    assert checkpoint.read_state(checkpoint.latest(lrn.ckpt_dir))["step"] == 1


@pytest.mark.slow
def test_a_final_evaluation_measured_longer_than_the_reserve_stops_the_learner_earlier(model_dir, redis_srv, tmp_path):
    """Under `worldloop up` (up.time_limit_s set, up.final_reserve_s already kept back from
    trainer.time_limit_s) an in-run evaluation in eval.jsonl whose CPU seconds, scaled to
    final_eval_episodes, need more than the reserve moves the learner's stop earlier by the
    difference (and it says by when the final evaluation must end): 100 CPU s for 64 episodes -> 512 need 800 + 15 s, 755 s beyond a 60 s reserve, more
    than the 700 s trainer.time_limit_s, so the second update does not start. Without the record (the
    control run) the same limit lets all 3 updates run, and so does the default
    up.final_eval_max_share 0.25 (the capped run: at most 225 - 60 = 165 s kept back beyond the reserve)."""
    runs = {}
    for name, record, share in (("measured", True, 1.0), ("control", False, 1.0), ("capped", True, 0.25)):
        ns = f"finalreserve-{name}"
        cfg = tiny_learner_config(model_dir, redis_srv.url, tmp_path / name, namespace=ns, total_steps=3,
                                  checkpoint_every=3, eval_every=5, eval_episodes=64, final_eval_episodes=512,
                                  final_eval_wait_s=0)
        cfg.up.time_limit_s, cfg.up.final_reserve_s, cfg.trainer.time_limit_s = 900.0, 60.0, 700.0
        cfg.up.final_eval_max_share = share
        cfg.trainer.final_eval_processes = 1  # one process plays the 512 episodes (not one per core)
        (tmp_path / name).mkdir()
        if record:  # what worldloop/heldout.py writes for the in-run evaluation of v0
            (tmp_path / name / "eval.jsonl").write_text(json.dumps({"eval": {
                "policy_version": 0, "final": False, "episodes": {"all": 64}, "cpu_s": 100.0, "seconds": 300.0,
                "success_rate": {"all": 0.25}}}) + "\n")
        t0 = time.time()
        lrn, rc = train_until_stopped(cfg, _trajectories(model_dir, 3 * cfg.trainer.train_batch_size, name[0].upper()))
        control = read_control(connect(redis_srv.url), Keys(ns))
        assert rc == 0 and control["run_state"] == "stopped"
        # the final evaluation's deadline: the learner's start + 700 s + the 60 s reserve - 10 s to exit
        assert t0 + 750.0 <= float(control["final_eval_by"]) <= time.time() + 750.0
        runs[name] = lrn.step_no
    assert runs == {"measured": 1, "control": 3, "capped": 3}
