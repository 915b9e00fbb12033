"""worldloop.learner.offpolicy against values worked out by hand: every trainer.off_policy mode's
weights, the train-rollout mismatch, the per-token versions of a mixed-version turn through the
learner's own tensors (build_sequence, collate, apply_correction, policy_loss), the config's rules,
and properties that hold for any input (weights in range, nothing outside the mask leaks in)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worldloop.common.contracts.config import ConfigError, config_from_dict
from worldloop.common.contracts.modeling import build_sequence
from worldloop.common.contracts.schemas import decode_trajectory, encode_trajectory
from worldloop.learner.data import oldest_version
from worldloop.learner.engine import DistInfo
from worldloop.learner.losses import policy_loss
from prometheus_client import REGISTRY

from worldloop.learner.offpolicy import (OFF_POLICY_MODES, apply_correction, export_mismatch, mismatch_stats,
                                         offpolicy_weights, sequence_log_ratios)
from worldloop.testing.trajectories import one_turn_trajectory

LN = math.log
NAN = float("nan")
ONE_RANK = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")

# three trajectories, rho = pi_prox / pi_b per generated token (proximal 0, behaviour -log rho), and
# a padded position of NaN in each row (outside the mask: must never leak into anything)
#   row 0: rho = 4, 1, 1/4   geometric mean exp((ln 4 + 0 - ln 4) / 3) = 1
#   row 1: rho = 3, 3        geometric mean 3
#   row 2: rho = 1/2, 1/8    geometric mean exp((-ln 2 - 3 ln 2) / 2) = 1/4
RHO = [[4.0, 1.0, 0.25], [3.0, 3.0], [0.5, 0.125]]
WIDTH = 4


def batch():
    prox = torch.full((3, WIDTH), NAN)
    beh = torch.full((3, WIDTH), NAN)
    mask = torch.zeros(3, WIDTH)
    for i, row in enumerate(RHO):
        for j, r in enumerate(row):
            prox[i, j], beh[i, j], mask[i, j] = 0.0, -LN(r), 1.0
    return prox, beh, mask


def weights(mode: str, **kw) -> list[list[float]]:
    prox, beh, mask = batch()
    w = offpolicy_weights(prox, beh, mask, mode, **{"cap": 2.0, "low": 0.5, "high": 2.0, **kw})
    assert torch.isfinite(w).all() and (w[mask == 0] == 0).all()
    return [w[i, : len(row)].tolist() for i, row in enumerate(RHO)]


def close(got, want) -> None:
    for g, w in zip(got, want):
        assert g == pytest.approx(w, rel=1e-5, abs=1e-6)


def test_cap_truncates_each_token_at_the_cap():
    # min(rho, 2): 4 -> 2, 3 -> 2, the rest kept
    close(weights("cap"), [[2.0, 1.0, 0.25], [2.0, 2.0], [0.5, 0.125]])


def test_tis_is_the_capped_weight_over_its_batch_mean():
    # capped: 2 + 1 + 0.25 + 2 + 2 + 0.5 + 0.125 = 7.875 over 7 tokens: mean 1.125 = 9/8
    close(weights("tis"), [[16 / 9, 8 / 9, 2 / 9], [16 / 9, 16 / 9], [4 / 9, 1 / 9]])
    # over two ranks the mean is the whole batch's: a rank that saw 7 more tokens of capped sum 7 * 1
    # divides by (7.875 + 7) / 14 instead
    prox, beh, mask = batch()
    w = offpolicy_weights(prox, beh, mask, "tis", cap=2.0, low=0.5, high=2.0,
                          reduce=lambda xs: [xs[0] + 7.0, xs[1] + 7.0])
    assert float(w[0, 0]) == pytest.approx(2.0 / (14.875 / 14))


def test_seq_is_geo_weighs_each_trajectory_by_its_truncated_geometric_mean():
    # min(g, 2): g = 1, 3 -> 2, 1/4, on every token of the row
    close(weights("seq_is_geo"), [[1.0] * 3, [2.0] * 2, [0.25] * 2])
    prox, beh, mask = batch()
    g = torch.exp(sequence_log_ratios(torch.where(mask > 0, prox - beh, 0.0), mask))
    close([g.tolist()], [[1.0, 3.0, 0.25]])


def test_mis_rejects_trajectories_whose_geometric_mean_leaves_the_band():
    # band [0.5, 2]: g = 1 kept (its tokens get min(rho, 2)), g = 3 and g = 1/4 rejected whole
    close(weights("mis"), [[2.0, 1.0, 0.25], [0.0, 0.0], [0.0, 0.0]])
    # a wider band [0.2, 4] keeps all three
    close(weights("mis", low=0.2, high=4.0), [[2.0, 1.0, 0.25], [2.0, 2.0], [0.5, 0.125]])


def test_icepop_rejects_single_tokens_outside_the_band_and_keeps_the_ratio_inside():
    # band [0.5, 2]: 4, 1/4, 3, 3, 1/8 out; 1 and 1/2 kept at their own ratio (no truncation at the cap)
    close(weights("icepop"), [[0.0, 1.0, 0.0], [0.0, 0.0], [0.5, 0.0]])
    close(weights("icepop", low=0.25, high=4.0, cap=1.0), [[4.0, 1.0, 0.25], [3.0, 3.0], [0.5, 0.0]])


def test_unknown_mode_and_bad_bounds_are_refused():
    prox, beh, mask = batch()
    with pytest.raises(ValueError, match="unknown off-policy correction 'vtrace'"):
        offpolicy_weights(prox, beh, mask, "vtrace", cap=2.0, low=0.5, high=2.0)
    with pytest.raises(ValueError, match="0 < low < high"):
        offpolicy_weights(prox, beh, mask, "icepop", cap=2.0, low=2.0, high=2.0)


def test_the_policy_loss_takes_the_weights_in_place_of_the_cap():
    # one row of 4 tokens: r = pi_theta / pi_prox = 1.5, 0.5, 0.5, 1.5; A = 1, 2, -1, -1; clip 0.2
    #   min(r A, clip(r) A) = 1.2, 1.0, -0.8, -1.5; loss_t = -w_t * that
    prox = torch.tensor([[-1.0, -2.0, -0.5, -1.2, NAN]])
    new = (prox + torch.tensor([[LN(1.5), LN(0.5), LN(0.5), LN(1.5), 0.0]])).requires_grad_(True)
    beh = prox - torch.tensor([[LN(3.0), 0.0, LN(0.5), 0.0, 0.0]])  # rho = 3, 1, 0.5, 1
    adv = torch.tensor([[1.0, 2.0, -1.0, -1.0, NAN]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    w = torch.tensor([[1.0, 0.0, 2.0, 1.0, NAN]])  # token 1 rejected, token 2 doubled
    loss, stats = policy_loss(new, prox, beh, adv, mask, is_weights=w)
    # (-1 * 1.2 - 0 * 1.0 + 2 * 0.8 + 1 * 1.5) / 4 = 1.9 / 4
    assert loss.item() == pytest.approx(0.475)
    # the iw stats still describe rho before any correction
    assert stats["iw_mean"] == pytest.approx((3 + 1 + 0.5 + 1) / 4) and stats["iw_truncated_fraction"] == 0.25
    loss.backward()
    # gradient only on the unclipped tokens with a weight: token 3, d/dlogp of -w A r = -1 * -1 * 1.5 / 4
    torch.testing.assert_close(new.grad, torch.tensor([[0.0, 0.0, 0.0, 1.5 / 4, 0.0]]))


# --------------------------------------------------------------------------- mismatch


def test_mismatch_by_hand():
    prox, beh, mask = batch()
    # the learner trains from v6; row 0 is a turn whose first token came from v5, row 2 is all v4
    versions = torch.tensor([[5, 6, 6, -1], [6, 6, -1, -1], [4, 4, -1, -1]])
    w = offpolicy_weights(prox, beh, mask, "icepop", cap=2.0, low=0.5, high=2.0)
    got = mismatch_stats(prox, beh, mask, versions, 6, w)
    # k1 = mean(-ln rho) = -(ln 4 + 0 - ln 4 + 2 ln 3 - ln 2 - 3 ln 2) / 7 = (4 ln 2 - 2 ln 3) / 7
    assert got["kl"] == pytest.approx((4 * LN(2) - 2 * LN(3)) / 7)
    # k3 = mean(rho - 1 - ln rho): row 0 (3 - ln 4) + 0 + (-0.75 + ln 4) = 2.25; row 1 2 (2 - ln 3);
    # row 2 (-0.5 + ln 2) + (-0.875 + 3 ln 2) = -1.375 + 4 ln 2
    assert got["kl_k3"] == pytest.approx((2.25 + 4 - 2 * LN(3) - 1.375 + 4 * LN(2)) / 7)
    # the tokens sampled with v6: rho = 1, 1/4 (row 0) and 3, 3 (row 1)
    assert got["current_tokens"] == 4 and got["tokens"] == 7
    assert got["kl_current"] == pytest.approx(-(0 - LN(4) + 2 * LN(3)) / 4)
    assert got["kl_k3_current"] == pytest.approx((0 + (-0.75 + LN(4)) + 2 * (2 - LN(3))) / 4)
    # icepop kept 1 (row 0) and 1/2 (row 2): 5 of 7 tokens masked, row 1 wholly masked (1 of 3)
    assert got["masked_token_fraction"] == pytest.approx(5 / 7)
    assert got["masked_sequence_fraction"] == pytest.approx(1 / 3)
    # rho sorted: 1/8, 1/4, 1/2, 1, 3, 3, 4; position p * 6, linear: p05 at 0.3, p50 at 3, p95 at 5.7
    assert got["ratio_p05"] == pytest.approx(0.125 + 0.3 * 0.125)
    assert got["ratio_p50"] == pytest.approx(1.0)
    assert got["ratio_p95"] == pytest.approx(3.0 + 0.7 * 1.0)
    # no token of v7 in the batch: nothing to report there; cap masks nothing
    cap = offpolicy_weights(prox, beh, mask, "cap", cap=2.0, low=0.5, high=2.0)
    none = mismatch_stats(prox, beh, mask, versions, 7, cap)
    assert none["kl_current"] is None and none["kl_k3_current"] is None and none["current_tokens"] == 0
    assert none["masked_token_fraction"] == 0.0 and none["masked_sequence_fraction"] == 0.0


def test_the_mismatch_goes_to_prometheus():
    prox, beh, mask = batch()
    versions = torch.tensor([[5, 6, 6, -1], [6, 6, -1, -1], [4, 4, -1, -1]])
    rec = mismatch_stats(prox, beh, mask, versions, 6, offpolicy_weights(prox, beh, mask, "icepop", cap=2.0, low=0.5,
                                                                         high=2.0))
    export_mismatch(rec)

    def value(name, **labels):
        return REGISTRY.get_sample_value(name, labels)

    # the numbers of test_mismatch_by_hand
    assert value("worldloop_learner_mismatch_kl", tokens="all", estimator="k1") == pytest.approx((4 * LN(2) - 2 * LN(3)) / 7)
    assert value("worldloop_learner_mismatch_kl", tokens="current", estimator="k1") == pytest.approx(-(2 * LN(3) - LN(4)) / 4)
    assert value("worldloop_learner_mismatch_masked_fraction", unit="token") == pytest.approx(5 / 7)
    assert value("worldloop_learner_mismatch_masked_fraction", unit="sequence") == pytest.approx(1 / 3)
    assert value("worldloop_learner_mismatch_ratio", quantile="p95") == pytest.approx(3.7)
    # no token of the current version: that gauge keeps its last value
    export_mismatch(rec | {"kl_current": None, "masked_token_fraction": 0.0})
    assert value("worldloop_learner_mismatch_kl", tokens="current", estimator="k1") == pytest.approx(-(2 * LN(3) - LN(4)) / 4)
    assert value("worldloop_learner_mismatch_masked_fraction", unit="token") == 0.0


# --------------------------------------------------------------------------- per-token versions


def mixed_turn():
    """One turn of 5 response tokens: the first k = 2 sampled by v3, the other 3 by v4 (a weight load
    in the middle of the response); behaviour log-probs -1.0, -2.0 (v3) and -0.5, -0.7, -0.3 (v4)."""
    traj = one_turn_trajectory([1, 2, 3], [10, 11, 12, 13, 14], logprobs=[-1.0, -2.0, -0.5, -0.7, -0.3])
    traj.turns[0].token_versions = [3, 3, 4, 4, 4]
    traj.turns[0].policy_version = 3  # the oldest token's version
    return decode_trajectory(encode_trajectory(traj))


def test_a_mixed_version_turn_gets_each_tokens_behaviour_logprob_and_version():
    traj = mixed_turn()
    assert oldest_version(traj) == 3  # its staleness is that of its oldest token
    layout = build_sequence(traj)
    # positions 3..7 are the response: per-token versions and behaviour log-probs, in order
    assert layout.policy_version.tolist() == [-1, -1, -1, 3, 3, 4, 4, 4]
    assert layout.turn_policy_version == [3]
    close([layout.behaviour_logprobs.tolist()], [[0, 0, 0, -1.0, -2.0, -0.5, -0.7, -0.3]])
    gen = layout.response_mask[None]
    # the learner's proximal log-probs at v4 (what _precompute would give), chosen so that
    # rho = pi_prox / pi_b = 1, 2 on the v3 tokens and 1, 1, 1/2 on the v4 ones
    prox = torch.tensor([[0, 0, 0, -1.0, -2.0 + LN(2), -0.5, -0.7, -0.3 - LN(2)]])
    batch = {"old_logprobs": prox, "behaviour_logprobs": layout.behaviour_logprobs[None], "response_mask": gen,
             "loss_mask": gen, "policy_version": layout.policy_version[None]}
    t = config_from_dict({"trainer": {"off_policy": "icepop", "off_policy_low": 0.6, "off_policy_high": 1.5}}).trainer
    got = apply_correction(batch, t, 4, ONE_RANK)
    # icepop [0.6, 1.5]: rho 2 (a v3 token) and 1/2 (a v4 token) rejected, the three rho = 1 kept
    close([batch["is_weight"][0].tolist()], [[0, 0, 0, 1.0, 0.0, 1.0, 1.0, 0.0]])
    # all five tokens: k1 = -(0 + ln 2 + 0 + 0 - ln 2) / 5 = 0; the three v4 tokens: -(0 + 0 - ln 2) / 3
    assert got["kl"] == pytest.approx(0.0, abs=1e-6) and got["current_tokens"] == 3
    assert got["kl_current"] == pytest.approx(LN(2) / 3)
    assert got["masked_token_fraction"] == pytest.approx(2 / 5)
    # cap: the decoupled weight of each token from its own behaviour log-prob: 1, 2, 1, 1, 1/2
    adv = torch.where(gen > 0, 1.0, 0.0)
    loss, stats = policy_loss(prox.clone().requires_grad_(True), prox, batch["behaviour_logprobs"], adv, gen, iw_cap=2.0)
    # r = 1 everywhere, A = 1: loss = -mean(w) = -(1 + 2 + 1 + 1 + 0.5) / 5
    assert loss.item() == pytest.approx(-5.5 / 5)
    assert stats["iw_max"] == pytest.approx(2.0) and stats["iw_min"] == pytest.approx(0.5)


def test_cap_leaves_the_batch_alone_and_other_modes_weigh_only_sampled_loss_tokens():
    gen = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    loss = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # vanilla_ppo: an observation token in the loss
    batch = {"old_logprobs": torch.tensor([[-3.0, -1.0, -1.0, NAN]]),
             "behaviour_logprobs": torch.tensor([[0.0, -1.0 - LN(3), -1.0, NAN]]), "response_mask": gen,
             "loss_mask": loss, "policy_version": torch.tensor([[-1, 2, 2, -1]])}
    apply_correction(batch, config_from_dict({}).trainer, 2, ONE_RANK)
    assert "is_weight" not in batch
    apply_correction(batch, config_from_dict({"trainer": {"off_policy": "seq_is_geo"}}).trainer, 2, ONE_RANK)
    # geometric mean of rho = 3, 1: sqrt(3); the observation token gets 1, the padding 0
    close([batch["is_weight"][0].tolist()], [[1.0, math.sqrt(3), math.sqrt(3), 0.0]])


# --------------------------------------------------------------------------- config


def test_config_rules_name_the_key():
    assert config_from_dict({}).trainer.off_policy == "cap"
    with pytest.raises(ConfigError, match="trainer.off_policy.*'vtrace'"):
        config_from_dict({"trainer": {"off_policy": "vtrace"}})
    with pytest.raises(ConfigError, match="^config key 'trainer.off_policy_low'.*below trainer.off_policy_high"):
        config_from_dict({"trainer": {"off_policy": "mis", "off_policy_low": 1.0, "off_policy_high": 1.0}})
    with pytest.raises(ConfigError, match="^config key 'trainer.off_policy_high': .*only read by trainer.off_policy mis"):
        config_from_dict({"trainer": {"off_policy": "tis", "off_policy_high": 3.0}})
    with pytest.raises(ConfigError, match="^config key 'trainer.off_policy_low'"):
        config_from_dict({"trainer": {"off_policy": "icepop", "off_policy_low": 1.2}})  # above 1: rejects on-policy tokens
    with pytest.raises(ConfigError, match="^config key 'trainer.off_policy_high'"):
        config_from_dict({"trainer": {"off_policy": "icepop", "off_policy_high": 0.9}})
    t = config_from_dict({"trainer": {"off_policy": "mis", "off_policy_low": 0.99, "off_policy_high": 1.01}}).trainer
    assert (t.off_policy_low, t.off_policy_high) == (0.99, 1.01)


# --------------------------------------------------------------------------- properties

finite = st.floats(-30.0, 5.0, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), rows=st.integers(1, 4), width=st.integers(1, 6), mode=st.sampled_from(OFF_POLICY_MODES),
       cap=st.floats(1.0, 10.0), low=st.floats(0.05, 1.0), high=st.floats(1.0, 10.0))
def test_weights_stay_in_range_and_nothing_outside_the_mask_leaks(data, rows, width, mode, cap, low, high):
    if not low < high:
        return
    prox = torch.tensor(data.draw(st.lists(st.lists(finite, min_size=width, max_size=width), min_size=rows, max_size=rows)))
    beh = torch.tensor(data.draw(st.lists(st.lists(finite, min_size=width, max_size=width), min_size=rows, max_size=rows)))
    mask = torch.tensor(data.draw(st.lists(st.lists(st.booleans(), min_size=width, max_size=width),
                                           min_size=rows, max_size=rows))).float()
    kw = dict(cap=cap, low=low, high=high)
    w = offpolicy_weights(prox, beh, mask, mode, **kw)
    assert torch.isfinite(w).all() and (w >= 0).all() and (w[mask == 0] == 0).all()
    if mode in ("cap", "seq_is_geo", "mis"):
        assert (w <= cap * (1 + 1e-6)).all()
    if mode == "icepop":
        kept = w[w > 0]
        assert ((kept >= low * (1 - 1e-6)) & (kept <= high * (1 + 1e-6))).all()
    if mode == "tis" and mask.sum() > 0 and w.sum() > 0:
        assert float(w[mask > 0].mean()) == pytest.approx(1.0, rel=1e-4)
    # garbage outside the mask changes nothing
    poisoned = [torch.where(mask > 0, x, torch.tensor(v)) for x, v in ((prox, NAN), (beh, float("inf")))]
    torch.testing.assert_close(offpolicy_weights(*poisoned, mask, mode, **kw), w)
    stats = mismatch_stats(prox, beh, mask, torch.zeros_like(mask, dtype=torch.long), 0, w)
    assert 0.0 <= stats["masked_token_fraction"] <= 1.0 and 0.0 <= stats["masked_sequence_fraction"] <= 1.0
    assert stats["kl_k3"] >= -1e-6
    if mask.sum() > 0:
        assert stats["ratio_p05"] <= stats["ratio_p50"] <= stats["ratio_p95"]


# --------------------------------------------------------------------------- two ranks


def _rank_worker(out: str) -> None:
    """Under torch.distributed.run (gloo, 2 ranks): rank 0 holds rows 0-1 of the hand batch, rank 1
    row 2; each writes what apply_correction gave it."""
    import torch.distributed as tdist

    tdist.init_process_group("gloo")
    rank = tdist.get_rank()
    dist = DistInfo(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    prox, beh, mask = batch()
    rows = slice(0, 2) if rank == 0 else slice(2, 3)
    versions = torch.tensor([[5, 6, 6, -1], [6, 6, -1, -1], [4, 4, -1, -1]])
    part = {"old_logprobs": prox[rows], "behaviour_logprobs": beh[rows], "response_mask": mask[rows],
            "loss_mask": mask[rows], "policy_version": versions[rows]}
    stats = apply_correction(part, config_from_dict({"trainer": {"off_policy": "tis"}}).trainer, 6, dist)
    Path(f"{out}.{rank}").write_text(json.dumps({"stats": stats, "w": part["is_weight"].tolist()}))
    tdist.barrier()
    tdist.destroy_process_group()


@pytest.mark.timeout(300)
def test_two_ranks_see_the_whole_batch():
    """tis's batch mean, the mismatch sums and the ratio quantiles are those of the whole batch when
    its rows are split over two ranks (real gloo collectives)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank")
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(Path(__file__).resolve()), "--worker", out]
        done = subprocess.run(cmd, capture_output=True, timeout=240, env=env)
        assert done.returncode == 0, done.stdout.decode()[-2000:] + done.stderr.decode()[-4000:]
        got = [json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1)]
    prox, beh, mask = batch()
    whole = mismatch_stats(prox, beh, mask, torch.tensor([[5, 6, 6, -1], [6, 6, -1, -1], [4, 4, -1, -1]]), 6,
                           offpolicy_weights(prox, beh, mask, "tis", cap=2.0, low=0.5, high=2.0))
    for r in (0, 1):
        assert got[r]["stats"] == pytest.approx(whole)
    # the weights of test_tis_is_the_capped_weight_over_its_batch_mean, each rank its own rows
    close([got[0]["w"][0][:3], got[0]["w"][1][:2], got[1]["w"][0][:2]],
          [[16 / 9, 8 / 9, 2 / 9], [16 / 9, 16 / 9], [4 / 9, 1 / 9]])


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    _rank_worker(sys.argv[2])
