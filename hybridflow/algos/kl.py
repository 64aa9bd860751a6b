"""KL divergence between the policy and the reference: estimators, their two uses, controllers.

Estimators of KL(π || π_ref) from one sample y ~ π per token (J. Schulman, "Approximating
KL Divergence", 2020), with log_probs = log π(y), ref_log_probs = log π_ref(y):
  k1 = log π - log π_ref                          unbiased, high variance, can be negative
  k2 = ½ (log π - log π_ref)²                     biased, low variance, >= 0
  k3 = exp(log π_ref - log π) - (log π_ref - log π) - 1    unbiased, low variance, >= 0
  abs = |log π - log π_ref|                       biased, >= 0 (verl's `abs`)
verl's names are registered beside ours for the same functions: `kl` = k1, `mse` = k2,
`low_var_kl` = k3 (verl clamps it to ±10 as well), so a verl config's estimator name works as is.
Departure for stability: k3 clamps the log-ratio to ±K3_LOG_RATIO_BOUND before `exp` and
the result to at most K3_MAX, so one token the reference finds very unlikely cannot
overflow or dominate the loss (the gradient is 0 where the clamp is active).

Uses: `apply_kl_penalty` subtracts coef * KL from the per-token rewards (PPO-RLHF,
Ziegler et al. 2019 / Ouyang et al. 2022); `kl_loss` adds it to the actor loss (GRPO).
The coefficient comes from a controller: fixed, or adaptive (Ziegler et al. 2019, eq. 2).
"""

from __future__ import annotations

import inspect

import torch

from hybridflow.algos.aggregation import aggregate_loss
from hybridflow.algos.masked import check_mask, masked_mean, masked_sum
from hybridflow.registry import Registry

K3_LOG_RATIO_BOUND = 20.0
K3_MAX = 10.0

KL_ESTIMATORS: Registry = Registry(
    "KL estimator",
    signature="fn(*, log_probs: (B, T) tensor, ref_log_probs: (B, T) tensor) -> (B, T) tensor",
)


@KL_ESTIMATORS.register("k1")
def kl_k1(*, log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """k1 = log π - log π_ref, per token (B, T)."""
    return log_probs - ref_log_probs


@KL_ESTIMATORS.register("abs")
def kl_abs(*, log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """|log π - log π_ref|, per token (B, T)."""
    return (log_probs - ref_log_probs).abs()


@KL_ESTIMATORS.register("k2")
def kl_k2(*, log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """k2 = ½ (log π - log π_ref)², per token (B, T)."""
    return 0.5 * (log_probs - ref_log_probs) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(*, log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """k3 = e^r - r - 1 with r = log π_ref - log π clamped to ±20; result clamped to <= 10."""
    log_ratio = (ref_log_probs - log_probs).clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
    return (torch.exp(log_ratio) - log_ratio - 1).clamp(max=K3_MAX)


# verl's names for the same estimators (algorithm.kl_penalty / actor.kl_loss_type there).
VERL_KL_NAMES = {"kl": kl_k1, "mse": kl_k2, "low_var_kl": kl_k3}
for _name, _fn in VERL_KL_NAMES.items():
    KL_ESTIMATORS.add(_name, _fn)


def apply_kl_penalty(
    *,
    token_rewards: torch.Tensor,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    estimator: str = "k1",
) -> tuple[torch.Tensor, dict[str, float]]:
    """r'_t = r_t - β KL_t on response tokens (masked tokens keep r_t). All (B, T).

    The penalty is data, not a loss: it is computed without gradient. Stats: `kl` (mean
    per token), `kl_per_sequence` (mean over sequences of the summed KL, the quantity
    Ziegler et al. give a target for), `kl_coef`.
    """
    check_mask(response_mask, token_rewards)
    with torch.no_grad():
        kl = KL_ESTIMATORS.get(estimator)(log_probs=log_probs.detach(), ref_log_probs=ref_log_probs.detach())
        penalty = torch.where(response_mask, kl_coef * kl, torch.zeros_like(kl))
        new_rewards = token_rewards - penalty
        stats = {
            "kl": float(masked_mean(kl, response_mask)),
            "kl_per_sequence": float(masked_sum(kl, response_mask, dim=-1).mean()),
            "kl_coef": float(kl_coef),
        }
    return new_rewards, stats


def kl_loss(
    *,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    estimator: str = "k3",
    aggregation: str = "token-mean",
    global_token_count: int | None = None,
    global_sequence_count: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """aggregate(KL_t) over response tokens, differentiable in `log_probs` (GRPO's β·D_KL term).

    The caller multiplies by its coefficient. Shapes: all (B, T); returns a scalar.
    """
    check_mask(response_mask, log_probs)
    kl = KL_ESTIMATORS.get(estimator)(log_probs=log_probs, ref_log_probs=ref_log_probs)
    loss = aggregate_loss(
        kl,
        response_mask,
        aggregation,
        global_token_count=global_token_count,
        global_sequence_count=global_sequence_count,
    )
    return loss, {"kl_loss": loss.detach()}  # a 0-dim tensor, read once per mini-batch (hybridflow.algos)


KL_CONTROLLERS: Registry = Registry(
    "KL controller",
    signature="cls(**kwargs) -> object with `.coef: float` and `.update(current_kl: float, n_steps: int) -> None`",
)


@KL_CONTROLLERS.register("fixed")
class FixedKLController:
    """β stays at `coef`."""

    def __init__(self, coef: float) -> None:
        if coef < 0:
            raise ValueError(f"coef={coef} must be >= 0 (0 turns the KL penalty off)")
        self.coef = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""


@KL_CONTROLLERS.register("adaptive")
class AdaptiveKLController:
    """Ziegler et al. 2019, eq. 2: e = clip(KL/KL_target - 1, -0.2, 0.2); β ← β (1 + e n / H).

    `n_steps` is the number of samples (or steps, consistently with `horizon`) since the
    last update; `current_kl` must be measured as `target_kl` is meant (e.g. per sequence).
    """

    def __init__(self, init_coef: float, target_kl: float, horizon: float) -> None:
        if init_coef <= 0:
            raise ValueError(f"init_coef={init_coef} must be > 0 (a multiplicative update cannot leave 0)")
        if target_kl <= 0:
            raise ValueError(f"target_kl={target_kl} must be > 0; use the 'fixed' controller for no target")
        if horizon <= 0:
            raise ValueError(f"horizon={horizon} must be > 0 (Ziegler et al. use 10000 samples)")
        self.coef = float(init_coef)
        self.target_kl = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.coef *= 1.0 + error * n_steps / self.horizon


def build_kl_controller(kind: str, **kwargs: float):
    """The controller registered as `kind`, constructed with `kwargs` (checked against its signature)."""
    cls = KL_CONTROLLERS.get(kind)
    signature = inspect.signature(cls)
    try:
        signature.bind(**kwargs)
    except TypeError as exc:
        raise TypeError(f"KL controller {kind!r} takes {signature}, got {sorted(kwargs)}: {exc}") from None
    return cls(**kwargs)
