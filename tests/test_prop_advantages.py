"""Property tests of the advantage estimators (learner/advantages.py) over generated layouts.

The layouts are the shapes where an off-by-one hides: rows with no generated token at all (all
observation, or all padding), one-token turns, turns with no observation between them, a
generated token at position 0 or at the very end of the row, and padding of any width. The oracle
is the per-row reference loop of tests/test_advantages.py (VAGEN Alg. 1 lines 17-22, written
out one row at a time); masked and bi-level GAE must equal it on every generated token and be
exactly 0 elsewhere, whatever the padding holds.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from worldloop.learner.advantages import bilevel_gae, grpo, masked_gae, turn_ppo
from test_advantages import _gae_reference

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TURN = st.tuples(st.integers(0, 3), st.integers(1, 3))  # (observation tokens before, generated tokens)
ROW = st.lists(TURN, max_size=3).flatmap(lambda turns: st.tuples(st.just(turns), st.integers(0, 3)))  # + obs tail
DISCOUNT = st.sampled_from([0.0, 0.5, 0.9, 1.0])


@st.composite
def batches(draw) -> dict:
    rows = draw(st.lists(ROW, min_size=1, max_size=4))
    used = [sum(o + g for o, g in turns) + tail for turns, tail in rows]
    length = max(1, max(used) + draw(st.integers(0, 3)))
    resp, end = torch.zeros(len(rows), length), torch.zeros(len(rows), length)
    attention = torch.zeros(len(rows), length, dtype=torch.long)
    for b, (turns, tail) in enumerate(rows):
        pos = 0
        for n_obs, n_gen in turns:
            pos += n_obs
            resp[b, pos : pos + n_gen] = 1
            end[b, pos + n_gen - 1] = 1
            pos += n_gen
        attention[b, : pos + tail] = 1
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    values = torch.randn(len(rows), length, generator=gen)
    turn_rewards = torch.where(end > 0, torch.randn(len(rows), length, generator=gen), 0.0)
    token_rewards = -0.1 * torch.rand(len(rows), length, generator=gen)
    return dict(values=values, response_mask=resp, turn_end_mask=end, turn_rewards=turn_rewards,
                token_rewards=token_rewards, attention_mask=attention)


def _poisoned(batch: dict) -> dict:
    """NaN wherever nothing may be read: padding, and values/token rewards of observation tokens."""
    out = {k: v.clone() for k, v in batch.items() if k != "attention_mask"}
    outside = batch["response_mask"] == 0
    for name in ("values", "token_rewards"):
        out[name][outside] = float("nan")
    out["turn_rewards"][batch["attention_mask"] == 0] = float("nan")
    return out


@SETTINGS
@given(batches(), DISCOUNT, DISCOUNT)
def test_masked_gae_equals_the_reference_loop(batch: dict, gamma: float, lam: float) -> None:
    adv, ret = masked_gae(**_poisoned(batch), gamma=gamma, lam=lam)
    v, k, r = (batch[n].tolist() for n in ("values", "token_rewards", "turn_rewards"))
    for b in range(adv.shape[0]):
        pos = (batch["response_mask"][b] > 0).nonzero().flatten().tolist()
        outside = batch["response_mask"][b] == 0
        assert (adv[b][outside] == 0).all() and (ret[b][outside] == 0).all()  # an empty row: all 0
        if not pos:
            continue
        rew = {i: k[b][i] for i in pos}
        rew[pos[-1]] += sum(r[b][e] for e in (batch["turn_end_mask"][b] > 0).nonzero().flatten().tolist())
        ref = _gae_reference(pos, v[b], rew, gamma, lam)
        for i in pos:
            assert adv[b, i].item() == pytest.approx(ref[i], abs=1e-5), (b, i)
            assert ret[b, i].item() == pytest.approx(ref[i] + v[b][i], abs=1e-5), (b, i)


@SETTINGS
@given(batches(), DISCOUNT, DISCOUNT, DISCOUNT, DISCOUNT)
def test_bilevel_gae_equals_the_reference_loops(batch: dict, gt: float, lt: float, gk: float, lk: float) -> None:
    adv, _ = bilevel_gae(**_poisoned(batch), gamma_turn=gt, lam_turn=lt, gamma_token=gk, lam_token=lk)
    v, k, r = (batch[n].tolist() for n in ("values", "token_rewards", "turn_rewards"))
    for b in range(adv.shape[0]):
        pos = (batch["response_mask"][b] > 0).nonzero().flatten().tolist()
        ends = (batch["turn_end_mask"][b] > 0).nonzero().flatten().tolist()
        assert (adv[b][batch["response_mask"][b] == 0] == 0).all()
        turn_adv = _gae_reference(ends, v[b], {e: r[b][e] for e in ends}, gt, lt)
        start = 0
        for e in ends:  # each turn: token-level GAE, the turn's advantage entering at its last token
            turn = [i for i in pos[start:] if i <= e]
            start += len(turn)
            rew = {i: k[b][i] for i in turn}
            rew[e] += turn_adv[e] + v[b][e]
            ref = _gae_reference(turn, v[b], rew, gk, lk)
            for i in turn:
                assert adv[b, i].item() == pytest.approx(ref[i], abs=1e-5), (b, i)


@SETTINGS
@given(batches())
def test_turn_ppo_and_grpo_stay_finite_and_zero_outside_the_response(batch: dict) -> None:
    poisoned = _poisoned(batch)
    n = batch["values"].shape[0]
    outs = [turn_ppo(**poisoned), grpo(**{k: v for k, v in poisoned.items() if k != "values"},
                                        group_ids=[b // 2 for b in range(n)])]
    outside = batch["response_mask"] == 0
    for adv, ret in outs:
        for x in (adv, ret):
            assert torch.isfinite(x).all() and (x[outside] == 0).all()
