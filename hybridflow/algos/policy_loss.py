"""Policy losses: clipped surrogate objectives, per token, then aggregated.

Every entry of `POLICY_LOSSES` has one keyword-only signature (see the registry) and returns
`(loss, stats)`: a scalar to minimise and detached floats.

  ppo_clip  PPO (Schulman et al. 2017, eq. 7) with the ratio clipped to [1 - low, 1 + high]
            (low != high is DAPO's clip-higher, Yu et al. 2025) and, when `dual_clip_c` is
            set, dual clip for negative advantages (Ye et al. 2020, eq. 5): the loss of a
            token with Â < 0 is at most -c·Â.
  gspo      GSPO (Zheng et al. 2025): one importance ratio per sequence, the geometric mean
            s_i = exp(mean_t (log π - log π_old)), in the paper's per-token form
            s_it = sg[s_i] · π_t / sg[π_t], whose value is s_i and whose gradient is
            s_i ∇log π_t. The paper's objective averages over sequences: use it with
            aggregation="seq-mean-token-mean" (and its small clip ranges, ~3e-4 / 4e-4).

Rollout correction (algorithm.rollout_correction, hybridflow.algos.rollout_correction): when π_old is
the actor's recomputed log-probs and the samples came from the engine's policy μ (another precision,
other kernels, or an older version), each token's clipped loss is multiplied by the preset's weight
w_t (`behavior_weights`), e.g. the truncated importance weight min(π_old(y_t)/μ(y_t), C) (V-trace,
Espeholt et al. 2018; the decoupled PPO objective of Hilton et al. 2022), or 0 where a mask drops the
token. Without weights the losses are unchanged, bit for bit.

Departure for stability: log-ratios are clamped to ±LOG_RATIO_BOUND before `exp`.
"""

from __future__ import annotations

import torch

from hybridflow.algos.aggregation import aggregate_loss
from hybridflow.algos.masked import check_mask, masked_mean
from hybridflow.registry import Registry

LOG_RATIO_BOUND = 20.0

POLICY_LOSSES: Registry = Registry(
    "policy loss",
    signature=(
        "fn(*, log_probs, old_log_probs, advantages, response_mask, clip_ratio_low=0.2, clip_ratio_high=0.2, "
        "dual_clip_c=None, aggregation='token-mean', global_token_count=None, global_sequence_count=None, "
        "behavior_weights=None) -> (loss scalar, stats: dict[str, 0-dim tensor])"
    ),
)


def _check_clip(clip_ratio_low: float, clip_ratio_high: float, dual_clip_c: float | None) -> None:
    if not 0.0 <= clip_ratio_low < 1.0:
        raise ValueError(f"clip_ratio_low={clip_ratio_low} must be in [0, 1): the ratio is clipped at 1 - low > 0")
    if clip_ratio_high < 0.0:
        raise ValueError(f"clip_ratio_high={clip_ratio_high} must be >= 0")
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c={dual_clip_c} must be > 1 (Ye et al. use 3), or None to turn dual clip off")


def clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    dual_clip_c: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token loss max(-Â ρ, -Â clip(ρ, 1-low, 1+high)), then min(·, -c Â) where Â < 0.

    All (B, T). Returns (loss, clipped, dual_clipped): the bool tensors say where each clip
    is the active branch (so the token's gradient is 0).
    """
    unclipped = -advantages * ratio
    clipped_loss = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = torch.maximum(unclipped, clipped_loss)
    clipped = clipped_loss > unclipped
    dual_clipped = torch.zeros_like(clipped)
    if dual_clip_c is not None:
        bound = -advantages * dual_clip_c  # a constant: no gradient flows where it is taken
        dual_clipped = (advantages < 0) & (loss > bound)
        loss = torch.where(dual_clipped, bound, loss)
    return loss, clipped, dual_clipped


def _finish(loss_mat, log_ratio, clipped, dual_clipped, mask, aggregation, global_token_count,
            global_sequence_count, behavior_weights=None):
    if behavior_weights is not None:
        loss_mat = loss_mat * behavior_weights.detach()
    loss = aggregate_loss(
        loss_mat, mask, aggregation, global_token_count=global_token_count, global_sequence_count=global_sequence_count
    )
    with torch.no_grad():  # 0-dim tensors where the loss is: read once per mini-batch (hybridflow.algos)
        log_ratio = log_ratio.detach()
        stats = {
            "policy_loss": loss.detach(),
            "clip_fraction": masked_mean(clipped.float(), mask),
            "dual_clip_fraction": masked_mean(dual_clipped.float(), mask),
            # KL(π_old || π) per token with the k3 estimator, samples from π_old: (ρ - 1) - log ρ
            "approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
        }
    return loss, stats


def _check_inputs(log_probs, old_log_probs, advantages, response_mask) -> None:
    check_mask(response_mask, log_probs)
    for name, tensor in (("old_log_probs", old_log_probs), ("advantages", advantages)):
        if tensor.shape != log_probs.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}; it must match log_probs {tuple(log_probs.shape)}")


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(*, log_probs, old_log_probs, advantages, response_mask, clip_ratio_low=0.2, clip_ratio_high=0.2,
             dual_clip_c=None, aggregation="token-mean", global_token_count=None, global_sequence_count=None,
             behavior_weights=None):
    """L = agg_t max(-Â_t ρ_t, -Â_t clip(ρ_t, 1-low, 1+high)) [dual clip], ρ_t = π(y_t)/π_old(y_t). (B, T) in."""
    _check_inputs(log_probs, old_log_probs, advantages, response_mask)
    _check_clip(clip_ratio_low, clip_ratio_high, dual_clip_c)
    log_ratio = (log_probs - old_log_probs.detach()).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    loss_mat, clipped, dual = clipped_surrogate(
        torch.exp(log_ratio), advantages.detach(), clip_ratio_low, clip_ratio_high, dual_clip_c
    )
    return _finish(loss_mat, log_ratio, clipped, dual, response_mask, aggregation, global_token_count,
                   global_sequence_count, behavior_weights)


@POLICY_LOSSES.register("gspo")
def gspo(*, log_probs, old_log_probs, advantages, response_mask, clip_ratio_low=0.2, clip_ratio_high=0.2,
         dual_clip_c=None, aggregation="token-mean", global_token_count=None, global_sequence_count=None,
             behavior_weights=None):
    """GSPO-token: s_it = exp(sg[mean_t log ρ_t] + log π_t - sg[log π_t]), clipped as in PPO. (B, T) in."""
    _check_inputs(log_probs, old_log_probs, advantages, response_mask)
    _check_clip(clip_ratio_low, clip_ratio_high, dual_clip_c)
    log_ratio = log_probs - old_log_probs.detach()
    sequence_log_ratio = masked_mean(log_ratio, response_mask, dim=-1).unsqueeze(-1)  # (B, 1)
    token_log_ratio = sequence_log_ratio.detach() + log_probs - log_probs.detach()
    token_log_ratio = token_log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    loss_mat, clipped, dual = clipped_surrogate(
        torch.exp(token_log_ratio), advantages.detach(), clip_ratio_low, clip_ratio_high, dual_clip_c
    )
    return _finish(loss_mat, log_ratio, clipped, dual, response_mask, aggregation, global_token_count,
                   global_sequence_count, behavior_weights)


# A policy loss whose per-token loss is 0, with no gradient, wherever the advantage is 0 says so;
# the actor then skips samples whose advantages are all 0 (`actor.skip_zero_advantage_samples`).
# A loss registered from outside opts in the same way.
ppo_clip.zero_at_zero_advantage = True
gspo.zero_at_zero_advantage = True


def vanishes_at_zero_advantage(name: str) -> bool:
    return bool(getattr(POLICY_LOSSES.get(name), "zero_at_zero_advantage", False))


def compute_policy_loss(name: str, behavior_weights=None, **kwargs):
    """`POLICY_LOSSES.get(name)(**kwargs)`: the one place the actor picks a policy loss by name.
    `behavior_weights` is passed only when given, so a loss registered before it existed still
    runs synchronously."""
    extra = {} if behavior_weights is None else {"behavior_weights": behavior_weights}
    return POLICY_LOSSES.get(name)(**kwargs, **extra)
