"""worldloop.learner.advantages against values computed by hand from the formulas (VAGEN Alg. 1/2, Argos Eq. 10).

The hand batch (L = 10, positions 0..9; o = observation token, a = generated token, | = turn end):

    row A:  o o a a| o a a| o a a|         3 turns, rewards [1.0, 0.0, 0.5] (zero-reward middle turn)
    row B:  o a a| o a| pad pad pad pad pad  2 turns, rewards [-0.5, 2.0], right padding

values V and token rewards k (= -beta*KL) are nonzero on observation tokens too, so an estimator
that reads an observation token where it must skip it gets a different number.
"""

from __future__ import annotations

import math

import pytest
import torch

from worldloop.common.contracts.config import TrainerConfig
from worldloop.learner.advantages import (
    ESTIMATORS,
    advantage_kwargs,
    bilevel_gae,
    compute_advantages,
    gigpo,
    grounding_turn_advantages,
    grpo,
    loss_mask_for,
    step_group_sizes,
    masked_gae,
    turn_ppo,
    vanilla_ppo,
    whiten,
)

PAD = 5.0  # garbage at padded positions (NaN in the leak test)


def hand_batch(pad: float = PAD) -> dict[str, torch.Tensor]:
    resp = torch.tensor([[0, 0, 1, 1, 0, 1, 1, 0, 1, 1], [0, 1, 1, 0, 1, 0, 0, 0, 0, 0]], dtype=torch.float32)
    end = torch.tensor([[0, 0, 0, 1, 0, 0, 1, 0, 0, 1], [0, 0, 1, 0, 1, 0, 0, 0, 0, 0]], dtype=torch.float32)
    p = pad
    values = torch.tensor([[0.9, 0.9, 0.5, 0.6, 0.7, 0.4, 0.3, 0.35, 0.2, 0.1], [0.9, 1.0, 0.8, 0.6, 0.5, p, p, p, p, p]])
    turn_rewards = torch.tensor([[0, 0, 0, 1.0, 0, 0, 0.0, 0, 0, 0.5], [0, 0, -0.5, 0, 2.0, p, p, p, p, p]])
    token_rewards = torch.tensor(
        [[-0.3, -0.3, -0.1, 0, -0.01, 0, -0.2, -0.02, 0, -0.05], [-0.3, 0, -0.1, -0.04, 0, p, p, p, p, p]]
    )
    attention = torch.tensor([[1] * 10, [1] * 5 + [0] * 5])
    return dict(values=values, response_mask=resp, turn_end_mask=end, turn_rewards=turn_rewards, token_rewards=token_rewards, attention_mask=attention)


def expected(rows: dict[int, dict[int, float]], length: int = 10) -> torch.Tensor:
    out = torch.zeros(len(rows), length)
    for b, cols in rows.items():
        for i, v in cols.items():
            out[b, i] = v
    return out


def shared(batch: dict) -> dict:
    return {k: batch[k] for k in ("values", "response_mask", "turn_end_mask", "turn_rewards", "token_rewards")}


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == torch.float32
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- hand-computed values


def test_masked_gae_by_hand() -> None:
    g, lam = 0.9, 0.8
    gl = g * lam
    # row A: generated tokens 2,3,5,6,8,9; R = 1.0 + 0.0 + 0.5 = 1.5 added at token 9
    d9 = (-0.05 + 1.5) + g * 0 - 0.1
    a9 = d9
    d8 = 0 + g * 0.1 - 0.2
    a8 = d8 + gl * a9
    d6 = -0.2 + g * 0.2 - 0.3
    a6 = d6 + gl * a8
    d5 = 0 + g * 0.3 - 0.4  # next generated token after 5 is 6
    a5 = d5 + gl * a6
    d3 = 0 + g * 0.4 - 0.6  # skips observation token 4 (V=0.7, k=-0.01)
    a3 = d3 + gl * a5
    d2 = -0.1 + g * 0.6 - 0.5
    a2 = d2 + gl * a3
    # row B: generated tokens 1,2,4; R = -0.5 + 2.0 = 1.5 at token 4
    e4 = (0 + 1.5) - 0.5
    b4 = e4
    e2 = -0.1 + g * 0.5 - 0.8  # skips observation token 3
    b2 = e2 + gl * b4
    e1 = 0 + g * 0.8 - 1.0
    b1 = e1 + gl * b2
    adv, ret = masked_gae(**shared(hand_batch()), gamma=g, lam=lam)
    close(adv, expected({0: {2: a2, 3: a3, 5: a5, 6: a6, 8: a8, 9: a9}, 1: {1: b1, 2: b2, 4: b4}}))
    v = hand_batch()["values"]
    close(ret, torch.where(hand_batch()["response_mask"] > 0, adv + v, 0.0))  # G_i = A_i + V_i
    assert abs(a9 - 1.35) < 1e-9 and abs(a2 - (-0.18797872128)) < 1e-9  # the arithmetic itself


def test_bilevel_gae_by_hand() -> None:
    gt, lt, gk, lk = 0.95, 0.9, 0.9, 0.8
    # turn level, row A: V at turn ends 3, 6, 9 = 0.6, 0.3, 0.1; r = 1.0, 0.0, 0.5
    t2 = 0.5 + gt * 0 - 0.1
    t1 = (0.0 + gt * 0.1 - 0.3) + gt * lt * t2  # the zero-reward turn is still a turn
    t0 = (1.0 + gt * 0.3 - 0.6) + gt * lt * t1
    # token level: last token of turn = k + A_turn; others delta + gk*lk*A_next (same turn only)
    a9 = -0.05 + t2
    a8 = (0 + gk * 0.1 - 0.2) + gk * lk * a9
    a6 = -0.2 + t1
    a5 = (0 + gk * 0.3 - 0.4) + gk * lk * a6
    a3 = 0 + t0
    a2 = (-0.1 + gk * 0.6 - 0.5) + gk * lk * a3
    # row B: V at ends 2, 4 = 0.8, 0.5; r = -0.5, 2.0
    u1 = 2.0 - 0.5
    u0 = (-0.5 + gt * 0.5 - 0.8) + gt * lt * u1
    b4 = 0 + u1
    b2 = -0.1 + u0
    b1 = (0 + gk * 0.8 - 1.0) + gk * lk * b2
    adv, ret = bilevel_gae(**shared(hand_batch()), gamma_turn=gt, lam_turn=lt, gamma_token=gk, lam_token=lk)
    close(adv, expected({0: {2: a2, 3: a3, 5: a5, 6: a6, 8: a8, 9: a9}, 1: {1: b1, 2: b2, 4: b4}}))
    v = hand_batch()["values"]
    close(ret, torch.where(hand_batch()["response_mask"] > 0, adv + v, 0.0))
    assert abs(t0 - 0.802135) < 1e-9


def test_bilevel_gae_defaults_by_hand() -> None:
    # defaults: gamma_token = lam_token = 1, gamma_turn = 0.95, lam_turn = 1
    t2 = 0.5 - 0.1
    t1 = (0.0 + 0.95 * 0.1 - 0.3) + 0.95 * t2
    t0 = (1.0 + 0.95 * 0.3 - 0.6) + 0.95 * t1
    a9, a6, a3 = -0.05 + t2, -0.2 + t1, 0 + t0
    a8 = (0.1 - 0.2) + a9
    a5 = (0.3 - 0.4) + a6
    a2 = (-0.1 + 0.6 - 0.5) + a3
    adv, _ = bilevel_gae(**shared(hand_batch()))
    torch.testing.assert_close(adv[0], expected({0: {2: a2, 3: a3, 5: a5, 6: a6, 8: a8, 9: a9}})[0])


def test_bilevel_gae_vagen_kl_routing_by_hand() -> None:
    # kl_routing="turn_reward" (VAGEN's verl core_algos): the turn-end token's k joins r_t at the
    # turn level (r'_t = r_t + k_end) and the end token gets A_t alone
    gt, lt, gk, lk = 0.95, 0.9, 0.9, 0.8
    # row A: ends 3, 6, 9 with k = 0, -0.2, -0.05 -> r' = 1.0, -0.2, 0.45; V at ends 0.6, 0.3, 0.1
    t2 = 0.45 + gt * 0 - 0.1
    t1 = (-0.2 + gt * 0.1 - 0.3) + gt * lt * t2
    t0 = (1.0 + gt * 0.3 - 0.6) + gt * lt * t1
    a9, a6, a3 = t2, t1, t0
    a8 = (0 + gk * 0.1 - 0.2) + gk * lk * a9
    a5 = (0 + gk * 0.3 - 0.4) + gk * lk * a6
    a2 = (-0.1 + gk * 0.6 - 0.5) + gk * lk * a3
    # row B: ends 2, 4 with k = -0.1, 0 -> r' = -0.6, 2.0; V at ends 0.8, 0.5
    u1 = 2.0 - 0.5
    u0 = (-0.6 + gt * 0.5 - 0.8) + gt * lt * u1
    b4, b2 = u1, u0
    b1 = (0 + gk * 0.8 - 1.0) + gk * lk * b2
    kw = dict(gamma_turn=gt, lam_turn=lt, gamma_token=gk, lam_token=lk)
    adv, ret = bilevel_gae(**shared(hand_batch()), **kw, kl_routing="turn_reward")
    close(adv, expected({0: {2: a2, 3: a3, 5: a5, 6: a6, 8: a8, 9: a9}, 1: {1: b1, 2: b2, 4: b4}}))
    v = hand_batch()["values"]
    close(ret, torch.where(hand_batch()["response_mask"] > 0, adv + v, 0.0))
    assert abs(t0 - 0.59458375) < 1e-9  # the arithmetic itself (own_turn gives 0.802135 here)
    # turn 1's k = -0.2 now also reaches turn 0, discounted by gt*lt: the first turn's end moves by
    # gt*lt*(-0.2 + gt*lt*(-0.05)) against own_turn, the last turn's end token is the same
    own, _ = bilevel_gae(**shared(hand_batch()), **kw)
    assert abs((adv[0, 3] - own[0, 3]).item() - gt * lt * (-0.2 + gt * lt * -0.05)) < 1e-6
    assert abs((adv[0, 9] - own[0, 9]).item()) < 1e-6
    # the dispatcher passes it through; other estimators ignore it; a bad value names the keyword
    close(compute_advantages("bilevel_gae", **hand_batch(), **kw, kl_routing="turn_reward")[0], adv)
    close(compute_advantages("masked_gae", **hand_batch(), kl_routing="turn_reward")[0],
          masked_gae(**shared(hand_batch()))[0])
    with pytest.raises(ValueError, match="kl_routing"):
        bilevel_gae(**shared(hand_batch()), kl_routing="vagen")


def test_bilevel_kl_routings_agree_without_end_token_terms() -> None:
    batch = shared(hand_batch())
    batch["token_rewards"] = torch.where(hand_batch()["turn_end_mask"] > 0, 0.0, batch["token_rewards"])
    a, r = bilevel_gae(**batch, gamma_turn=0.9, lam_turn=0.7, gamma_token=0.8, lam_token=0.6)
    b, s = bilevel_gae(**batch, gamma_turn=0.9, lam_turn=0.7, gamma_token=0.8, lam_token=0.6, kl_routing="turn_reward")
    close(a, b)
    close(r, s)


def test_turn_ppo_by_hand() -> None:
    g, lam = 0.95, 0.9
    # row A: V at each turn's FIRST token (2, 5, 8) = 0.5, 0.4, 0.2;
    # r'_t = r_t + the turn's token rewards: 1.0 + (-0.1 + 0), 0.0 + (0 - 0.2), 0.5 + (0 - 0.05)
    r0, r1, r2 = 1.0 - 0.1, 0.0 - 0.2, 0.5 - 0.05
    t2 = r2 + g * 0 - 0.2
    t1 = (r1 + g * 0.2 - 0.4) + g * lam * t2
    t0 = (r0 + g * 0.4 - 0.5) + g * lam * t1
    # row B: first tokens 1, 4 -> V 1.0, 0.5; r' = -0.5 + (0 - 0.1), 2.0 + 0
    u1 = 2.0 - 0.5
    u0 = (-0.6 + g * 0.5 - 1.0) + g * lam * u1
    adv, ret = turn_ppo(**shared(hand_batch()), gamma_turn=g, lam_turn=lam)
    close(adv, expected({0: {2: t0, 3: t0, 5: t1, 6: t1, 8: t2, 9: t2}, 1: {1: u0, 2: u0, 4: u1}}))
    g0, g1, g2 = t0 + 0.5, t1 + 0.4, t2 + 0.2  # G_t = A_t + V_t, the same for all tokens of the turn
    close(ret, expected({0: {2: g0, 3: g0, 5: g1, 6: g1, 8: g2, 9: g2}, 1: {1: u0 + 1.0, 2: u0 + 1.0, 4: u1 + 0.5}}))


def test_vanilla_ppo_by_hand() -> None:
    g, lam = 0.9, 0.8
    gl = g * lam
    # row A: every token from 2 on, observation tokens 4 and 7 included (their V and k are read)
    a9 = (-0.05 + 1.5) - 0.1
    a8 = (0 + g * 0.1 - 0.2) + gl * a9
    a7 = (-0.02 + g * 0.2 - 0.35) + gl * a8
    a6 = (-0.2 + g * 0.35 - 0.3) + gl * a7
    a5 = (0 + g * 0.3 - 0.4) + gl * a6
    a4 = (-0.01 + g * 0.4 - 0.7) + gl * a5
    a3 = (0 + g * 0.7 - 0.6) + gl * a4
    a2 = (-0.1 + g * 0.6 - 0.5) + gl * a3
    # row B: tokens 1..4 (observation token 3 included); position 0 (the prompt) and padding not
    b4 = 1.5 - 0.5
    b3 = (-0.04 + g * 0.5 - 0.6) + gl * b4
    b2 = (-0.1 + g * 0.6 - 0.8) + gl * b3
    b1 = (0 + g * 0.8 - 1.0) + gl * b2
    batch = hand_batch()
    adv, ret = vanilla_ppo(**shared(batch), attention_mask=batch["attention_mask"], gamma=g, lam=lam)
    close(adv, expected({0: {2: a2, 3: a3, 4: a4, 5: a5, 6: a6, 7: a7, 8: a8, 9: a9}, 1: {1: b1, 2: b2, 3: b3, 4: b4}}))
    mask = loss_mask_for("vanilla_ppo", batch["response_mask"], batch["attention_mask"])
    assert mask.tolist() == [[0, 0, 1, 1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0, 0, 0, 0, 0]]
    close(ret, torch.where(mask > 0, adv + batch["values"], 0.0))
    assert loss_mask_for("bilevel_gae", batch["response_mask"], batch["attention_mask"]) is batch["response_mask"]


def grpo_batch() -> dict:
    # 6 rows of length 4: "o a a| pad" with the row's reward at its turn end (position 2)
    rows = 6
    resp = torch.tensor([[0, 1, 1, 0]] * rows, dtype=torch.float32)
    end = torch.tensor([[0, 0, 1, 0]] * rows, dtype=torch.float32)
    rewards = torch.zeros(rows, 4)
    rewards[:, 2] = torch.tensor([1.0, 3.2, 2.0, 0.5, -1.0, 7.0])
    rewards[:, 3] = float("nan")  # padding
    tok = torch.zeros(rows, 4)
    tok[1, 1] = -0.2  # row 1's score = 3.2 - 0.2 = 3.0
    tok[:, 0] = 9.0  # observation token: not part of the score
    return dict(response_mask=resp, turn_end_mask=end, turn_rewards=rewards, token_rewards=tok)


def test_grpo_by_hand() -> None:
    # group g: scores 1.0, 3.0 -> mean 2, std = sqrt(((-1)^2 + 1^2) / (2 - 1)) = sqrt(2)
    # group h: scores 2.0, 0.5, -1.0 -> mean 0.5, std = sqrt((1.5^2 + 0 + 1.5^2) / 2) = 1.5
    # group k: one row -> advantage 0
    eps = 1e-6
    want = [-1 / (math.sqrt(2) + eps), 1 / (math.sqrt(2) + eps), 1.5 / (1.5 + eps), 0.0, -1.5 / (1.5 + eps), 0.0]
    scores = [1.0, 3.0, 2.0, 0.5, -1.0, 7.0]
    for ids in (["g", "g", "h", "h", "h", "k"], torch.tensor([4, 4, 1, 1, 1, 9])):
        adv, ret = grpo(**grpo_batch(), group_ids=ids)
        mask = grpo_batch()["response_mask"]
        close(adv, mask * torch.tensor(want)[:, None])
        close(ret, mask * torch.tensor(scores)[:, None])


def test_grpo_without_std_normalisation_by_hand() -> None:
    # norm_by_std=False (Dr. GRPO): A = score - group mean, same groups as above
    want = [1.0 - 2.0, 3.0 - 2.0, 2.0 - 0.5, 0.5 - 0.5, -1.0 - 0.5, 0.0]
    adv, ret = grpo(**grpo_batch(), group_ids=["g", "g", "h", "h", "h", "k"], norm_by_std=False)
    mask = grpo_batch()["response_mask"]
    close(adv, mask * torch.tensor(want)[:, None])
    close(ret, mask * torch.tensor([1.0, 3.0, 2.0, 0.5, -1.0, 7.0])[:, None])
    kw = advantage_kwargs(TrainerConfig(grpo_norm_by_std=False))
    assert kw["norm_by_std"] is False and advantage_kwargs(TrainerConfig())["norm_by_std"] is True
    close(compute_advantages("grpo", **grpo_batch(), **kw, group_ids=["g", "g", "h", "h", "h", "k"])[0], adv)


def test_grpo_outcome_only_and_bad_ids() -> None:
    batch = grpo_batch()
    batch["token_rewards"] = None
    adv, ret = grpo(**batch, group_ids=["g"] * 6)
    assert ret[1, 1].item() == pytest.approx(3.2)
    with pytest.raises(ValueError, match="group_ids"):
        grpo(**grpo_batch(), group_ids=["g"] * 5)
    with pytest.raises(ValueError, match="group_ids"):
        grpo(**grpo_batch(), group_ids="gggggg")


# --------------------------------------------------------------------------- GiGPO

# (reward, anchor) of every turn per row; each turn is 1 observation token + 2 generated tokens
GIGPO_ROWS = [
    [(1.0, "A"), (0.0, "B"), (2.0, "C")],  # group g
    [(0.5, "A"), (3.0, "C")],  # group g
    [(4.0, "B"), (1.0, "C")],  # group g
    [(1.0, "A"), (1.0, "D")],  # group h: its "A" is another level's state, not g's
    [(5.0, "A")],  # group k: a group of one
]
GIGPO_GROUPS = ["g", "g", "g", "h", "k"]
GIGPO_ANCHORS = [[a for _, a in row] for row in GIGPO_ROWS]


def gigpo_batch(length: int = 10) -> dict:
    rows = len(GIGPO_ROWS)
    resp, end, rew = torch.zeros(rows, length), torch.zeros(rows, length), torch.zeros(rows, length)
    for b, turns in enumerate(GIGPO_ROWS):
        for t, (r, _) in enumerate(turns):
            resp[b, 3 * t + 1 : 3 * t + 3] = 1
            end[b, 3 * t + 2] = 1
            rew[b, 3 * t + 2] = r
        rew[b, 3 * len(turns) :] = float("nan")  # padding is never read
    return dict(response_mask=resp, turn_end_mask=end, turn_rewards=rew)


def per_turn(values: list[list[float]], length: int = 10) -> torch.Tensor:
    """[B, L] with turn t's value on its two generated tokens."""
    out = torch.zeros(len(values), length)
    for b, row in enumerate(values):
        for t, v in enumerate(row):
            out[b, 3 * t + 1 : 3 * t + 3] = v
    return out


def test_gigpo_step_returns_and_group_sizes_by_hand() -> None:
    # gamma 0.5, R_t = r_t + 0.5 R_{t+1}: row 0: R_2 = 2, R_1 = 0 + 1 = 1, R_0 = 1 + 0.5 = 1.5;
    # row 1: 3, 0.5 + 1.5 = 2; row 2: 1, 4 + 0.5 = 4.5; row 3: 1, 1 + 0.5 = 1.5; row 4: 5
    _, ret = gigpo(**gigpo_batch(), group_ids=GIGPO_GROUPS, anchors=GIGPO_ANCHORS, step_gamma=0.5)
    close(ret, per_turn([[1.5, 1.0, 2.0], [2.0, 3.0], [4.5, 1.0], [1.5, 1.0], [5.0]]))
    # (g,A): r0t0 r1t0; (g,B): r0t1 r2t0; (g,C): r0t2 r1t1 r2t1; h's and k's states are alone
    assert step_group_sizes(GIGPO_GROUPS, GIGPO_ANCHORS) == [[2, 2, 3], [2, 3], [2, 3], [1, 1], [1]]


def test_gigpo_without_std_by_hand() -> None:
    # episode scores: g: 3, 3.5, 5 -> mean 11.5/3; h, k: groups of one -> 0
    # step groups (R_t above): (g,A) 1.5, 2 -> mean 1.75; (g,B) 1, 4.5 -> 2.75; (g,C) 2, 3, 1 -> 2
    m = 11.5 / 3
    w = 0.5
    want = [[3 - m + w * (1.5 - 1.75), 3 - m + w * (1 - 2.75), 3 - m + w * (2 - 2)],
            [3.5 - m + w * (2 - 1.75), 3.5 - m + w * (3 - 2)],
            [5 - m + w * (4.5 - 2.75), 5 - m + w * (1 - 2)],
            [0.0, 0.0], [0.0]]
    adv, _ = gigpo(**gigpo_batch(), group_ids=GIGPO_GROUPS, anchors=GIGPO_ANCHORS, step_gamma=0.5, step_weight=w,
                   norm_by_std=False)
    close(adv, per_turn(want))


def test_gigpo_with_std_by_hand() -> None:
    eps = 1e-6
    m = 11.5 / 3
    sd_g = math.sqrt(((3 - m) ** 2 + (3.5 - m) ** 2 + (5 - m) ** 2) / 2)  # sqrt(13/12)
    sd_a = math.sqrt(2 * 0.25**2)  # (g,A): deviations -0.25, +0.25
    sd_b = math.sqrt(2 * 1.75**2)  # (g,B): -1.75, +1.75
    sd_c = 1.0  # (g,C): 0, +1, -1 -> sqrt(2 / 2)
    e = [(x - m) / (sd_g + eps) for x in (3.0, 3.5, 5.0)]
    want = [[e[0] - 0.25 / (sd_a + eps), e[0] - 1.75 / (sd_b + eps), e[0] + 0.0],
            [e[1] + 0.25 / (sd_a + eps), e[1] + 1.0 / (sd_c + eps)],
            [e[2] + 1.75 / (sd_b + eps), e[2] - 1.0 / (sd_c + eps)],
            [0.0, 0.0], [0.0]]
    adv, _ = gigpo(**gigpo_batch(), group_ids=GIGPO_GROUPS, anchors=GIGPO_ANCHORS, step_gamma=0.5, eps=eps)
    close(adv, per_turn(want))
    # through the dispatcher with the config's keys
    kw = advantage_kwargs(TrainerConfig(estimator="gigpo", gigpo_gamma=0.5, gigpo_step_weight=1.0))
    assert (kw["step_gamma"], kw["step_weight"], kw["norm_by_std"]) == (0.5, 1.0, True)
    close(compute_advantages("gigpo", **gigpo_batch(), **kw, group_ids=GIGPO_GROUPS, anchors=GIGPO_ANCHORS)[0], adv)


def test_gigpo_reduces_to_grpo_and_checks_its_anchors() -> None:
    batch = {**gigpo_batch(), "token_rewards": torch.zeros(5, 10)}
    batch["token_rewards"][1, 4] = -0.5  # token rewards enter the episode score only
    want, _ = grpo(**batch, group_ids=GIGPO_GROUPS)
    # no shared state: every step group is a singleton (A_S = 0); or step_weight 0
    unique = [[f"{b}-{t}" for t in range(len(row))] for b, row in enumerate(GIGPO_ROWS)]
    close(gigpo(**batch, group_ids=GIGPO_GROUPS, anchors=unique)[0], want)
    close(gigpo(**batch, group_ids=GIGPO_GROUPS, anchors=GIGPO_ANCHORS, step_weight=0.0)[0], want)
    _, ret = gigpo(**batch, group_ids=GIGPO_GROUPS, anchors=GIGPO_ANCHORS, step_gamma=0.5)
    assert ret[1, 1].item() == pytest.approx(2.0)  # R_0 of row 1 without the token reward
    with pytest.raises(ValueError, match=r"anchors\[1\]"):
        gigpo(**batch, group_ids=GIGPO_GROUPS, anchors=[GIGPO_ANCHORS[0], ["A"], *GIGPO_ANCHORS[2:]])
    with pytest.raises(ValueError, match="anchors"):
        gigpo(**batch, group_ids=GIGPO_GROUPS, anchors=GIGPO_ANCHORS[:4])
    with pytest.raises(ValueError, match="hashable"):
        gigpo(**batch, group_ids=GIGPO_GROUPS, anchors=[[["A"]] * len(r) for r in GIGPO_ROWS])
    with pytest.raises(ValueError, match="step_gamma"):
        gigpo(**batch, group_ids=GIGPO_GROUPS, anchors=GIGPO_ANCHORS, step_gamma=1.5)
    with pytest.raises(ValueError, match="step_weight"):
        gigpo(**batch, group_ids=GIGPO_GROUPS, anchors=GIGPO_ANCHORS, step_weight=-1.0)


def test_grounding_turn_advantages_by_hand() -> None:
    # keys: the GRPO group; g's scores 1.0, 0.4, 0.7 -> mean 0.7; h: 0.2 alone -> 0; None takes no part
    scores = [[1.0, 0.4], [0.7, None], [0.2]]
    keys = [["g", "g"], ["g", "g"], ["h"]]
    got = grounding_turn_advantages(scores, keys, coef=2.0)
    want = [[2.0 * 0.3, 2.0 * -0.3], [0.0, None], [0.0]]
    for row_g, row_w in zip(got, want):
        assert row_g == pytest.approx(row_w)
    with pytest.raises(ValueError, match="scores, keys"):
        grounding_turn_advantages([[1.0]], [["g", "g"]])


# --------------------------------------------------------------------------- invariants


def random_batch(seed: int, rows: int = 5, length: int = 40) -> dict[str, torch.Tensor]:
    """Random interleaved layouts: per row some turns of (obs tokens, response tokens), then padding."""
    gen = torch.Generator().manual_seed(seed)
    resp = torch.zeros(rows, length)
    end = torch.zeros(rows, length)
    attention = torch.zeros(rows, length, dtype=torch.long)
    for b in range(rows):
        pos = 0
        for _ in range(int(torch.randint(1, 5, (1,), generator=gen))):
            n_obs, n_resp = (int(x) for x in torch.randint(1, 5, (2,), generator=gen))
            if pos + n_obs + n_resp > length:
                break
            pos += n_obs
            resp[b, pos : pos + n_resp] = 1
            end[b, pos + n_resp - 1] = 1
            pos += n_resp
        attention[b, :pos] = 1
    values = torch.randn(rows, length, generator=gen)
    turn_rewards = torch.where(end > 0, torch.randn(rows, length, generator=gen), 0.0)
    turn_rewards[0, (end[0] > 0).nonzero()[0]] = 0.0  # a zero-reward turn
    token_rewards = -0.1 * torch.rand(rows, length, generator=gen)
    return dict(values=values, response_mask=resp, turn_end_mask=end, turn_rewards=turn_rewards, token_rewards=token_rewards, attention_mask=attention)


DISCOUNTS = dict(gamma=0.9, lam=0.7, gamma_turn=0.8, lam_turn=0.6, gamma_token=0.9, lam_token=0.7)


def run_all(batch: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    groups = [b // 2 for b in range(batch["values"].shape[0])]
    # gigpo: turn t of the two rows of a group share their state when t is even
    anchors = [[t if t % 2 == 0 else f"{b}-{t}" for t in range(int(n))] for b, n in
               enumerate((batch["turn_end_mask"] > 0).sum(1).tolist())]
    return {e: compute_advantages(e, **batch, **DISCOUNTS, group_ids=groups, anchors=anchors) for e in ESTIMATORS}


@pytest.mark.parametrize("seed", [0, 1])
def test_zero_outside_mask_and_padding_never_read(seed: int) -> None:
    batch = random_batch(seed)
    out = run_all(batch)
    poisoned = {k: v.clone() for k, v in batch.items()}
    resp, att = batch["response_mask"] > 0, batch["attention_mask"] > 0
    for name in ("values", "turn_rewards", "token_rewards"):
        poisoned[name][~att] = float("nan")  # padding
    # masked estimators also never read values/token rewards at observation tokens
    masked = {k: v.clone() for k, v in poisoned.items()}
    masked["values"][~resp] = float("nan")
    masked["token_rewards"][~resp] = float("inf")
    out_pad, out_obs = run_all(poisoned), run_all(masked)
    for e in ESTIMATORS:
        mask = loss_mask_for(e, batch["response_mask"], batch["attention_mask"]) > 0
        for k in range(2):
            assert torch.isfinite(out[e][k]).all()
            assert (out[e][k][~mask] == 0).all(), e
            torch.testing.assert_close(out_pad[e][k], out[e][k], msg=e)
            if e != "vanilla_ppo":
                torch.testing.assert_close(out_obs[e][k], out[e][k], msg=e)


def test_bilevel_with_one_turn_equals_masked_gae() -> None:
    batch = random_batch(3)
    # keep each row's last turn only: earlier response tokens become observation tokens
    resp, end = batch["response_mask"].clone(), batch["turn_end_mask"]
    for b in range(resp.shape[0]):
        ends = (end[b] > 0).nonzero().flatten()
        if len(ends) > 1:
            resp[b, : ends[-2] + 1] = 0
    one = {**batch, "response_mask": resp, "turn_end_mask": end * resp, "turn_rewards": batch["turn_rewards"] * resp}
    one.pop("attention_mask")
    for gamma_turn, lam_turn in ((1.0, 1.0), (0.5, 0.3)):
        bi = bilevel_gae(**one, gamma_turn=gamma_turn, lam_turn=lam_turn, gamma_token=0.9, lam_token=0.7)
        mg = masked_gae(**one, gamma=0.9, lam=0.7)
        torch.testing.assert_close(bi, mg)


def test_turn_ppo_is_constant_within_each_turn() -> None:
    batch = random_batch(4)
    adv, ret = turn_ppo(**{k: v for k, v in batch.items() if k != "attention_mask"})
    end = batch["turn_end_mask"] > 0
    turn_of = torch.where(batch["response_mask"] > 0, end.long().cumsum(1) - end.long(), -1)
    for b in range(adv.shape[0]):
        for t in turn_of[b].unique().tolist():
            if t >= 0:
                sel = turn_of[b] == t
                assert adv[b, sel].unique().numel() == 1 and ret[b, sel].unique().numel() == 1


def _gae_reference(positions, values, rewards, gamma, lam):
    """VAGEN Alg. 1 lines 17-22 verbatim, one row, Python floats."""
    adv, nxt_v, nxt_a = {}, 0.0, 0.0
    for i in reversed(positions):
        delta = rewards[i] + gamma * nxt_v - values[i]
        nxt_a = delta + gamma * lam * nxt_a
        adv[i], nxt_v = nxt_a, values[i]
    return adv


@pytest.mark.parametrize("seed", [5, 6, 7])
def test_matches_per_row_reference_loops(seed: int) -> None:
    """Vectorised estimators == straightforward per-row loops written from Alg. 1 / Alg. 2."""
    batch = random_batch(seed, rows=6, length=60)
    v, k, r = (batch[n].tolist() for n in ("values", "token_rewards", "turn_rewards"))
    mg, _ = masked_gae(**{n: x for n, x in batch.items() if n != "attention_mask"}, gamma=0.9, lam=0.7)
    bi, _ = bilevel_gae(**{n: x for n, x in batch.items() if n != "attention_mask"}, gamma_turn=0.8, lam_turn=0.6, gamma_token=0.9, lam_token=0.7)
    for b in range(6):
        pos = (batch["response_mask"][b] > 0).nonzero().flatten().tolist()
        ends = (batch["turn_end_mask"][b] > 0).nonzero().flatten().tolist()
        if not pos:
            continue
        rew = {i: k[b][i] for i in pos}
        rew[pos[-1]] += sum(r[b][e] for e in ends)
        ref = _gae_reference(pos, v[b], rew, 0.9, 0.7)
        for i in pos:
            assert mg[b, i].item() == pytest.approx(ref[i], abs=1e-5)
        turn_adv = _gae_reference(ends, v[b], {e: r[b][e] for e in ends}, 0.8, 0.6)
        start = 0
        for e in ends:
            turn = [i for i in pos[start:] if i <= e]
            start += len(turn)
            rew = {i: k[b][i] for i in turn}
            rew[e] += turn_adv[e] + v[b][e]  # A_last = k + A_turn: delta with reward k + A + V, next 0
            ref = _gae_reference(turn, v[b], rew, 0.9, 0.7)
            for i in turn:
                assert bi[b, i].item() == pytest.approx(ref[i], abs=1e-5)


def test_dtype_device_and_bf16_inputs() -> None:
    batch = hand_batch()
    batch["values"] = batch["values"].bfloat16()
    batch["response_mask"] = batch["response_mask"].bool()
    for e in ESTIMATORS:
        adv, ret = compute_advantages(e, **batch, group_ids=[0, 0], anchors=[["a", "b", "c"], ["a", "c"]])
        assert adv.dtype == ret.dtype == torch.float32 and adv.shape == (2, 10)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu() -> None:
    batch = random_batch(8, rows=16, length=200)
    cpu = run_all(batch)
    gpu = run_all({k: v.cuda() for k, v in batch.items()})
    for e in ESTIMATORS:
        assert gpu[e][0].device.type == "cuda"
        torch.testing.assert_close(gpu[e][0].cpu(), cpu[e][0], msg=e)
        torch.testing.assert_close(gpu[e][1].cpu(), cpu[e][1], msg=e)


# --------------------------------------------------------------------------- errors, helpers


def test_bad_input_raises_naming_the_argument() -> None:
    batch = shared(hand_batch())
    bad = {**batch, "turn_end_mask": batch["turn_end_mask"].clone()}
    bad["turn_end_mask"][0, 4] = 1  # an observation token
    with pytest.raises(ValueError, match="turn_end_mask"):
        masked_gae(**bad)
    bad = {**batch, "turn_rewards": batch["turn_rewards"].clone()}
    bad["turn_rewards"][0, 2] = 1.0  # a generated token that is not a turn end
    with pytest.raises(ValueError, match="turn_rewards"):
        bilevel_gae(**bad)
    bad = {**batch, "turn_end_mask": batch["turn_end_mask"].clone()}
    bad["turn_end_mask"][1, 4] = 0  # last turn never closed
    with pytest.raises(ValueError, match="turn_end_mask"):
        turn_ppo(**bad)
    with pytest.raises(ValueError, match="values"):
        masked_gae(**{**batch, "values": batch["values"][:, :5]})
    with pytest.raises(ValueError, match="gamma_turn"):
        bilevel_gae(**batch, gamma_turn=1.5)
    with pytest.raises(ValueError, match="estimator"):
        compute_advantages("ppo", **batch)
    with pytest.raises(TypeError, match="gama"):
        compute_advantages("masked_gae", **batch, gama=0.9)
    with pytest.raises(ValueError, match="attention_mask"):
        loss_mask_for("vanilla_ppo", batch["response_mask"])


def test_dispatcher_routes_the_config_discounts() -> None:
    cfg = TrainerConfig(gamma=0.9, lam=0.8, gamma_turn=0.7, lam_turn=0.6, gamma_token=0.5, lam_token=0.4)
    kw = advantage_kwargs(cfg)
    assert kw["kl_routing"] == "own_turn"  # trainer.bilevel_kl_routing's default
    batch = hand_batch()
    base = shared(batch)
    pairs = [
        ("masked_gae", masked_gae(**base, gamma=0.9, lam=0.8)),
        ("bilevel_gae", bilevel_gae(**base, gamma_turn=0.7, lam_turn=0.6, gamma_token=0.5, lam_token=0.4)),
        ("turn_ppo", turn_ppo(**base, gamma_turn=0.7, lam_turn=0.6)),
        ("vanilla_ppo", vanilla_ppo(**base, attention_mask=batch["attention_mask"], gamma=0.9, lam=0.8)),
    ]
    for name, want in pairs:
        got = compute_advantages(name, **batch, **kw, group_ids=[0, 1])
        torch.testing.assert_close(got, want)


def test_whiten_by_hand() -> None:
    x = torch.tensor([[1.0, 2.0, float("nan")], [3.0, 100.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # masked 1, 2, 3: mean 2, unbiased var ((-1)^2 + 0 + 1^2) / 2 = 1
    s = 1 / math.sqrt(1 + 1e-8)
    torch.testing.assert_close(whiten(x, mask), torch.tensor([[-s, 0.0, 0.0], [s, 0.0, 0.0]]))
    torch.testing.assert_close(whiten(x, mask, shift_mean=False), torch.tensor([[2 - s, 2.0, 0.0], [2 + s, 0.0, 0.0]]))
    one = whiten(x, torch.tensor([[0, 1, 0], [0, 0, 0]]))  # a single element: var 0 -> 0
    assert torch.isfinite(one).all() and (one == 0).all()
