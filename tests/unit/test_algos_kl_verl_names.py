"""verl's KL penalty names (`kl`, `abs`, `mse`, `low_var_kl`) beside k1/k2/k3, by hand."""

import math

import pytest
import torch

from hybridflow.algos.kl import KL_ESTIMATORS, apply_kl_penalty
from hybridflow.config.schema import ActorConfig, AlgorithmConfig

LN2 = math.log(2.0)


def _kl(name, log_probs, ref_log_probs):
    return KL_ESTIMATORS.get(name)(log_probs=torch.tensor(log_probs), ref_log_probs=torch.tensor(ref_log_probs))


def test_abs_by_hand():
    # token 0: π = 1/2, π_ref = 1/4 -> log π - log π_ref = +ln 2 ; token 1: π = 1/4, π_ref = 1/2 -> -ln 2 ;
    # token 2: π = π_ref -> 0. abs = |difference| = ln 2, ln 2, 0 (= 0.693147, 0.693147, 0)
    log_probs = [[math.log(0.5), math.log(0.25), math.log(0.3)]]
    ref_log_probs = [[math.log(0.25), math.log(0.5), math.log(0.3)]]
    torch.testing.assert_close(_kl("abs", log_probs, ref_log_probs), torch.tensor([[LN2, LN2, 0.0]]))


@pytest.mark.parametrize("verl_name, ours", [("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")])
def test_verl_names_are_the_same_estimators(verl_name, ours):
    gen = torch.Generator().manual_seed(0)
    log_probs, ref_log_probs = -torch.rand(3, 5, generator=gen) * 4, -torch.rand(3, 5, generator=gen) * 4
    same = KL_ESTIMATORS.get(verl_name)(log_probs=log_probs, ref_log_probs=ref_log_probs)
    torch.testing.assert_close(same, KL_ESTIMATORS.get(ours)(log_probs=log_probs, ref_log_probs=ref_log_probs))


def test_abs_as_a_reward_penalty_by_hand():
    # rewards [0, 1] on two response tokens, |log ratio| = ln 2 each, β = 0.5 -> [-0.346574, 0.653426]
    out, stats = apply_kl_penalty(
        token_rewards=torch.tensor([[0.0, 1.0]]), log_probs=torch.tensor([[math.log(0.5), math.log(0.25)]]),
        ref_log_probs=torch.tensor([[math.log(0.25), math.log(0.5)]]), response_mask=torch.tensor([[True, True]]),
        kl_coef=0.5, estimator="abs")
    torch.testing.assert_close(out, torch.tensor([[-0.5 * LN2, 1 - 0.5 * LN2]]))
    assert stats["kl_per_sequence"] == pytest.approx(2 * LN2)


@pytest.mark.parametrize("name", ["kl", "abs", "mse", "low_var_kl"])
def test_config_accepts_verl_names(name):
    assert AlgorithmConfig(kl_penalty_estimator=name).kl_penalty_estimator == name
    assert ActorConfig(kl_loss_estimator=name).kl_loss_estimator == name
