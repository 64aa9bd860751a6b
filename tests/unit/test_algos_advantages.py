"""Advantage estimators against hand-worked examples and slow per-sample loops."""

import math

import pytest
import torch

from hybridflow.algos.advantages import ADVANTAGE_ESTIMATORS, compute_advantages, discounted_returns, gae_advantages

T_, F_ = True, False


def _ragged(B, T, seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    mask = torch.arange(T) < lengths.unsqueeze(-1)
    mask &= torch.rand(B, T, generator=gen) > 0.15  # holes inside responses (multi-turn tool output)
    mask[:, 0] = True
    rewards = torch.randn(B, T, generator=gen)
    values = torch.randn(B, T, generator=gen)
    return rewards, values, mask


# ---------------------------------------------------------------- GAE


def test_gae_by_hand():
    # γ = 0.9, λ = 0.8 (γλ = 0.72), r = (0, 0, 1), V = (0.5, 0.6, 0.7), V after the end = 0
    # t=2: δ = 1 + 0.9*0 - 0.7 = 0.3                     Â = 0.3
    # t=1: δ = 0 + 0.9*0.7 - 0.6 = 0.03                  Â = 0.03 + 0.72*0.3   = 0.246
    # t=0: δ = 0 + 0.9*0.6 - 0.5 = 0.04                  Â = 0.04 + 0.72*0.246 = 0.21712
    # returns = Â + V = (0.71712, 0.846, 1.0)
    # whitened: mean 0.254373, unbiased std 0.042070 -> (-0.885515, -0.199035, 1.084550)
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 123.0]])  # 123 on padding must be ignored
    mask = torch.tensor([[T_, T_, T_, F_]])
    raw = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(raw, torch.tensor([[0.21712, 0.246, 0.3, 0.0]]))
    adv, ret, stats = compute_advantages("gae", token_rewards=rewards, response_mask=mask, values=values,
                                         gamma=0.9, lam=0.8, eps=0.0)
    torch.testing.assert_close(ret, torch.tensor([[0.71712, 0.846, 1.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[-0.885515, -0.199035, 1.084550, 0.0]]), atol=1e-4, rtol=0)
    assert stats["advantage_mean"] == pytest.approx(0.0, abs=1e-5)


def test_gae_skips_masked_tokens_inside_a_response():
    # mask (T, F, T): token 1 (tool output) is skipped, token 0 links to token 2
    # t=2: Â = 1 - 0.7 = 0.3 ; t=0: δ = 0 + 0.9*0.7 - 0.5 = 0.13, Â = 0.13 + 0.72*0.3 = 0.346
    rewards = torch.tensor([[0.0, 5.0, 1.0]])
    values = torch.tensor([[0.5, 9.0, 0.7]])
    mask = torch.tensor([[T_, F_, T_]])
    torch.testing.assert_close(gae_advantages(rewards, values, mask, 0.9, 0.8), torch.tensor([[0.346, 0.0, 0.3]]))


def _gae_loop(rewards, values, mask, gamma, lam):
    out = [[0.0] * rewards.shape[1] for _ in range(rewards.shape[0])]
    for b in range(rewards.shape[0]):
        idx = [t for t in range(rewards.shape[1]) if mask[b, t]]
        next_value, next_adv = 0.0, 0.0
        for t in reversed(idx):
            delta = rewards[b, t].item() + gamma * next_value - values[b, t].item()
            next_adv = delta + gamma * lam * next_adv
            next_value = values[b, t].item()
            out[b][t] = next_adv
    return torch.tensor(out)


def test_gae_matches_loop():
    rewards, values, mask = _ragged(5, 8, seed=0)
    expected = _gae_loop(rewards, values, mask, 0.95, 0.9)
    torch.testing.assert_close(gae_advantages(rewards, values, mask, 0.95, 0.9), expected, atol=1e-5, rtol=1e-5)
    _, returns, _ = compute_advantages("gae", token_rewards=rewards, response_mask=mask, values=values, gamma=0.95, lam=0.9)
    torch.testing.assert_close(returns, torch.where(mask, expected + values, 0.0), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- group estimators

# six samples, groups {7: 3 samples, 3: 2 samples, 42: 1 sample}; scores (sum of token rewards):
# sample 0 has its reward split 0.5 + 0.5 over two tokens; the 9.0 sits on padding and is ignored
GROUP_IDS = torch.tensor([7, 7, 7, 3, 3, 42])
GROUP_REWARDS = torch.tensor(
    [[0.5, 0.5, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 9.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.5, 0.0]]
)
GROUP_MASK = torch.tensor([[T_, T_, T_], [T_, T_, T_], [T_, T_, F_], [T_, T_, F_], [T_, T_, T_], [T_, T_, F_]])
# scores: (1, 0, 0 | 1, 1 | 0.5)


def _group(name, **kw):
    return compute_advantages(name, token_rewards=GROUP_REWARDS, response_mask=GROUP_MASK, group_ids=GROUP_IDS, **kw)


def _per_sample(adv):
    return adv[:, 0]


def test_grpo_by_hand():
    # group 7: mean 1/3, unbiased std sqrt(((2/3)² + 2 (1/3)²) / 2) = sqrt(1/3) = 0.57735
    #          -> (2/3)/0.57735 = 1.154701, (-1/3)/0.57735 = -0.577350
    # group 3: scores equal, std 0 -> 0 / (0 + ε) = 0 ; group 42: one sample -> 0
    adv, ret, stats = _group("grpo")
    torch.testing.assert_close(_per_sample(adv), torch.tensor([1.154701, -0.577350, -0.577350, 0.0, 0.0, 0.0]),
                               atol=1e-5, rtol=0)
    assert torch.equal(adv, ret)
    assert torch.all(adv[~GROUP_MASK] == 0) and torch.all(adv[2, :2] == adv[2, 0])
    assert stats["zero_std_fraction"] == pytest.approx(0.5)  # samples 3, 4, 5
    assert stats["score_mean"] == pytest.approx(3.5 / 6)


def test_dr_grpo_by_hand():
    # r - group mean: group 7 -> (2/3, -1/3, -1/3); group 3 -> 0, 0; group 42 -> 0
    adv, _, _ = _group("dr_grpo")
    torch.testing.assert_close(_per_sample(adv), torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0]))


def test_rloo_by_hand():
    # leave-one-out: sample 0: 1 - (0 + 0)/2 = 1 ; samples 1, 2: 0 - (1 + 0)/2 = -0.5
    # group 3: 1 - 1 = 0 ; group 42 (one sample, no baseline): 0
    adv, _, _ = _group("rloo")
    torch.testing.assert_close(_per_sample(adv), torch.tensor([1.0, -0.5, -0.5, 0.0, 0.0, 0.0]))


def _group_loop(scores, ids, kind, eps):
    out = []
    for i, s in enumerate(scores):
        others = [scores[j] for j in range(len(scores)) if ids[j] == ids[i] and j != i]
        if not others:
            out.append(0.0)
            continue
        group = others + [s]
        mean = sum(group) / len(group)
        if kind == "grpo":
            std = math.sqrt(sum((g - mean) ** 2 for g in group) / (len(group) - 1))
            out.append((s - mean) / (std + eps))
        elif kind == "dr_grpo":
            out.append(s - mean)
        else:
            out.append(s - sum(others) / len(others))
    return out


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_group_estimators_match_loop(name):
    rewards, _, mask = _ragged(12, 6, seed=3)
    ids = torch.randint(0, 4, (12,), generator=torch.Generator().manual_seed(4))
    adv, _, _ = compute_advantages(name, token_rewards=rewards, response_mask=mask, group_ids=ids)
    scores = [sum(rewards[b, t].item() for t in range(6) if mask[b, t]) for b in range(12)]
    expected = torch.tensor(_group_loop(scores, ids.tolist(), name, 1e-6))
    torch.testing.assert_close(adv, torch.where(mask, expected.unsqueeze(-1), 0.0), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_groups_of_one_give_zero_not_nan(name):
    rewards = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    adv, _, stats = compute_advantages(name, token_rewards=rewards, response_mask=mask, group_ids=torch.tensor([0, 1]))
    assert torch.equal(adv, torch.zeros(2, 2)) and not any(math.isnan(v) for v in stats.values())


# ---------------------------------------------------------------- REINFORCE++ and ReMax


def test_reinforce_plus_plus_by_hand():
    # γ = 0.5; row 0 r = (0, 0, 1): G = (0.25, 0.5, 1) ; row 1 r = (0, 2 | pad): G = (1, 2)
    # whiten over (0.25, 0.5, 1, 1, 2): mean 0.95, unbiased var 1.8 / 4 = 0.45, std 0.670820
    # -> (-0.7, -0.45, 0.05, 0.05, 1.05) / 0.670820 = (-1.043498, -0.670820, 0.074536, 0.074536, 1.565248)
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 7.0]])
    mask = torch.tensor([[T_, T_, T_], [T_, T_, F_]])
    adv, ret, _ = compute_advantages("reinforce_plus_plus", token_rewards=rewards, response_mask=mask, gamma=0.5, eps=0.0)
    torch.testing.assert_close(ret, torch.tensor([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]]))
    expected = torch.tensor([[-1.043498, -0.670820, 0.074536], [0.074536, 1.565248, 0.0]])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)


def test_discounted_returns_match_loop():
    rewards, _, mask = _ragged(4, 7, seed=5)
    expected = torch.zeros(4, 7)
    for b in range(4):
        g = 0.0
        for t in reversed(range(7)):
            if mask[b, t]:
                g = rewards[b, t].item() + 0.9 * g
                expected[b, t] = g
    torch.testing.assert_close(discounted_returns(rewards, mask, 0.9), expected, atol=1e-5, rtol=1e-5)


def test_single_token_batch_whitens_to_zero_not_nan():
    adv, _, _ = compute_advantages("reinforce_plus_plus", token_rewards=torch.tensor([[2.0, 0.0]]),
                                   response_mask=torch.tensor([[T_, F_]]))
    assert torch.equal(adv, torch.zeros(1, 2))


def test_remax_by_hand():
    # γ = 1: G_t = reward-to-go. row 0: r = (0, 0, 1) -> G = 1 everywhere, greedy reward b = 0.3 -> 0.7
    # row 1: r = (0, 0.5 | pad) -> G = 0.5, b = 0.8 (on the greedy response's last token) -> -0.3
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, 0.0]])
    mask = torch.tensor([[T_, T_, T_], [T_, T_, F_]])
    baseline = torch.tensor([[0.0, 0.3, 0.0], [0.0, 0.0, 0.8]])
    adv, ret, stats = compute_advantages("remax", token_rewards=rewards, response_mask=mask,
                                         baseline_token_rewards=baseline)
    torch.testing.assert_close(adv, torch.tensor([[0.7, 0.7, 0.7], [-0.3, -0.3, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0], [0.5, 0.5, 0.0]]))
    assert stats["baseline_mean"] == pytest.approx(0.55)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "name, missing",
    [("gae", "values"), ("grpo", "group_ids"), ("dr_grpo", "group_ids"), ("rloo", "group_ids"),
     ("remax", "baseline_token_rewards")],
)
def test_missing_input_is_named(name, missing):
    with pytest.raises(ValueError, match=f"{name}.*needs {missing}"):
        compute_advantages(name, token_rewards=torch.zeros(2, 3), response_mask=torch.ones(2, 3, dtype=torch.bool))


def test_every_estimator_has_the_same_signature():
    kwargs = dict(token_rewards=torch.rand(4, 3), response_mask=torch.ones(4, 3, dtype=torch.bool),
                  values=torch.rand(4, 3), group_ids=torch.tensor([0, 0, 1, 1]),
                  baseline_token_rewards=torch.rand(4, 3), gamma=1.0, lam=0.95, eps=1e-6)
    for name in ADVANTAGE_ESTIMATORS.names():
        adv, ret, stats = compute_advantages(name, **kwargs)
        assert adv.shape == ret.shape == (4, 3) and all(isinstance(v, float) for v in stats.values())


def test_bad_arguments():
    with pytest.raises(KeyError, match="dr_grpo, gae, grpo, reinforce_plus_plus, remax, rloo"):
        compute_advantages("ppo", token_rewards=torch.zeros(1, 1))
    with pytest.raises(ValueError, match="gamma=1.5"):
        compute_advantages("reinforce_plus_plus", token_rewards=torch.zeros(1, 2),
                           response_mask=torch.ones(1, 2, dtype=torch.bool), gamma=1.5)
    with pytest.raises(ValueError, match="group_ids has shape"):
        compute_advantages("grpo", token_rewards=torch.zeros(2, 2), response_mask=torch.ones(2, 2, dtype=torch.bool),
                           group_ids=torch.tensor([0, 0, 1]))
