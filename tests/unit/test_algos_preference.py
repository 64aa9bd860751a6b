"""Preference losses (hybridflow/algos/preference.py) against numbers worked out by hand from the
papers' formulas, in the form TRL's DPOTrainer / CPOTrainer compute them; their statistics under
TRL's names; each loss's default beta is its paper's (the schema's table)."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from hybridflow.algos.preference import LENGTH_NORMALISED, PREFERENCE_LOSSES, compute_preference_loss
from hybridflow.config.dpo import PREFERENCE_LOSS_BETAS, DPOConfig

# two pairs: h = (log pi_c - log ref_c) - (log pi_r - log ref_r) = 1.0 and -0.5
PAIRS = dict(chosen_log_probs=torch.tensor([-1.0, -2.0]), rejected_log_probs=torch.tensor([-3.0, -1.5]),
             ref_chosen_log_probs=torch.tensor([-1.5, -2.0]), ref_rejected_log_probs=torch.tensor([-2.5, -2.0]))


def softplus(x: float) -> float:  # -log sigmoid(-x)
    return math.log1p(math.exp(x))


@pytest.mark.parametrize("name, kwargs, expected", [
    # beta h = 0.1 and -0.05: -log sigmoid(0.1) = 0.644397, -log sigmoid(-0.05) = 0.718440
    ("sigmoid", {"beta": 0.1}, (softplus(-0.1) + softplus(0.05)) / 2),
    # cDPO, eps 0.1: 0.9 x 0.644397 + 0.1 x 0.744397 and 0.9 x 0.718440 + 0.1 x 0.668440
    ("sigmoid", {"beta": 0.1, "label_smoothing": 0.1},
     (0.9 * softplus(-0.1) + 0.1 * softplus(0.1) + 0.9 * softplus(0.05) + 0.1 * softplus(-0.05)) / 2),
    # robust: (0.9 x 0.644397 - 0.1 x 0.744397) / 0.8 and the same for the second pair
    ("robust", {"beta": 0.1, "label_smoothing": 0.1},
     ((0.9 * softplus(-0.1) - 0.1 * softplus(0.1)) + (0.9 * softplus(0.05) - 0.1 * softplus(-0.05))) / 0.8 / 2),
    # hinge (SLiC, TRL's): relu(1 - beta h) = relu(1 - 0.1) = 0.9 and relu(1 + 0.05) = 1.05
    ("hinge", {"beta": 0.1}, (0.9 + 1.05) / 2),
    # hinge, beta 2: relu(1 - 2) = 0 (the pair past the margin 1/beta adds nothing) and relu(1 + 1) = 2
    ("hinge", {"beta": 2.0}, (0.0 + 2.0) / 2),
    # IPO: (h - 1 / (2 beta))^2 = (1 - 5)^2 and (-0.5 - 5)^2
    ("ipo", {"beta": 0.1}, (16 + 30.25) / 2),
    # SimPO, beta 2, gamma 0.5: 2 x (-1 + 3) - 0.5 = 3.5 and 2 x (-2 + 1.5) - 0.5 = -1.5
    ("simpo", {"beta": 2.0, "simpo_gamma": 0.5}, (softplus(-3.5) + softplus(1.5)) / 2),
])
def test_losses_equal_the_papers_formulas_by_hand(name, kwargs, expected):
    loss, _ = compute_preference_loss(name, **PAIRS, **kwargs)
    assert loss.item() == pytest.approx(expected, rel=1e-6)


# reference-free (TRL's reference_free=True): the reference log-probs given as 0, so h is the policy's
# own log-ratio difference: (-1 - -3) = 2 and (-2 - -1.5) = -0.5
FREE = {**PAIRS, "ref_chosen_log_probs": torch.zeros(2), "ref_rejected_log_probs": torch.zeros(2)}


@pytest.mark.parametrize("name, expected", [
    # beta h = 0.2 and -0.05
    ("sigmoid", (softplus(-0.2) + softplus(0.05)) / 2),
    # relu(1 - 0.2) = 0.8 and relu(1 + 0.05) = 1.05
    ("hinge", (0.8 + 1.05) / 2),
    # (2 - 5)^2 = 9 and (-0.5 - 5)^2 = 30.25
    ("ipo", (9 + 30.25) / 2),
])
def test_reference_free_losses_take_the_reference_log_ratio_as_zero_by_hand(name, expected):
    loss, stats = compute_preference_loss(name, **FREE, beta=0.1)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    # the implicit rewards are then beta x log pi: 0.1 x (-1, -2) and 0.1 x (-3, -1.5)
    assert stats["rewards/chosen"].item() == pytest.approx(-0.15)
    assert stats["rewards/rejected"].item() == pytest.approx(-0.225)
    assert DPOConfig(reference_free=True).needs_reference is False


def test_rewards_margins_accuracies_and_logps_carry_trls_names():
    """chosen rewards beta (log pi_c - log ref_c) = 0.05, 0.0; rejected 0.05 x -1, 0.05: the first pair
    ranks right, the second not. logps: the policy's mean log-probs, (-1 - 2) / 2 and (-3 - 1.5) / 2."""
    for name in ("sigmoid", "robust", "hinge", "ipo"):
        _, stats = compute_preference_loss(name, **PAIRS, beta=0.1)
        assert set(stats) == {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                              "logps/chosen", "logps/rejected"}
        assert stats["rewards/chosen"].item() == pytest.approx(0.025)
        assert stats["rewards/rejected"].item() == pytest.approx(0.0, abs=1e-7)
        assert stats["rewards/margins"].item() == pytest.approx(0.025)
        assert stats["rewards/accuracies"].item() == 0.5
        assert stats["logps/chosen"].item() == -1.5 and stats["logps/rejected"].item() == -2.25


def test_each_losss_default_beta_is_its_papers_and_the_schemas():
    """SimPO's paper runs beta 2.0-2.5 (the low end here), DPO's and the rest 0.1: the schema's table,
    which an unset dpo.beta reads, equals each function's own default."""
    assert set(PREFERENCE_LOSS_BETAS) == set(PREFERENCE_LOSSES.names())
    for name in PREFERENCE_LOSSES.names():
        assert inspect.signature(PREFERENCE_LOSSES.get(name)).parameters["beta"].default == PREFERENCE_LOSS_BETAS[name]
        assert DPOConfig(loss=name).beta_in_use == PREFERENCE_LOSS_BETAS[name]
    assert PREFERENCE_LOSS_BETAS["simpo"] == 2.0 and PREFERENCE_LOSS_BETAS["sigmoid"] == 0.1
    assert DPOConfig(loss="simpo", beta=2.5).beta_in_use == 2.5
    assert "beta=2.0 (the loss's own default" in DPOConfig(loss="simpo").beta_line()
    assert DPOConfig(loss="simpo", beta=2.5).beta_line().endswith("runs with beta=2.5 (dpo.beta)")
    with pytest.raises(ValueError, match=r"dpo.beta=0.0 is invalid: must be > 0, or null"):
        DPOConfig(beta=0.0)
    with pytest.raises(ValueError, match=r"dpo.reference_free=True is invalid: dpo.loss=simpo is reference-free"):
        DPOConfig(loss="simpo", reference_free=True)


def test_the_gradient_raises_the_chosen_and_lowers_the_rejected_and_not_the_reference():
    for name in PREFERENCE_LOSSES.names():
        chosen = PAIRS["chosen_log_probs"].clone().requires_grad_()
        rejected = PAIRS["rejected_log_probs"].clone().requires_grad_()
        reference = PAIRS["ref_chosen_log_probs"].clone().requires_grad_()
        loss, _ = compute_preference_loss(name, chosen_log_probs=chosen, rejected_log_probs=rejected,
                                          ref_chosen_log_probs=reference,
                                          ref_rejected_log_probs=PAIRS["ref_rejected_log_probs"])
        loss.backward()
        assert (chosen.grad < 0).all() and (rejected.grad > 0).all(), name  # descent raises chosen, lowers rejected
        assert reference.grad is None or not reference.grad.any(), name


def test_bad_settings_and_shapes_are_refused_naming_them():
    with pytest.raises(ValueError, match="beta=0 must be > 0"):
        compute_preference_loss("sigmoid", **PAIRS, beta=0)
    with pytest.raises(ValueError, match=r"label_smoothing=0.5 must be in \[0, 0.5\)"):
        compute_preference_loss("robust", **PAIRS, label_smoothing=0.5)
    with pytest.raises(ValueError, match="four \\(B,\\) tensors"):
        compute_preference_loss("sigmoid", **{**PAIRS, "chosen_log_probs": torch.zeros(2, 3)})
    assert LENGTH_NORMALISED == {"ipo", "simpo"}


def test_the_vectorised_losses_equal_a_loop_over_pairs():
    generator = torch.Generator().manual_seed(0)
    for name in PREFERENCE_LOSSES.names():
        for pairs in (1, 5, 16):
            inputs = {k: -5 * torch.rand(pairs, generator=generator, dtype=torch.float64) for k in PAIRS}
            loss, _ = compute_preference_loss(name, **inputs, beta=0.3)
            each = [compute_preference_loss(name, **{k: v[i : i + 1] for k, v in inputs.items()}, beta=0.3)[0]
                    for i in range(pairs)]
            assert loss.item() == pytest.approx(torch.stack(each).mean().item(), rel=1e-12), name
