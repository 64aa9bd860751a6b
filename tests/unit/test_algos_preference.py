"""Preference losses (hybridflow/algos/preference.py) against numbers worked out by hand from the
papers' formulas, in the form TRL's DPOTrainer / CPOTrainer compute them."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algos.preference import LENGTH_NORMALISED, PREFERENCE_LOSSES, compute_preference_loss

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
    # IPO: (h - 1 / (2 beta))^2 = (1 - 5)^2 and (-0.5 - 5)^2
    ("ipo", {"beta": 0.1}, (16 + 30.25) / 2),
    # SimPO, beta 2, gamma 0.5: 2 x (-1 + 3) - 0.5 = 3.5 and 2 x (-2 + 1.5) - 0.5 = -1.5
    ("simpo", {"beta": 2.0, "simpo_gamma": 0.5}, (softplus(-3.5) + softplus(1.5)) / 2),
])
def test_losses_equal_the_papers_formulas_by_hand(name, kwargs, expected):
    loss, stats = compute_preference_loss(name, **PAIRS, **kwargs)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert stats["preference_loss"].item() == pytest.approx(expected, rel=1e-6)


def test_rewards_margins_and_accuracies_are_the_implicit_rewards():
    """chosen rewards beta (log pi_c - log ref_c) = 0.05, 0.0; rejected 0.05 x -1, 0.05: the first pair
    ranks right, the second not."""
    _, stats = compute_preference_loss("sigmoid", **PAIRS, beta=0.1)
    assert stats["chosen_reward"].item() == pytest.approx(0.025)
    assert stats["rejected_reward"].item() == pytest.approx(0.0, abs=1e-7)
    assert stats["reward_margin"].item() == pytest.approx(0.025)
    assert stats["reward_accuracy"].item() == 0.5


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
