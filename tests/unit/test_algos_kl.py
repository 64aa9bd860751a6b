"""KL estimators, KL penalty / loss, and KL controllers against hand-worked values."""

import math

import pytest
import torch

from hybridflow.algos.kl import (
    K3_MAX,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    build_kl_controller,
    kl_loss,
)

LN2 = math.log(2.0)


def _kl(name, log_probs, ref_log_probs):
    return KL_ESTIMATORS.get(name)(log_probs=torch.tensor(log_probs), ref_log_probs=torch.tensor(ref_log_probs))


def test_estimators_by_hand():
    # token 0: π = 1/2, π_ref = 1/4 -> log π - log π_ref = ln 2 ; token 1: the reverse, -ln 2
    log_probs = [[math.log(0.5), math.log(0.25)]]
    ref_log_probs = [[math.log(0.25), math.log(0.5)]]
    # k1 = ±ln 2 = ±0.693147
    torch.testing.assert_close(_kl("k1", log_probs, ref_log_probs), torch.tensor([[LN2, -LN2]]))
    # k2 = ½ (ln 2)² = 0.240227 for both
    torch.testing.assert_close(_kl("k2", log_probs, ref_log_probs), torch.tensor([[0.240227, 0.240227]]))
    # k3 with r = log π_ref - log π: token 0 r = -ln 2 -> 1/2 + ln 2 - 1 = 0.193147 ;
    #                               token 1 r = +ln 2 -> 2 - ln 2 - 1 = 0.306853
    torch.testing.assert_close(_kl("k3", log_probs, ref_log_probs), torch.tensor([[0.193147, 0.306853]]))


def test_k3_is_clamped_and_finite():
    # r = -100 -> clamped to -20 -> e^-20 + 20 - 1 ≈ 19 -> capped at 10 ; r = +100 -> e^20 - 21 -> capped at 10
    out = _kl("k3", [[0.0, -100.0]], [[-100.0, 0.0]])
    torch.testing.assert_close(out, torch.tensor([[K3_MAX, K3_MAX]]))


def test_k1_and_k3_are_unbiased_k2_is_not():
    # KL(p || q) on 3 outcomes, estimated from samples of p; true value by the sum Σ p ln(p/q)
    p, q = torch.tensor([0.6, 0.3, 0.1]), torch.tensor([0.2, 0.5, 0.3])
    true_kl = float((p * (p / q).log()).sum())  # 0.384... nats
    samples = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    log_p, log_q = p.log()[samples], q.log()[samples]
    estimates = {name: KL_ESTIMATORS.get(name)(log_probs=log_p, ref_log_probs=log_q).mean().item() for name in ("k1", "k2", "k3")}
    assert estimates["k1"] == pytest.approx(true_kl, abs=0.01)
    assert estimates["k3"] == pytest.approx(true_kl, abs=0.01)
    assert abs(estimates["k2"] - true_kl) > 0.02


def test_estimators_match_loop():
    gen = torch.Generator().manual_seed(1)
    log_probs, ref_log_probs = -torch.rand(3, 4, generator=gen) * 4, -torch.rand(3, 4, generator=gen) * 4
    outs = {n: KL_ESTIMATORS.get(n)(log_probs=log_probs, ref_log_probs=ref_log_probs) for n in ("k1", "k2", "k3")}
    for b in range(3):
        for t in range(4):
            d = log_probs[b, t].item() - ref_log_probs[b, t].item()
            assert outs["k1"][b, t].item() == pytest.approx(d, abs=1e-6)
            assert outs["k2"][b, t].item() == pytest.approx(0.5 * d * d, abs=1e-6)
            assert outs["k3"][b, t].item() == pytest.approx(math.exp(-d) + d - 1, abs=1e-5)


def test_apply_kl_penalty_by_hand():
    token_rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    diff = torch.tensor([[0.1, 0.2, -0.1], [0.3, 0.0, 5.0]])  # log π - log π_ref; 5.0 is on padding
    ref_log_probs = torch.full((2, 3), -1.0)
    log_probs = (ref_log_probs + diff).requires_grad_(True)
    new, stats = apply_kl_penalty(
        token_rewards=token_rewards, log_probs=log_probs, ref_log_probs=ref_log_probs, response_mask=mask, kl_coef=0.5
    )
    # r - 0.5 k1: [[0 - .05, 0 - .1, 1 + .05], [0 - .15, 2 - 0, 0 (padding untouched)]]
    torch.testing.assert_close(new, torch.tensor([[-0.05, -0.1, 1.05], [-0.15, 2.0, 0.0]]))
    assert not new.requires_grad  # a reward, not a loss
    assert stats["kl"] == pytest.approx(0.1)  # (.1 + .2 - .1 + .3 + 0) / 5 tokens
    assert stats["kl_per_sequence"] == pytest.approx(0.25)  # (0.2 + 0.3) / 2 sequences
    assert stats["kl_coef"] == 0.5


def test_kl_loss_value_and_gradient_by_hand():
    # one token, π = 1/2, π_ref = 1/4: k3 = 0.193147 ; d k3 / d log π = 1 - e^(log π_ref - log π) = 1 - 1/2
    log_probs = torch.tensor([[math.log(0.5), 0.0]], requires_grad=True)
    ref_log_probs = torch.tensor([[math.log(0.25), 0.0]])
    mask = torch.tensor([[True, False]])
    loss, stats = kl_loss(log_probs=log_probs, ref_log_probs=ref_log_probs, response_mask=mask)
    loss.backward()
    assert loss.item() == pytest.approx(0.193147, abs=1e-6)
    assert stats["kl_loss"] == pytest.approx(0.193147, abs=1e-6)
    torch.testing.assert_close(log_probs.grad, torch.tensor([[0.5, 0.0]]))


def test_fixed_controller():
    controller = build_kl_controller("fixed", coef=0.05)
    controller.update(current_kl=100.0, n_steps=1000)
    assert isinstance(controller, FixedKLController) and controller.coef == 0.05


def test_adaptive_controller_by_hand():
    controller = build_kl_controller("adaptive", init_coef=0.1, target_kl=6.0, horizon=10_000)
    assert isinstance(controller, AdaptiveKLController)
    # KL 9 vs target 6: error 9/6 - 1 = 0.5, clipped to 0.2 -> β = 0.1 (1 + 0.2 * 256 / 10000) = 0.100512
    controller.update(current_kl=9.0, n_steps=256)
    assert controller.coef == pytest.approx(0.100512)
    # KL 5.4: error -0.1 -> β = 0.100512 (1 - 0.1 * 1000 / 10000) = 0.100512 * 0.99 = 0.09950688
    controller.update(current_kl=5.4, n_steps=1000)
    assert controller.coef == pytest.approx(0.09950688)


def test_controller_errors():
    with pytest.raises(KeyError, match="adaptive, fixed"):
        build_kl_controller("pid", coef=0.1)
    with pytest.raises(TypeError, match="target_kl"):
        build_kl_controller("adaptive", coef=0.1)
    with pytest.raises(ValueError, match="horizon=0"):
        AdaptiveKLController(init_coef=0.1, target_kl=6.0, horizon=0)
    with pytest.raises(KeyError, match="k1, k2, k3"):
        KL_ESTIMATORS.get("k4")
