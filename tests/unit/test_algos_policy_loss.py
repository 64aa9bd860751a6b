"""PPO-clip (clip-higher, dual clip) and GSPO against hand-worked values, loops and invariances."""

import math

import pytest
import torch

from hybridflow.algos.policy_loss import POLICY_LOSSES, compute_policy_loss

LN = math.log


def _loss(name, log_probs, old_log_probs, advantages, mask, **kw):
    return compute_policy_loss(name, log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages,
                               response_mask=mask, **kw)


def test_ppo_clip_higher_by_hand():
    # low = 0.2, high = 0.28: ratio clipped to [0.8, 1.28]
    # a: ρ 1.5, Â +1: max(-1.5, -1.28) = -1.28  clipped (grad 0)
    # b: ρ 0.5, Â +1: max(-0.5, -0.8)  = -0.5   not clipped (grad -Âρ = -0.5)
    # c: ρ 0.5, Â -1: max( 0.5,  0.8)  =  0.8   clipped (grad 0)
    # d: ρ 1.1, Â +2: max(-2.2, -2.2)  = -2.2   inside (grad -2.2)
    # token-mean: (-1.28 - 0.5 + 0.8 - 2.2) / 4 = -0.795 ; gradients / 4 ; e: padding
    old = torch.zeros(1, 5)
    log_probs = torch.tensor([[LN(1.5), LN(0.5), LN(0.5), LN(1.1), 3.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, -1.0, 2.0, 5.0]])
    mask = torch.tensor([[True, True, True, True, False]])
    loss, stats = _loss("ppo_clip", log_probs, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    loss.backward()
    assert loss.item() == pytest.approx(-0.795, abs=1e-6)
    torch.testing.assert_close(log_probs.grad, torch.tensor([[0.0, -0.125, 0.0, -0.55, 0.0]]))
    assert stats["clip_fraction"] == pytest.approx(0.5)
    assert stats["dual_clip_fraction"] == 0.0


def test_dual_clip_by_hand():
    # c = 3, clip [0.8, 1.2]
    # a: ρ 5, Â -1: max(5, 1.2) = 5 > -cÂ = 3 -> 3 (dual clipped, grad 0)
    # b: ρ 2, Â -1: max(2, 1.2) = 2 <= 3     -> 2 (grad -Âρ = 2)
    # c: ρ 5, Â +1: max(-5, -1.2) = -1.2      (dual clip is only for Â < 0)
    # token-mean: (3 + 2 - 1.2) / 3 = 1.266667 ; without dual clip: (5 + 2 - 1.2) / 3 = 1.933333
    old = torch.zeros(1, 3)
    log_probs = torch.tensor([[LN(5.0), LN(2.0), LN(5.0)]], requires_grad=True)
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, stats = _loss("ppo_clip", log_probs, old, adv, mask, dual_clip_c=3.0)
    loss.backward()
    assert loss.item() == pytest.approx(3.8 / 3, rel=1e-6)
    torch.testing.assert_close(log_probs.grad, torch.tensor([[0.0, 2.0 / 3, 0.0]]))
    assert stats["dual_clip_fraction"] == pytest.approx(1 / 3)
    no_dual, _ = _loss("ppo_clip", log_probs, old, adv, mask)
    assert no_dual.item() == pytest.approx(5.8 / 3, rel=1e-6)


def test_on_policy_loss_is_minus_mean_advantage_and_approx_kl_by_hand():
    adv = torch.tensor([[1.0, -3.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    same = torch.tensor([[-1.0, -2.0]])
    loss, stats = _loss("ppo_clip", same, same, adv, mask)
    assert loss.item() == pytest.approx(1.0) and stats["approx_kl"] == 0.0  # -(1 - 3) / 2
    # ratios 2 and 1/2: (ρ - 1) - ln ρ = (1 - 0.693147) + (-0.5 + 0.693147) = 0.5 -> mean 0.25
    _, stats = _loss("ppo_clip", torch.tensor([[LN(2.0), LN(0.5)]]), torch.zeros(1, 2), adv, mask)
    assert stats["approx_kl"] == pytest.approx(0.25)


def _ppo_loop(log_probs, old, adv, mask, low, high, c):
    total, count = 0.0, 0
    for b in range(log_probs.shape[0]):
        for t in range(log_probs.shape[1]):
            if not mask[b, t]:
                continue
            ratio = math.exp(log_probs[b, t].item() - old[b, t].item())
            a = adv[b, t].item()
            loss = max(-a * ratio, -a * min(max(ratio, 1 - low), 1 + high))
            if c is not None and a < 0:
                loss = min(loss, -a * c)
            total, count = total + loss, count + 1
    return total / count


def test_ppo_clip_matches_loop():
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(6, 9, generator=gen) * 3
    log_probs = old + torch.randn(6, 9, generator=gen) * 0.5
    adv = torch.randn(6, 9, generator=gen)
    mask = torch.arange(9) < torch.randint(1, 10, (6, 1), generator=gen)
    loss, _ = _loss("ppo_clip", log_probs, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, dual_clip_c=2.0)
    assert loss.item() == pytest.approx(_ppo_loop(log_probs, old, adv, mask, 0.2, 0.28, 2.0), rel=1e-5)


def test_gspo_by_hand():
    # seq 0: log ρ = (0.2, 0.4) -> s = e^0.3 = 1.349859, Â = +1, clip 1.2 -> loss -1.2 per token, grad 0
    # seq 1: log ρ = (0.05, -0.01, 0.02) -> s = e^0.02 = 1.020201, Â = -0.5 -> loss 0.510101 per token
    # seq-mean-token-mean: (-1.2 + 0.510101) / 2 = -0.344950
    # grad of seq 1 token t: -Â s ∂(log π_t) / (3 tokens * 2 sequences) = 0.5 * 1.020201 / 6 = 0.085017
    old = torch.zeros(2, 3)
    log_probs = torch.tensor([[0.2, 0.4, 7.0], [0.05, -0.01, 0.02]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, -0.5]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    loss, stats = _loss("gspo", log_probs, old, adv, mask, aggregation="seq-mean-token-mean")
    loss.backward()
    assert loss.item() == pytest.approx(-0.344950, abs=1e-6)
    torch.testing.assert_close(log_probs.grad, torch.tensor([[0.0, 0.0, 0.0], [0.085017, 0.085017, 0.085017]]))
    assert stats["clip_fraction"] == pytest.approx(0.4)  # 2 of 5 tokens


def test_gspo_token_form_with_per_token_advantages_by_hand():
    # log ρ = (0.1, -0.1) -> s = e^0 = 1 for both tokens; Â = (+1, -1); token-mean over 2 tokens
    # loss = (-1 * 1 + 1 * 1) / 2 = 0 ; GSPO-token gradient of token t: -Â_t s / 2 = (-0.5, +0.5)
    # (differentiating exp(mean log ρ) directly would give each token (Σ_k -Â_k) s / 2 / 2 = 0)
    log_probs = torch.tensor([[0.1, -0.1]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0]])
    loss, _ = _loss("gspo", log_probs, torch.zeros(1, 2), adv, torch.ones(1, 2, dtype=torch.bool))
    loss.backward()
    assert loss.item() == pytest.approx(0.0, abs=1e-7)
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-0.5, 0.5]]))


def test_gspo_gradient_equals_sequence_level_objective():
    # unclipped, GSPO-token with seq-mean-token-mean must equal ∇ of (1/N) Σ_i -Â_i exp(mean_t log ρ_it)
    gen = torch.Generator().manual_seed(1)
    old = -torch.rand(4, 6, generator=gen) * 2
    mask = torch.arange(6) < torch.tensor([[6], [3], [1], [5]])
    adv = torch.randn(4, 1, generator=gen).expand(4, 6)
    start = old + torch.randn(4, 6, generator=gen) * 0.1
    token_form = start.clone().requires_grad_(True)
    loss, _ = _loss("gspo", token_form, old, adv, mask, clip_ratio_low=0.99, clip_ratio_high=100.0,
                    aggregation="seq-mean-token-mean")
    loss.backward()
    sequence_form = start.clone().requires_grad_(True)
    log_s = torch.where(mask, sequence_form - old, 0.0).sum(-1) / mask.sum(-1)
    (-(adv[:, 0] * log_s.exp())).mean().backward()
    torch.testing.assert_close(token_form.grad, sequence_form.grad)
    assert loss.item() == pytest.approx((-(adv[:, 0] * log_s.exp())).mean().item(), rel=1e-5)


@pytest.mark.parametrize("name", ["ppo_clip", "gspo"])
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_four_micro_batches_give_the_same_gradients(name, aggregation):
    gen = torch.Generator().manual_seed(2)
    old = -torch.rand(8, 7, generator=gen) * 3
    start = old + torch.randn(8, 7, generator=gen) * 0.3
    adv = torch.randn(8, 7, generator=gen)
    mask = torch.arange(7) < torch.randint(0, 8, (8, 1), generator=gen)
    mask[0] = True
    counts = dict(global_token_count=int(mask.sum()), global_sequence_count=int(mask.any(-1).sum()))
    kw = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, dual_clip_c=3.0, aggregation=aggregation)

    full = start.clone().requires_grad_(True)
    loss, _ = _loss(name, full, old, adv, mask, **kw)
    loss.backward()
    micro = start.clone().requires_grad_(True)
    total = 0.0
    for idx in torch.arange(8).chunk(4):
        part, _ = _loss(name, micro[idx], old[idx], adv[idx], mask[idx], **kw, **counts)
        part.backward()
        total += part.item()
    assert total == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(micro.grad, full.grad)
    assert full.grad.abs().sum() > 0


def test_errors_name_the_argument():
    x, mask = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="clip_ratio_low=1.0"):
        _loss("ppo_clip", x, x, x, mask, clip_ratio_low=1.0)
    with pytest.raises(ValueError, match="dual_clip_c=0.5"):
        _loss("ppo_clip", x, x, x, mask, dual_clip_c=0.5)
    with pytest.raises(ValueError, match="advantages has shape"):
        _loss("gspo", x, x, torch.zeros(1, 3), mask)
    with pytest.raises(KeyError, match="gspo, ppo_clip"):
        POLICY_LOSSES.get("ppo")
