"""GRPO/DAPO loss pieces against hand-computed values."""
from __future__ import annotations

import math

import pytest
import torch

from vllm.rl import losses


def test_group_advantages_hand_values():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 0.0, 3.0]])
    a = losses.group_advantages(r)
    std0 = math.sqrt(4 * 0.25 / 3)  # Bessel: sum of squared deviations / (n - 1)
    c = 0.5 / (std0 + 1e-6)
    assert a[0].tolist() == pytest.approx([c, -c, -c, c], rel=1e-6)
    assert a[1].tolist() == [0.0, 0.0, 0.0, 0.0]  # equal rewards: no signal
    std2 = math.sqrt((3 * 0.75 ** 2 + 2.25 ** 2) / 3)
    assert a[2].tolist() == pytest.approx([-0.75 / std2] * 3 + [2.25 / std2], rel=1e-5)
    # normalised: each informative group has mean 0 and (unbiased) std 1
    for g in (0, 2):
        assert float(a[g].mean()) == pytest.approx(0.0, abs=1e-6)
        assert float(a[g].double().std()) == pytest.approx(1.0, abs=1e-5)
    # Dr. GRPO: centring only
    assert losses.group_advantages(r, norm_by_std=False)[0].tolist() == [0.5, -0.5, -0.5, 0.5]
    with pytest.raises(ValueError):
        losses.group_advantages(torch.tensor([[1.0], [2.0]]))


def test_overlong_penalty_ramp():
    lengths = torch.tensor([10, 12, 13, 14, 16])
    pen = losses.overlong_penalty(lengths, max_tokens=16, buffer=4, factor=1.0)
    assert pen.tolist() == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert losses.overlong_penalty(lengths, 16, 4, factor=0.5).tolist() == [0.0, 0.0, -0.125, -0.25, -0.5]
    assert losses.overlong_penalty(lengths, 16, 0).tolist() == [0.0] * 5


def test_informative_groups():
    s = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.25]])
    assert losses.informative_groups(s).tolist() == [False, True, False, True]


def test_k3_hand_value():
    lp = torch.tensor([math.log(0.5), math.log(0.3)], dtype=torch.float64)
    ref = torch.tensor([math.log(0.25), math.log(0.3)], dtype=torch.float64)
    k = losses.k3(lp, ref)
    assert float(k[0]) == pytest.approx(0.5 - math.log(0.5) - 1.0, rel=1e-12)
    assert float(k[1]) == 0.0


def test_aggregation_weights():
    assert losses.aggregation_weights([2, 3], "token-mean", 5, 2).tolist() == pytest.approx([0.2] * 5)
    w = losses.aggregation_weights([2, 3], "seq-mean-token-mean", 5, 2)
    assert w.tolist() == pytest.approx([1 / 4, 1 / 4, 1 / 6, 1 / 6, 1 / 6])
    # verl's seq-mean-token-sum: each response's token sum, mean over responses
    w = losses.aggregation_weights([2, 3], "seq-mean-token-sum", 5, 2)
    assert w.tolist() == pytest.approx([1 / 2] * 5)
    # Dr. GRPO: each response's token sum over a constant (the response limit), mean over responses
    w = losses.aggregation_weights([2, 3], "seq-mean-token-sum-norm", 5, 2, max_response_tokens=8)
    assert w.tolist() == pytest.approx([1 / 16] * 5)
    with pytest.raises(ValueError):
        losses.aggregation_weights([2, 3], "seq-mean-token-sum-norm", 5, 2)
    with pytest.raises(ValueError):
        losses.aggregation_weights([2], "sum", 2, 1)


def test_clip_and_kl_counts_skip_tokens_without_loss():
    """Tokens of weight 0 (an overlong-filtered response's) are not in the clip fraction's
    counts nor in the KL sum: verl's masked means."""
    logp = torch.tensor([math.log(1.5), math.log(1.5), math.log(0.5)], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64)
    ref = torch.tensor([0.0, 0.0, 0.0], dtype=torch.float64)
    w = torch.tensor([0.5, 0.0, 0.5], dtype=torch.float64)
    _, st = losses.policy_loss(logp, torch.zeros(3, dtype=torch.float64), adv, w, eps_low=0.2, eps_high=0.2,
                               ref_logp=ref, kl_coef=0.1)
    assert (st.clipped_low, st.clipped_high, st.tokens) == (1, 1, 2)
    assert st.kl_sum == pytest.approx(float(losses.k3(logp[[0, 2]], ref[[0, 2]]).sum()), rel=1e-12)


def test_policy_loss_clip_higher_hand_values():
    # ratios 1.5 (A=+1: clipped at 1.28), 0.5 (A=-1: clipped at 0.8), 1.5 (A=-1: unclipped side wins), 1 (A=2)
    logp = torch.tensor([math.log(1.5), math.log(0.5), math.log(1.5), 0.0], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(4, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, -1.0, 2.0], dtype=torch.float64)
    w = torch.full((4,), 0.25, dtype=torch.float64)
    loss, st = losses.policy_loss(logp, old, adv, w, eps_low=0.2, eps_high=0.28)
    assert float(loss) == pytest.approx((-1.28 + 0.8 + 1.5 - 2.0) / 4, rel=1e-12)
    assert (st.clipped_low, st.clipped_high, st.tokens) == (1, 1, 4)
    loss.backward()
    # clipped tokens get no gradient; others d/dlogp (-A r) = -A r
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, 1.5 / 4, -2.0 / 4], rel=1e-12)


def test_policy_loss_ratio_one_is_plain_policy_gradient():
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    adv = torch.tensor([0.5, -1.0, 2.0])
    w = torch.tensor([0.2, 0.3, 0.5])
    loss, st = losses.policy_loss(logp, logp.detach(), adv, w, eps_low=0.2, eps_high=0.2)
    loss.backward()
    assert float(loss) == pytest.approx(-(0.5 * 0.2 - 1.0 * 0.3 + 2.0 * 0.5), rel=1e-6)
    assert logp.grad.tolist() == pytest.approx([-0.1, 0.3, -1.0], rel=1e-6)
    assert st.clipped_low == st.clipped_high == 0


@pytest.mark.parametrize("eps_low, eps_high", [(0.0, 0.28), (0.2, 0.0), (0.0, 0.0)])
def test_a_zero_clip_eps_keeps_the_full_gradient_at_ratio_one(eps_low, eps_high):
    """r = 1 sits on a clip bound of eps 0: the two sides of the max tie there, and the
    gradient must be the whole policy gradient -A w (torch.maximum halved it)."""
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 2.0])
    w = torch.tensor([0.5, 0.25, 0.25])
    loss, st = losses.policy_loss(logp, logp.detach(), adv, w, eps_low=eps_low, eps_high=eps_high)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-0.5, 0.25, -0.5], rel=1e-6)
    assert float(loss) == pytest.approx(-(0.5 - 0.25 + 0.5), rel=1e-6)
    assert st.clipped_low == st.clipped_high == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_policy_loss_is_the_clipped_max_bit_for_bit(dtype):
    """For eps > 0 the loss, its gradient and the clip counts are those of
    max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) exactly (zero advantages included)."""
    g = torch.Generator().manual_seed(0)
    n = 2000
    logp = (torch.randn(n, generator=g) * 0.3 - 1.0).to(dtype).requires_grad_()
    old = logp.detach() + (torch.randn(n, generator=g) * 0.2).to(dtype)
    adv = torch.randn(n, generator=g).to(dtype)
    adv[::7] = 0.0
    w = torch.rand(n, generator=g).to(dtype)
    w[::5] = 0.0
    for lo, hi in ((0.2, 0.28), (0.1, 0.1)):
        r = torch.exp(logp - old)
        want = (torch.maximum(-adv * r, -adv * torch.clamp(r, 1 - lo, 1 + hi)) * w).sum()
        (want_grad,) = torch.autograd.grad(want, logp)
        loss, st = losses.policy_loss(logp, old, adv, w, eps_low=lo, eps_high=hi)
        (grad,) = torch.autograd.grad(loss, logp)
        assert float(loss) == float(want) and torch.equal(grad, want_grad)
        counted = w > 0
        assert st.clipped_low == int(((r < 1 - lo) & (adv < 0) & counted).sum()) > 0
        assert st.clipped_high == int(((r > 1 + hi) & (adv > 0) & counted).sum()) > 0


def test_policy_loss_kl_and_tis():
    logp = torch.tensor([math.log(0.5), math.log(0.2)], dtype=torch.float64, requires_grad=True)
    old = logp.detach().clone()
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    w = torch.full((2,), 0.5, dtype=torch.float64)
    ref = torch.tensor([math.log(0.25), math.log(0.2)], dtype=torch.float64)
    tis = torch.tensor([2.0, 0.5], dtype=torch.float64)
    loss, st = losses.policy_loss(logp, old, adv, w, eps_low=0.2, eps_high=0.2, tis_weight=tis, ref_logp=ref,
                                  kl_coef=0.1)
    k0 = 0.5 - math.log(0.5) - 1.0
    assert float(loss) == pytest.approx(0.5 * (-1.0 * 2.0 + 0.1 * k0) + 0.5 * (1.0 * 0.5 + 0.0), rel=1e-12)
    assert st.kl_sum == pytest.approx(k0, rel=1e-12)


def test_truncated_is_weight():
    old = torch.tensor([0.0, math.log(2.0), math.log(3.0), math.log(0.5)])
    w = losses.truncated_is_weight(old, torch.zeros(4), cap=2.0)
    assert w.tolist() == pytest.approx([1.0, 2.0, 2.0, 0.5])
    # equal logprobs (invariant mode): exactly 1, bit for bit
    x = torch.randn(100)
    assert torch.equal(losses.truncated_is_weight(x, x.clone(), 2.0), torch.ones(100))


def test_micro_batches_sum_to_the_whole_loss():
    g = torch.Generator().manual_seed(0)
    lengths = [3, 5, 2, 4]
    n = sum(lengths)
    logp = (-torch.rand(n, generator=g, dtype=torch.float64) - 0.1).requires_grad_(True)
    old = logp.detach() + 0.05 * torch.randn(n, generator=g, dtype=torch.float64)
    adv = torch.cat([torch.full((k,), a) for k, a in zip(lengths, [1.0, -0.5, 2.0, -1.0])]).double()
    for mode in losses.LOSS_AGGREGATIONS:
        whole, _ = losses.policy_loss(logp, old, adv, losses.aggregation_weights(lengths, mode, n, 4, 8).double(),
                                      eps_low=0.2, eps_high=0.28)
        parts = 0.0
        for idx in ([0, 1], [2, 3]):
            lo = sum(lengths[:idx[0]])
            hi = lo + sum(lengths[i] for i in idx)
            w = losses.aggregation_weights([lengths[i] for i in idx], mode, n, 4, 8).double()
            part, _ = losses.policy_loss(logp[lo:hi], old[lo:hi], adv[lo:hi], w, eps_low=0.2, eps_high=0.28)
            parts = parts + part
        assert float(parts) == pytest.approx(float(whole), rel=1e-12)


def test_mismatch_stats():
    x = torch.randn(50)
    assert losses.mismatch_stats(x, x.clone()) == {"logprob_diff_max": 0.0, "logprob_diff_mean": 0.0,
                                                   "logprob_diff_std": 0.0, "k3_kl": 0.0}
    s = losses.mismatch_stats(torch.tensor([0.1, -0.2]), torch.tensor([0.0, 0.0]))
    assert s["logprob_diff_max"] == pytest.approx(0.2, rel=1e-6)
    assert s["logprob_diff_mean"] == pytest.approx(0.15, rel=1e-6)
    assert s["logprob_diff_std"] == pytest.approx(0.05, rel=1e-5)
    d = torch.tensor([0.1, -0.2], dtype=torch.float64)
    assert s["k3_kl"] == pytest.approx(float((torch.exp(d) - 1 - d).mean()), rel=1e-5)


def test_an_overflowing_ratio_keeps_the_gradient_finite():
    """A log-ratio past 88 would overflow exp to inf, and the clipped side's unselected
    gradient (0 * inf) would be NaN: the log-ratio is clamped to +-20 first (as verl's)."""
    logp = torch.tensor([100.0, -100.0, 0.1], requires_grad=True)
    old = torch.zeros(3)
    adv = torch.tensor([1.0, -1.0, 1.0])
    loss, _ = losses.policy_loss(logp, old, adv, torch.ones(3), eps_low=0.2, eps_high=0.2)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    # inside the clamp nothing changes: the third token's gradient is -A r
    assert logp.grad[2].item() == pytest.approx(-torch.exp(torch.tensor(0.1)).item())
