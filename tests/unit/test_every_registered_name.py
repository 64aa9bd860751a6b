"""Every registered advantage estimator, policy loss, KL estimator and KL controller runs
through the glue that calls it in a run, on a small batch, without Ray.

Parametrized over each registry's `names()`, so a name registered later is tested too: a name
whose inputs the recipe cannot provide, or whose config is accepted and then fails, fails here.
The batch holds exactly the tensors the PPO step loop has gathered when it calls
`add_advantages`, decided by the recipe's own predicates (reference, critic, greedy baseline).
"""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algos import (
    ADVANTAGE_ESTIMATORS,
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    build_kl_controller,
    compute_policy_loss,
    kl_loss,
    vanishes_at_zero_advantage,
)
from hybridflow.algos.rewards import place_sequence_rewards
from hybridflow.batch import Batch
from hybridflow.config import ConfigError, compose
from hybridflow.config.schema import ActorConfig
from recipes.ppo import add_advantages, kl_controller_args, needs_greedy_baseline

# 2 prompts x 2 samples, 3 response tokens; True = a real response token.
MASK = torch.tensor([[True, True, False], [True, True, True], [True, False, False], [True, True, False]])
SEQUENCE_REWARDS = torch.tensor([1.0, 0.0, 1.0, 1.0])
GREEDY_REWARDS = torch.tensor([0.5, 0.5, 1.0, 1.0])  # each prompt's greedy reward, beside its 2 samples
OLD_LOG_PROBS = torch.tensor([[-1.0, -0.5, 0.0], [-2.0, -0.1, -0.3], [-0.7, 0.0, 0.0], [-1.2, -0.4, 0.0]])
REF_LOG_PROBS = torch.tensor([[-1.1, -0.4, 0.0], [-1.5, -0.2, -0.3], [-0.7, 0.0, 0.0], [-1.0, -0.9, 0.0]])
VALUES = torch.tensor([[0.2, 0.4, 0.0], [0.1, 0.1, 0.3], [0.5, 0.0, 0.0], [0.3, 0.6, 0.0]])

# What an estimator's config needs besides its name (the fix its refusal names).
ESTIMATOR_NEEDS = {"gae": ["algorithm.use_critic=true"]}


def rl_config(*overrides: str):
    return compose(["recipe=grpo", *overrides])


def recipe_batch(config) -> Batch:
    """The tensors the step loop holds when it calls add_advantages, for this config."""
    tensors = {"response_mask": MASK, "sequence_rewards": SEQUENCE_REWARDS, "group_ids": torch.tensor([0, 0, 1, 1]),
               "old_log_probs": OLD_LOG_PROBS}
    if config.needs_reference:
        tensors["ref_log_probs"] = REF_LOG_PROBS
    if config.algorithm.use_critic:
        tensors["values"] = VALUES
    if needs_greedy_baseline(config):
        tensors["baseline_rewards"] = GREEDY_REWARDS
    return Batch(tensors)


def check_advantages(samples: Batch, metrics: dict) -> None:
    for key in ("token_rewards", "advantages", "returns"):
        assert samples[key].shape == MASK.shape, key
        assert torch.isfinite(samples[key]).all(), key
    assert (samples["advantages"][~MASK] == 0).all() and (samples["returns"][~MASK] == 0).all()
    assert metrics and all(math.isfinite(v) for v in metrics.values()), metrics


@pytest.mark.parametrize("kl_penalty_coef", [0.0, 0.05])
@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS.names())
def test_every_advantage_estimator_runs_through_add_advantages(name, kl_penalty_coef):
    config = rl_config(f"algorithm.advantage_estimator={name}", f"algorithm.kl_penalty_coef={kl_penalty_coef}",
                       *ESTIMATOR_NEEDS.get(name, []))
    samples, metrics = add_advantages(recipe_batch(config), config, kl_coef=kl_penalty_coef)
    check_advantages(samples, metrics)
    assert ("kl/penalty_mean" in metrics) == (kl_penalty_coef > 0)


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS.names())
def test_an_estimator_config_is_refused_before_start_or_runs(name):
    """The name alone: the config either names the key to fix, or the glue gives the estimator its inputs."""
    try:
        config = rl_config(f"algorithm.advantage_estimator={name}")
    except ConfigError as exc:
        assert "algorithm." in str(exc) and ": " in str(exc)  # names a key, then the fix
        return
    check_advantages(*add_advantages(recipe_batch(config), config, kl_coef=0.0))


def test_remax_subtracts_each_prompt_greedy_reward_from_its_samples():
    # γ = 1, reward on the last token: G_t = r(y) on every valid token, Â_t = r(y) - r(greedy).
    # rows: 1 - 0.5 = 0.5 (2 tokens), 0 - 0.5 = -0.5 (3 tokens), 1 - 1 = 0 (1 token), 1 - 1 = 0 (2 tokens)
    config = rl_config("algorithm.advantage_estimator=remax")
    samples, metrics = add_advantages(recipe_batch(config), config, kl_coef=0.0)
    expected = torch.tensor([[0.5, 0.5, 0.0], [-0.5, -0.5, -0.5], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(samples["advantages"], expected)
    assert metrics["advantages/baseline_mean"] == pytest.approx(0.75)  # (0.5 + 0.5 + 1 + 1) / 4


@pytest.mark.parametrize("name", KL_ESTIMATORS.names())
def test_every_kl_estimator_runs_as_the_reward_penalty_and_as_the_loss(name):
    config = rl_config(f"algorithm.kl_penalty_estimator={name}", "algorithm.kl_penalty_coef=0.1",
                       f"actor.kl_loss_estimator={name}", "actor.kl_loss_coef=0.01")
    samples, metrics = add_advantages(recipe_batch(config), config, kl_coef=0.1)
    check_advantages(samples, metrics)
    kl = KL_ESTIMATORS.get(name)(log_probs=OLD_LOG_PROBS, ref_log_probs=REF_LOG_PROBS)  # (B, T)
    expected = place_sequence_rewards(SEQUENCE_REWARDS, MASK) - 0.1 * torch.where(MASK, kl, torch.zeros_like(kl))
    torch.testing.assert_close(samples["token_rewards"], expected)  # r_t - β KL_t on response tokens only
    assert metrics["kl/penalty_mean"] == pytest.approx(float((kl * MASK).sum(1).mean()), abs=1e-6)

    log_probs = OLD_LOG_PROBS.clone().requires_grad_(True)  # as the actor passes it: differentiable
    loss, stats = kl_loss(log_probs=log_probs, ref_log_probs=REF_LOG_PROBS, response_mask=MASK,
                          estimator=config.actor.kl_loss_estimator, aggregation=config.actor.loss_aggregation,
                          global_token_count=int(MASK.sum()), global_sequence_count=len(MASK))
    loss.backward()
    assert math.isfinite(stats["kl_loss"]) and torch.isfinite(log_probs.grad).all()


def actor_policy_loss(actor: ActorConfig, log_probs, advantages):
    """The call PolicyObjective.loss makes (hybridflow.training.objectives), with the values of ActorConfig."""
    return compute_policy_loss(
        actor.policy_loss, log_probs=log_probs, old_log_probs=OLD_LOG_PROBS, advantages=advantages,
        response_mask=MASK, clip_ratio_low=actor.clip_ratio_low, clip_ratio_high=actor.clip_ratio_high,
        dual_clip_c=actor.dual_clip_c, aggregation=actor.loss_aggregation,
        global_token_count=int(MASK.sum()), global_sequence_count=int(MASK.any(1).sum()))


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS.names())
@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_every_policy_loss_runs_with_the_arguments_the_actor_passes(name, aggregation):
    actor = ActorConfig(policy_loss=name, loss_aggregation=aggregation, dual_clip_c=3.0)
    advantages = torch.tensor([[0.5, 0.5, 0.0], [-0.5, -0.5, -0.5], [1.0, 0.0, 0.0], [-1.0, -1.0, 0.0]])
    log_probs = (OLD_LOG_PROBS + 0.05).requires_grad_(True)
    loss, stats = actor_policy_loss(actor, log_probs, advantages)
    loss.backward()
    assert loss.shape == () and math.isfinite(float(loss.detach()))
    assert torch.isfinite(log_probs.grad).all() and (log_probs.grad[~MASK] == 0).all()
    assert log_probs.grad[MASK].abs().sum() > 0
    assert all(math.isfinite(v) for v in stats.values()), stats


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_every_policy_loss_is_the_policy_gradient_at_the_old_policy(name):
    # At π = π_old every ratio is 1, inside any clip range: with token-mean over N = 8 valid
    # tokens, L = -(1/N) Σ Â_t ρ_t and ∂L/∂log π_t = -Â_t / N (ρ_t = exp(log π_t - log π_old,t)).
    advantages = torch.tensor([[0.5, 0.5, 0.0], [-0.5, -0.5, -0.5], [1.0, 0.0, 0.0], [-1.0, -1.0, 0.0]])
    log_probs = OLD_LOG_PROBS.clone().requires_grad_(True)
    loss, _ = actor_policy_loss(ActorConfig(policy_loss=name), log_probs, advantages)
    loss.backward()
    torch.testing.assert_close(log_probs.grad, torch.where(MASK, -advantages / 8, torch.zeros(())))


@pytest.mark.parametrize("name", [n for n in POLICY_LOSSES.names() if vanishes_at_zero_advantage(n)])
def test_a_loss_that_declares_it_has_no_gradient_at_zero_advantage(name):
    """The actor leaves zero-advantage samples out of the update for these losses: it must change nothing."""
    log_probs = (OLD_LOG_PROBS + 0.3).requires_grad_(True)
    loss, _ = actor_policy_loss(ActorConfig(policy_loss=name), log_probs, torch.zeros_like(OLD_LOG_PROBS))
    loss.backward()
    assert float(loss.detach()) == 0.0 and (log_probs.grad == 0).all()


# What one update with KL = 1 per sequence (target 0.1) over 8 samples gives, from β = 0.1.
# adaptive: e = clip(1 / 0.1 - 1, ±0.2) = 0.2, β = 0.1 (1 + 0.2 · 8 / 10000) = 0.100016.
COEF_AFTER_UPDATE = {"fixed": 0.1, "adaptive": 0.1 * (1 + 0.2 * 8 / 10000)}


@pytest.mark.parametrize("name", KL_CONTROLLERS.names())
def test_every_kl_controller_builds_from_the_recipe_arguments_and_updates(name):
    config = rl_config(f"algorithm.kl_controller={name}", "algorithm.kl_penalty_coef=0.1")
    controller = build_kl_controller(config.algorithm.kl_controller, **kl_controller_args(config))
    assert controller.coef == pytest.approx(0.1)
    controller.update(1.0, n_steps=8)
    assert math.isfinite(controller.coef) and controller.coef >= 0
    if name in COEF_AFTER_UPDATE:
        assert controller.coef == pytest.approx(COEF_AFTER_UPDATE[name], rel=1e-9)


@pytest.mark.parametrize("name", KL_CONTROLLERS.names())
def test_a_kl_controller_with_the_default_coefficient_is_refused_before_start_or_builds(name):
    try:
        config = rl_config(f"algorithm.kl_controller={name}")
    except ConfigError as exc:
        assert "algorithm.kl_penalty_coef" in str(exc)
        return
    controller = build_kl_controller(config.algorithm.kl_controller, **kl_controller_args(config))
    controller.update(0.0, n_steps=8)
    assert math.isfinite(controller.coef)
