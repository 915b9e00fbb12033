"""What a learner checkpoint restores, on the real learner (DeepSpeed on CPU, the tiny Qwen2.5-VL, a
real redis-server): WMAct max-turn annealing (Eq. 5) in the control record across a checkpoint and
a resume, with the annealing window carried by the checkpoint; WMAct reward rescaling (Eq. 4) in
the step record; the policy and critic restored parameter for parameter (not the base model, not
the lost update); and the world-size / ZeRO-stage / critic mismatches refused naming the key.

Every expected number is worked out by hand in the comments from the formulas in
``learner/rewards.py``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from worldloop.common.contracts.config import ConfigError
from worldloop.common.transport.control import read_control
from worldloop.common.contracts.keys import Keys
from worldloop.common.contracts.modeling import ChatCodec
from worldloop.common.contracts.schemas import encode_trajectory
from worldloop.common.transport.streams import StreamProducer, connect
from worldloop.learner import checkpoint
from worldloop.learner.engine import init_distributed
from worldloop.learner.process import Learner
from worldloop.testing.trajectories import synthetic_trajectory
from worldloop.testing.learner import tiny_learner_config

NS = "anneal"
# turns per trajectory of the four batches (4 trajectories per update, trained in stream order)
BATCHES = [[2, 2, 2, 2], [2, 2, 2, 6], [1, 1, 1, 5], [2, 2, 2, 2]]


@pytest.fixture(scope="module")
def model_dir(shared_tiny_model) -> Path:
    return shared_tiny_model(max_image_side=112)


def _produce(model_dir: Path, url: str) -> None:
    codec = ChatCodec(model_dir, max_image_side=112)
    prod = StreamProducer(url, Keys(NS).scored, 100)
    for b, turns in enumerate(BATCHES):
        for i, n in enumerate(turns):
            traj = synthetic_trajectory(codec, trajectory_id=f"b{b}-{i}", seed=10 * b + i, turns=n, response_tokens=4,
                                        image_side=28, env_reward=1.0, format_reward=0.5)
            if b == 0:  # WMAct Eq. 4: the first turn's action changed nothing -> N_eff / N = 1 / 2
                traj.turns[0].actions_effective = 0
            prod.add(encode_trajectory(traj))
    prod.close()


def _params(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _differs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert set(a) == set(b)
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.slow
def test_annealing_and_weights_survive_a_checkpoint_and_resume(model_dir, redis_url, tmp_path) -> None:
    r = connect(redis_url)
    keys = Keys(NS)
    _produce(model_dir, redis_url)

    def config(resume: bool):
        cfg = tiny_learner_config(model_dir, redis_url, tmp_path / "run", namespace=NS, total_steps=10,
                                  checkpoint_every=3, max_staleness=100, use_critic=True, anneal_max_turns=True,
                                  anneal_every=2, wmact_rescale=True, resume=resume)
        cfg.actor.max_turns = 6
        return cfg

    first = Learner(config(False), init_distributed(config(False)))
    try:
        base_policy, base_critic = _params(first.models.policy), _params(first.models.critic)
        assert read_control(r, keys)["max_turns"] == 6  # actor.max_turns until the first annealing
        rec1 = first.step()
        # WMAct Eq. 4 on batch 0: every trajectory has 2 turns of env 1.0 + format 0.5, N_eff/N = 1/2:
        # the outcome (env) part is halved, 2 * (1.0 * 0.5 + 0.5) = 2.0 per trajectory (3.0 unscaled);
        # the "env" component reports the raw env reward, 2 * 1.0
        assert rec1["reward"]["total"] == pytest.approx(2.0) and rec1["reward"]["env"] == pytest.approx(2.0)
        assert rec1["max_turns"] == 6 and read_control(r, keys)["max_turns"] == 6  # step 1: no annealing (tau = 2)
        rec2 = first.step()
        # step 2 anneals over the turns of steps 1-2, [2, 2, 2, 2, 2, 2, 2, 6]: mean 20 / 8 = 2.5, max 6,
        # ceil((2.5 + 6) / 2) = ceil(4.25) = 5, within [1, 6]
        assert rec2["max_turns"] == 5 and read_control(r, keys)["max_turns"] == 5
        first.step()  # step 3: checkpoint_every 3; its turns [1, 1, 1, 5] wait in the window
        ckpt = checkpoint.latest(first.ckpt_dir)
        state = checkpoint.read_state(ckpt)
        assert (state["step"], state["max_turns"], state["anneal_window"]) == (3, 5, [1, 1, 1, 5])
        at_ckpt_policy, at_ckpt_critic = _params(first.models.policy), _params(first.models.critic)
        rec4 = first.step()
        # step 4 anneals over [1, 1, 1, 5] + [2, 2, 2, 2]: mean 17 / 8 = 2.125, max 5,
        # ceil((2.125 + 5) / 2) = ceil(3.5625) = 4
        assert rec4["max_turns"] == 4 and read_control(r, keys)["max_turns"] == 4
        lost_policy = _params(first.models.policy)
        assert _differs(lost_policy, at_ckpt_policy)  # step 4 moved the policy (the update the crash loses)
    finally:
        first.close()  # a crash after step 4: no checkpoint of it, its entries stay pending

    second = Learner(config(True), init_distributed(config(True)))
    try:
        assert (second.step_no, second.version) == (3, 3)
        # the restored max_turns is in the control record at once: neither actor.max_turns (6) nor
        # the lost step 4's value (4)
        assert read_control(r, keys)["max_turns"] == 5
        # the engines hold the checkpointed parameters exactly: not the base model, not step 4's
        assert _differs(_params(second.models.policy), at_ckpt_policy) == []
        assert _differs(_params(second.models.critic), at_ckpt_critic) == []
        assert _differs(at_ckpt_policy, base_policy) and _differs(at_ckpt_critic, base_critic)

        # a checkpoint written by another world size, ZeRO stage or critic setting is refused, naming
        # the key, before anything is loaded
        for field, value, key, says in [("world_size", 2, "trainer.resume", "written by 2 rank(s), this run has 1"),
                                        ("zero_stage", 3, "trainer.zero_stage", "ZeRO stage 3, this run uses 0"),
                                        ("has_critic", False, "trainer.use_critic", "has no critic, this run differs")]:
            bad = tmp_path / f"bad-{field}"
            bad.mkdir()
            (bad / "state.json").write_text(json.dumps(dict(checkpoint.read_state(ckpt), **{field: value})))
            with pytest.raises(ConfigError, match=re.escape(says)) as err:
                checkpoint.load(second.models, bad)
            assert err.value.key == key and says in err.value.reason, err.value
        assert _differs(_params(second.models.policy), at_ckpt_policy) == []

        # step 4 again, on the same entries (recovered from the dead learner's pending list): the
        # restored window [1, 1, 1, 5] + [2, 2, 2, 2] anneals to 4 again (a window lost on resume
        # would give ceil((2 + 2) / 2) = 2)
        again = second.step()
        assert again["step"] == 4 and again["max_turns"] == 4 and read_control(r, keys)["max_turns"] == 4
        assert _differs(_params(second.models.policy), lost_policy) == []  # the same update, bit for bit
    finally:
        second.close()


def test_start_run_moves_an_earlier_run_aside_and_keeps_a_resumed_ones(tmp_path) -> None:
    """start_run on its own: a fresh claim moves everything but run.json aside, a resumed one keeps it."""
    root = tmp_path / "checkpoints"
    assert checkpoint.start_run(root, "r1", fresh=True) is None and checkpoint.run_id_of(root) == "r1"
    assert checkpoint.start_run(root, "r2", fresh=True) is None  # nothing but run.json: nothing to move
    (root / "step_00000005").mkdir()
    (root / "step_00000005" / "state.json").write_text(json.dumps({"run_id": "r2", "step": 5, "complete": True}))
    assert checkpoint.latest(root) == root / "step_00000005"
    assert checkpoint.start_run(root, "r2", fresh=False) is None and checkpoint.latest(root) == root / "step_00000005"
    moved = checkpoint.start_run(root, "r3", fresh=True)
    assert moved is not None and moved.name.startswith("checkpoints.old-") and (moved / "step_00000005").is_dir()
    assert checkpoint.latest(root) is None and checkpoint.run_id_of(root) == "r3"
    assert checkpoint.latest(moved) == moved / "step_00000005"  # the moved run stays readable where it went


@pytest.mark.parametrize("seed", range(40))
def test_checkpoints_are_ordered_by_recorded_step_within_the_folders_run_never_by_name(seed, tmp_path) -> None:
    """Random folders (seeded) named in any order (a name need not match its step); run.json names
    run "cur": latest() is the complete "cur" checkpoint of the highest recorded step, and pruning
    keeps the ``keep`` highest of "cur" and never touches another run's (or a run-less, older
    layout's) checkpoints or incomplete ones."""
    import random

    rng = random.Random(seed)
    keep = rng.randint(1, 4)
    pairs = {(rng.choice(["cur", "old", None]), rng.randint(0, 120)) for _ in range(rng.randint(0, 12))}
    entries = [(run, step, rng.random() < 0.8) for run, step in sorted(pairs, key=str)]
    names = rng.sample(range(200), len(entries))
    root = tmp_path / "checkpoints"
    checkpoint.start_run(root, "cur", fresh=True)
    for (run, step, complete), n in zip(entries, names):
        p = root / f"step_{n:08d}"
        p.mkdir()
        state = {"step": step, "complete": complete, **({} if run is None else {"run_id": run})}
        (p / "state.json").write_text(json.dumps(state))
    ours = sorted(((step, f"step_{n:08d}") for (run, step, ok), n in zip(entries, names) if run == "cur" and ok),
                  reverse=True)
    got = checkpoint.latest(root)
    assert (got.name if got else None) == (ours[0][1] if ours else None)
    others = {f"step_{n:08d}" for (run, step, ok), n in zip(entries, names) if run != "cur" or not ok}
    checkpoint._prune(root, keep)
    assert {p.name for p in root.glob("step_*")} == others | {name for _, name in ours[:keep]}
