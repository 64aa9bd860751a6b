"""Rollout–training mismatch: how far the sampler's log-probs are from the trainer's on the tokens trained.

The generation engine samples token y_t and reports log μ(y_t) (`sampler_log_probs`); the trainer
computes log π(y_t) for the same token (`old_log_probs`, or the update's own first forward pass when
it clips against the sampler). Per token

    Δ_t = log π(y_t) - log μ(y_t),        ρ_t = exp(Δ_t) = π(y_t) / μ(y_t),

and with samples from μ (Schulman 2020, "Approximating KL divergence"):

    k1_t = -Δ_t                 (unbiased for KL(μ‖π); a single value may be negative)
    k3_t = (ρ_t - 1) - Δ_t      (unbiased for KL(μ‖π), never negative)

where ρ_t is formed from the log-ratio clamped to ±20 (so exp cannot overflow) and Δ_t is the log-ratio
itself, unclamped: a token with Δ_t = -25 gives k3_t = (exp(-20) - 1) + 25.

The sequence-level log-ratio is S_i = Σ_t Δ_it, the log of the product of the token ratios that the
sequence-level corrections (hybridflow.algos.rollout_correction) weigh or mask by. Names follow
verl's rollout-correction diagnostics (`rollout_corr/kl` is our k1, `rollout_corr/k3_kl` our k3).
"""

from __future__ import annotations

import torch

from hybridflow.algos.masked import check_mask, masked_mean, masked_sum

LOG_RATIO_BOUND = 20.0  # exp(±20) before a ratio is formed, as verl's safety bound


@torch.no_grad()
def mismatch_metrics(*, trainer_log_probs: torch.Tensor, sampler_log_probs: torch.Tensor,
                     response_mask: torch.Tensor, band_low: float, band_high: float) -> dict[str, float]:
    """The mismatch of one batch over its trained tokens.

    trainer_log_probs, sampler_log_probs: (B, T) float, log π and log μ of the same tokens;
    response_mask: (B, T) bool, True on a token that is trained (the loss mask); the ratio band
    [band_low, band_high] (e.g. [1/C, C]). Returns floats:

      abs_diff_mean, abs_diff_max   mean_t |Δ_t| and max_t |Δ_t|
      outside_band_fraction         share of tokens with ρ_t outside [band_low, band_high]
      k1_kl, k3_kl                  mean_t k1_t and mean_t k3_t (per token, see the module docstring)
      seq_log_ratio_mean            mean over sequences of S_i = Σ_t Δ_it (sequences with a trained token)
      seq_log_ratio_abs_max         max_i |S_i|

    A batch without a trained token gives 0 for each."""
    check_mask(response_mask, trainer_log_probs)
    if sampler_log_probs.shape != trainer_log_probs.shape:
        raise ValueError(f"sampler_log_probs has shape {tuple(sampler_log_probs.shape)}; it must match "
                         f"trainer_log_probs {tuple(trainer_log_probs.shape)}")
    if not 0 < band_low <= 1 <= band_high:
        raise ValueError(f"the band [{band_low}, {band_high}] must hold ratio 1 with band_low > 0")
    delta = torch.where(response_mask, (trainer_log_probs - sampler_log_probs).double(), 0.0)  # (B, T), 0 off the mask
    clamped = delta.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(clamped)
    outside = (ratio < band_low) | (ratio > band_high)
    rows = response_mask.any(dim=1)  # (B,) sequences with a trained token
    sequence_log_ratio = masked_sum(delta, response_mask, dim=1)  # (B,), 0 on a row with none
    zero = delta.new_zeros(1)  # the maxima of a batch without a trained token
    return {
        "abs_diff_mean": float(masked_mean(delta.abs(), response_mask)),
        "abs_diff_max": float(torch.cat([zero, delta.abs().flatten()]).max()),
        "outside_band_fraction": float(masked_mean(outside.double(), response_mask)),
        "k1_kl": float(masked_mean(-delta, response_mask)),
        "k3_kl": float(masked_mean(torch.expm1(clamped) - delta, response_mask)),  # ρ from the clamped Δ
        "seq_log_ratio_mean": float(masked_mean(sequence_log_ratio, rows)),
        "seq_log_ratio_abs_max": float(torch.cat([zero, sequence_log_ratio.abs()]).max()),
    }


MISMATCH_KEYS = ("abs_diff_mean", "abs_diff_max", "outside_band_fraction", "k1_kl", "k3_kl",
                 "seq_log_ratio_mean", "seq_log_ratio_abs_max")
# the statistics that combine over data-parallel ranks by their maximum (the others by their mean)
MISMATCH_MAX_KEYS = frozenset({"abs_diff_max", "seq_log_ratio_abs_max"})
