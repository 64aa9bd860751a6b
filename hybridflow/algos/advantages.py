"""Advantage estimators: per-token rewards (and values, groups, baselines) -> advantages, returns.

Every entry of `ADVANTAGE_ESTIMATORS` has one keyword-only signature (see the registry's
`signature`); it uses the arguments it needs and raises ValueError naming any that is None.
All outputs are 0 on tokens where `response_mask` is False, and are computed without grad.

Conventions and departures:
  - Masked tokens inside a response (e.g. tool output in a multi-turn rollout) are skipped:
    the recursion links each valid token to the next *valid* token, and rewards or values
    on masked positions are ignored.
  - Group statistics use the unbiased std (as `torch.std`). A group of one sample has no
    baseline: GRPO, Dr. GRPO and RLOO give it advantage 0 (never NaN).
  - Outcome estimators (GRPO, Dr. GRPO, RLOO) return returns = advantages (no critic).
  - ReMax uses the reward-to-go G_t = Σ_{k>=t} γ^{k-t} r_k minus the greedy baseline; with
    the reward on the last token and γ = 1 this is the paper's r(y) - r(y_greedy).
"""

from __future__ import annotations

import inspect

import torch

from hybridflow.algos.masked import check_mask, masked_mean, masked_sum, masked_var, masked_whiten
from hybridflow.registry import Registry

ADVANTAGE_ESTIMATORS: Registry = Registry(
    "advantage estimator",
    signature=(
        "fn(*, token_rewards, response_mask, values=None, group_ids=None, baseline_token_rewards=None, "
        "gamma=1.0, lam=1.0, eps=1e-6) -> (advantages (B, T), returns (B, T), stats: dict[str, float])"
    ),
)


def _require(estimator: str, name: str, value: object, hint: str) -> None:
    if value is None:
        raise ValueError(f"advantage estimator {estimator!r} needs {name} but got None; {hint}")


def _check_discount(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}={value} must be in [0, 1]")


def _stats(advantages: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    return {
        "advantage_mean": float(masked_mean(advantages, mask)),
        "advantage_std": float(masked_var(advantages, mask).sqrt()),
        "return_mean": float(masked_mean(returns, mask)),
    }


def discounted_returns(token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + γ G_{t'} over valid tokens (t' = next valid token; G after the end = 0). (B, T) -> (B, T)."""
    rewards = token_rewards.float()
    returns = torch.zeros_like(rewards)
    next_return = torch.zeros(rewards.shape[0], device=rewards.device)
    for t in reversed(range(rewards.shape[1])):  # a loop over T, vectorised over B
        valid = response_mask[:, t]
        next_return = torch.where(valid, rewards[:, t] + gamma * next_return, next_return)
        returns[:, t] = torch.where(valid, next_return, torch.zeros_like(next_return))
    return returns


def gae_advantages(
    token_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float, lam: float
) -> torch.Tensor:
    """Schulman et al. 2016, eq. 16: δ_t = r_t + γ V_{t'} - V_t, Â_t = δ_t + γλ Â_{t'}. All (B, T).

    t' is the next valid token; past the last one V = Â = 0 (the response ended: terminal).
    The recursion is sequential in t, so it is one loop over T, vectorised over B.
    """
    rewards, values = token_rewards.float(), values.float()
    next_value = torch.zeros(values.shape[0], device=values.device)
    advantages = torch.zeros_like(values)
    next_advantage = torch.zeros_like(next_value)
    for t in reversed(range(values.shape[1])):
        valid = response_mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        next_advantage = torch.where(valid, advantage, next_advantage)
        next_value = torch.where(valid, values[:, t], next_value)
        advantages[:, t] = torch.where(valid, advantage, torch.zeros_like(advantage))
    return advantages


@ADVANTAGE_ESTIMATORS.register("gae")
@torch.no_grad()
def gae(*, token_rewards, response_mask, values=None, group_ids=None, baseline_token_rewards=None,
        gamma=1.0, lam=1.0, eps=1e-6):
    """PPO's GAE(γ, λ); returns = Â + V (the critic's target); Â whitened over valid tokens."""
    check_mask(response_mask, token_rewards)
    _require("gae", "values", values, "compute values with the critic first, or pick 'grpo' / 'rloo'")
    check_mask(response_mask, values)
    _check_discount("gamma", gamma)
    _check_discount("lam", lam)
    raw = gae_advantages(token_rewards, values, response_mask, gamma, lam)
    returns = torch.where(response_mask, raw + values.float(), torch.zeros_like(raw))
    advantages = masked_whiten(raw, response_mask, eps=eps)
    return advantages, returns, _stats(advantages, returns, response_mask)


def _group_index(group_ids: torch.Tensor, batch_size: int) -> tuple[torch.Tensor, int]:
    if group_ids.shape != (batch_size,):
        raise ValueError(f"group_ids has shape {tuple(group_ids.shape)}; it must be ({batch_size},), one id per sample")
    if group_ids.is_floating_point():
        raise TypeError(f"group_ids has dtype {group_ids.dtype}; pass integer ids (samples of one prompt share one)")
    unique_ids, index = torch.unique(group_ids, return_inverse=True)
    return index, unique_ids.numel()


def _group_sum(x: torch.Tensor, index: torch.Tensor, n_groups: int) -> torch.Tensor:
    return torch.zeros(n_groups, dtype=x.dtype, device=x.device).index_add_(0, index, x)


def group_statistics(
    scores: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (count, mean, unbiased std) of its group's scores, each (B,); std is 0 for a group of one."""
    index, n_groups = _group_index(group_ids, scores.shape[0])
    count = _group_sum(torch.ones_like(scores), index, n_groups)
    mean = _group_sum(scores, index, n_groups) / count
    squares = _group_sum((scores - mean[index]) ** 2, index, n_groups)
    std = torch.where(count > 1, squares / (count - 1).clamp(min=1), torch.zeros_like(squares)).sqrt()
    return count[index], mean[index], std[index]


def _outcome(name, token_rewards, response_mask, group_ids):
    check_mask(response_mask, token_rewards)
    _require(name, "group_ids", group_ids, "pass one integer id per sample; samples of one prompt share it")
    scores = masked_sum(token_rewards.float(), response_mask, dim=-1)  # (B,) outcome reward per sequence
    return scores, *group_statistics(scores, group_ids)


def _broadcast(per_sequence: torch.Tensor, scores: torch.Tensor, std: torch.Tensor, mask: torch.Tensor):
    advantages = torch.where(mask, per_sequence.unsqueeze(-1), torch.zeros((), device=mask.device))
    stats = _stats(advantages, advantages, mask)
    stats["score_mean"] = float(scores.mean())
    stats["zero_std_fraction"] = float((std == 0).float().mean())  # samples whose group gives no signal
    return advantages, advantages, stats


@ADVANTAGE_ESTIMATORS.register("grpo")
@torch.no_grad()
def grpo(*, token_rewards, response_mask, values=None, group_ids=None, baseline_token_rewards=None,
         gamma=1.0, lam=1.0, eps=1e-6):
    """Shao et al. 2024 (DeepSeekMath), outcome supervision: Â_i = (r_i - mean_g r) / (std_g r + ε)."""
    scores, _, mean, std = _outcome("grpo", token_rewards, response_mask, group_ids)
    return _broadcast((scores - mean) / (std + eps), scores, std, response_mask)


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
@torch.no_grad()
def dr_grpo(*, token_rewards, response_mask, values=None, group_ids=None, baseline_token_rewards=None,
            gamma=1.0, lam=1.0, eps=1e-6):
    """Liu et al. 2025 (Dr. GRPO): Â_i = r_i - mean_g r (no std division, which biases by difficulty)."""
    scores, _, mean, std = _outcome("dr_grpo", token_rewards, response_mask, group_ids)
    return _broadcast(scores - mean, scores, std, response_mask)


@ADVANTAGE_ESTIMATORS.register("rloo")
@torch.no_grad()
def rloo(*, token_rewards, response_mask, values=None, group_ids=None, baseline_token_rewards=None,
         gamma=1.0, lam=1.0, eps=1e-6):
    """Ahmadian et al. 2024: Â_i = r_i - (Σ_{j≠i} r_j)/(n-1) = n/(n-1) (r_i - mean_g r); 0 when n = 1."""
    scores, count, mean, std = _outcome("rloo", token_rewards, response_mask, group_ids)
    scale = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.zeros_like(count))
    return _broadcast(scale * (scores - mean), scores, std, response_mask)


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus(*, token_rewards, response_mask, values=None, group_ids=None,
                        baseline_token_rewards=None, gamma=1.0, lam=1.0, eps=1e-6):
    """Hu 2025 (REINFORCE++): G_t = Σ_{k>=t} γ^{k-t} r_k, Â = whiten(G) over the batch's valid tokens."""
    check_mask(response_mask, token_rewards)
    _check_discount("gamma", gamma)
    returns = discounted_returns(token_rewards, response_mask, gamma)
    advantages = masked_whiten(returns, response_mask, eps=eps)
    return advantages, returns, _stats(advantages, returns, response_mask)


@ADVANTAGE_ESTIMATORS.register("remax")
@torch.no_grad()
def remax(*, token_rewards, response_mask, values=None, group_ids=None, baseline_token_rewards=None,
          gamma=1.0, lam=1.0, eps=1e-6):
    """Li et al. 2024 (ReMax): Â_t = G_t - b with b = Σ_t baseline_token_rewards (the greedy response's reward).

    baseline_token_rewards (B, T) must be 0 outside the greedy response's tokens; it is summed
    over the whole row because the greedy response has its own mask.
    """
    check_mask(response_mask, token_rewards)
    _require("remax", "baseline_token_rewards", baseline_token_rewards,
             "score a greedy (temperature 0) response per prompt and pass its token rewards")
    _check_discount("gamma", gamma)
    baseline = baseline_token_rewards.float().sum(dim=-1, keepdim=True)  # (B, 1)
    returns = discounted_returns(token_rewards, response_mask, gamma)
    advantages = torch.where(response_mask, returns - baseline, torch.zeros_like(returns))
    stats = _stats(advantages, returns, response_mask)
    stats["baseline_mean"] = float(baseline.mean())
    return advantages, returns, stats


def compute_advantages(name: str, **kwargs):
    """`ADVANTAGE_ESTIMATORS.get(name)(**kwargs)`: the one place a recipe picks an estimator by name."""
    return ADVANTAGE_ESTIMATORS.get(name)(**kwargs)


# The keywords a recipe passes to every estimator (the registry's signature, less `eps`).
ESTIMATOR_ARGUMENTS = ("token_rewards", "response_mask", "values", "group_ids", "baseline_token_rewards",
                       "gamma", "lam")


def check_estimator(name: str) -> None:
    """Raise unless `name` (a registered name or a 'module:fn' reference) resolves to a callable
    that accepts every keyword in ESTIMATOR_ARGUMENTS: so that a custom estimator fails before a run starts."""
    fn = ADVANTAGE_ESTIMATORS.get(name)
    if not callable(fn):
        raise TypeError(f"advantage estimator {name!r} is a {type(fn).__name__}, not a function; "
                        f"it must have the signature {ADVANTAGE_ESTIMATORS.signature}")
    try:
        inspect.signature(fn).bind(**dict.fromkeys(ESTIMATOR_ARGUMENTS))
    except TypeError as exc:
        raise TypeError(f"advantage estimator {name!r} cannot take the recipe's keywords ({exc}); "
                        f"it must have the signature {ADVANTAGE_ESTIMATORS.signature}") from None
