"""worldloop.learner.losses against values computed by hand: decoupled PPO clip, IS truncation, value clip, KL."""

from __future__ import annotations

import math

import pytest
import torch

from worldloop.learner.losses import kl_penalty, masked_mean, masked_sum, masked_var, policy_loss, value_loss

NAN = float("nan")
LN = math.log

# four generated tokens and one padded position (NaN everywhere there)
#   token 0: r = 1.5, A = +1, pi_prox/pi_behav = 3   -> clipped side (r > 1 + eps), w truncated to 2
#   token 1: r = 0.5, A = +2, pi_prox/pi_behav = 1   -> unclipped side is the min
#   token 2: r = 0.5, A = -1, pi_prox/pi_behav = 0.5 -> clipped side (r < 1 - eps)
#   token 3: r = 1.5, A = -1, pi_prox/pi_behav = 1   -> unclipped (no clip upward for A < 0)
PROX = [-1.0, -2.0, -0.5, -1.2]
RATIO = [1.5, 0.5, 0.5, 1.5]
IW = [3.0, 1.0, 0.5, 1.0]
ADV = [1.0, 2.0, -1.0, -1.0]


def policy_inputs():
    prox = torch.tensor([PROX + [NAN]])
    new = torch.tensor([[p + LN(r) for p, r in zip(PROX, RATIO)] + [NAN]], requires_grad=True)
    behav = torch.tensor([[p - LN(w) for p, w in zip(PROX, IW)] + [NAN]])
    adv = torch.tensor([ADV + [NAN]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    return new, prox, behav, adv, mask


def test_policy_loss_by_hand() -> None:
    new, prox, behav, adv, mask = policy_inputs()
    loss, stats = policy_loss(new, prox, behav, adv, mask, clip_ratio=0.2, iw_cap=2.0)
    # per token: -w * min(r A, clip(r, 0.8, 1.2) A)
    l0 = -2.0 * min(1.5 * 1.0, 1.2 * 1.0)  # w = min(3, 2)
    l1 = -1.0 * min(0.5 * 2.0, 0.8 * 2.0)
    l2 = -0.5 * min(0.5 * -1.0, 0.8 * -1.0)
    l3 = -1.0 * min(1.5 * -1.0, 1.2 * -1.0)
    assert (l0, l1, l2, l3) == pytest.approx((-2.4, -1.0, 0.4, 1.5))
    assert loss.item() == pytest.approx((l0 + l1 + l2 + l3) / 4)  # token mean over the mask
    assert stats["loss"] == pytest.approx(loss.item())
    assert stats["clip_fraction"] == pytest.approx(2 / 4)  # tokens 0 and 2
    assert stats["ratio_mean"] == pytest.approx(1.0)
    assert stats["ratio_max"] == pytest.approx(1.5) and stats["ratio_min"] == pytest.approx(0.5)
    assert stats["iw_mean"] == pytest.approx((3 + 1 + 0.5 + 1) / 4)
    assert stats["iw_max"] == pytest.approx(3.0) and stats["iw_min"] == pytest.approx(0.5)
    assert stats["iw_truncated_fraction"] == pytest.approx(1 / 4)
    assert stats["approx_kl_k1"] == pytest.approx(-(2 * LN(1.5) + 2 * LN(0.5)) / 4)
    assert stats["approx_kl"] == pytest.approx(sum(r - 1 - LN(r) for r in RATIO) / 4)
    assert stats["tokens"] == 4
    loss.backward()
    # d/d logp of -w A r = -w A r on the unclipped side, 0 on the clipped side, 0 on padding
    want = torch.tensor([[0.0, -1.0 * 2.0 * 0.5 / 4, 0.0, -1.0 * -1.0 * 1.5 / 4, 0.0]])
    torch.testing.assert_close(new.grad, want)


def test_policy_loss_untruncated_and_no_weight_gradient() -> None:
    new, prox, behav, adv, mask = policy_inputs()
    prox.requires_grad_(True)
    behav.requires_grad_(True)
    loss, stats = policy_loss(new, prox, behav, adv, mask, iw_cap=None)
    assert loss.item() == pytest.approx((-3.0 * 1.2 - 1.0 + 0.4 + 1.5) / 4)  # w0 = 3
    assert stats["iw_truncated_fraction"] == 0.0
    loss.backward()
    assert prox.grad is None and behav.grad is None


def test_policy_loss_empty_mask_and_bad_args() -> None:
    new, prox, behav, adv, mask = policy_inputs()
    loss, stats = policy_loss(new, prox, behav, adv, torch.zeros_like(mask))
    assert loss.item() == 0.0 and stats["tokens"] == 0 and stats["iw_max"] == 0.0
    loss.backward()
    assert (new.grad == 0).all()
    with pytest.raises(ValueError, match="clip_ratio"):
        policy_loss(new, prox, behav, adv, mask, clip_ratio=0.0)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(new, prox, behav, adv[:, :3], mask)


def test_value_loss_by_hand() -> None:
    old = torch.tensor([[1.0, 1.0, 0.0, 0.0, NAN]])
    values = torch.tensor([[1.5, 1.5, -0.1, -0.5, NAN]], requires_grad=True)
    returns = torch.tensor([[1.2, 2.0, 0.5, -1.0, NAN]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    # V_clip = old + clip(V - old, -0.2, 0.2) = 1.2, 1.2, -0.1, -0.2
    e0 = max((1.5 - 1.2) ** 2, (1.2 - 1.2) ** 2)  # unclipped larger
    e1 = max((1.5 - 2.0) ** 2, (1.2 - 2.0) ** 2)  # clipped larger
    e2 = max((-0.1 - 0.5) ** 2, (-0.1 - 0.5) ** 2)  # inside the clip range: equal
    e3 = max((-0.5 + 1.0) ** 2, (-0.2 + 1.0) ** 2)  # clipped larger
    loss, stats = value_loss(values, old, returns, mask, value_clip=0.2)
    assert loss.item() == pytest.approx(0.5 * (e0 + e1 + e2 + e3) / 4)
    assert loss.item() == pytest.approx(0.21625)
    assert stats["clip_fraction"] == pytest.approx(2 / 4)
    assert stats["mse"] == pytest.approx((0.09 + 0.25 + 0.36 + 0.25) / 4)
    assert stats["value_mean"] == pytest.approx((1.5 + 1.5 - 0.1 - 0.5) / 4)
    loss.backward()
    # d/dV 0.5 (V - G)^2 = V - G where the unclipped error is used, 0 where the clipped one is
    torch.testing.assert_close(values.grad, torch.tensor([[0.3 / 4, 0.0, -0.6 / 4, 0.0, 0.0]]))
    plain, _ = value_loss(values, old, returns, mask, value_clip=None)
    assert plain.item() == pytest.approx(0.5 * (0.09 + 0.25 + 0.36 + 0.25) / 4)


def test_kl_penalty_estimators_by_hand() -> None:
    logp = torch.tensor([LN(0.5), LN(0.25)])
    ref = torch.tensor([LN(0.25), LN(0.5)])
    d = LN(2.0)  # logp - ref = +ln 2, -ln 2
    torch.testing.assert_close(kl_penalty(logp, ref, "kl"), torch.tensor([d, -d]))
    torch.testing.assert_close(kl_penalty(logp, ref, "abs"), torch.tensor([d, d]))
    torch.testing.assert_close(kl_penalty(logp, ref, "mse"), torch.tensor([0.5 * d * d, 0.5 * d * d]))
    # k3 = exp(ref - logp) - (ref - logp) - 1: 0.5 + ln2 - 1 and 2 - ln2 - 1
    torch.testing.assert_close(kl_penalty(logp, ref), torch.tensor([0.5 + d - 1, 2 - d - 1]))
    big = kl_penalty(torch.tensor([-100.0]), torch.tensor([0.0]), "low_var_kl")
    assert big.item() == 10.0  # clamped
    with pytest.raises(ValueError, match="kind"):
        kl_penalty(logp, ref, "full")


def test_masked_reductions_ignore_nan_padding() -> None:
    x = torch.tensor([[1.0, 2.0, NAN], [3.0, NAN, NAN]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert masked_sum(x, m).item() == 6.0
    assert masked_mean(x, m).item() == 2.0
    torch.testing.assert_close(masked_mean(x, m, dim=1), torch.tensor([1.5, 3.0]))
    assert masked_var(x, m).item() == pytest.approx(1.0)  # ((-1)^2 + 0 + 1^2) / (3 - 1)
    assert masked_var(x, m, unbiased=False).item() == pytest.approx(2 / 3)
    assert masked_mean(x, torch.zeros_like(m)).item() == 0.0


def test_aggregation_weights_and_normalisers_by_hand():
    from worldloop.learner.losses import aggregation_normaliser, aggregation_weights

    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    assert aggregation_weights(mask, "token-mean").tolist() == mask.float().tolist()
    assert aggregation_normaliser(mask, "token-mean") == 6.0
    assert aggregation_weights(mask, "seq-mean-token-mean").tolist() == [[0.5, 0.5, 0, 0], [0.25] * 4, [0.0] * 4]
    assert aggregation_normaliser(mask, "seq-mean-token-mean") == 2.0  # rows with a loss token
    assert aggregation_weights(mask, "seq-mean-token-sum").tolist() == mask.float().tolist()
    assert aggregation_normaliser(mask, "seq-mean-token-sum") == 2.0
    with pytest.raises(ValueError, match="loss aggregation"):
        aggregation_weights(mask, "sum")


def test_policy_loss_with_token_weights_is_the_weighted_sum_by_hand():
    # ratio 1 everywhere (new = proximal = behaviour): loss_i = -A_i
    lp = torch.zeros(2, 3, requires_grad=True)
    adv = torch.tensor([[2.0, 4.0, 9.0], [1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    weights = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]) / 2  # seq-mean-token-mean of 2 rows
    loss, stats = policy_loss(lp, lp.detach(), lp.detach(), adv, mask, token_weights=weights)
    # rows' token means: -(2 + 4) / 2 = -3 and -1; their mean -2. The token mean would be -7/3.
    assert float(loss) == pytest.approx(-2.0)
    assert stats["loss"] == pytest.approx(-7.0 / 3.0)
    loss.backward()
    # d loss / d lp_i = -w_i * A_i (ratio = exp(lp - prox), derivative 1 at 0)
    assert torch.allclose(lp.grad, torch.tensor([[-0.5, -1.0, 0.0], [-0.5, 0.0, 0.0]]))
