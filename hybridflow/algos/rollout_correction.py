"""Rollout correction: per-token weights that correct the update for sampling from μ, not π_old.

The engine sampled the batch's tokens from μ (its weights, its kernels, its precision); the update's
clipped objective assumes they came from the proximal policy π_old (the actor's recomputed log-probs).
Each preset turns the per-token log-ratio Δ_t = log π_old(y_t) - log μ(y_t) into a weight w_t that
multiplies the token's clipped loss (decoupled PPO, Hilton et al. 2022; hybridflow.algos.policy_loss):

  token_tis  w_t  = min(ρ_t, C)                          truncated IS per token (Ionides 2008; Yao et
                                                         al. 2025, "Your efficient RL framework secretly
                                                         brings you off-policy RL training")
  seq_tis    w_it = min(ρ_i, C),  ρ_i = Π_t ρ_it         truncated IS per sequence
  token_mis  w_t  = ρ_t · 1[lo <= ρ_t <= hi]              masked IS per token (Liu, Li et al. 2025, "When
                                                         speed kills stability")
  seq_mis    w_it = ρ_i · 1[lo <= ρ_i <= hi]              masked IS per sequence
  geo_mask   w_it = 1[lo <= g_i <= hi],  g_i = exp(mean_t Δ_it)   geometric-mean mask (verl's
                                                         rollout_rs=geometric), no IS weight
  icepop     w_t  = ρ_t · 1[lo <= ρ_t <= hi]              IcePop (Ring-1T, 2025: M(k) = k inside [α, β], 0
                                                         outside): token_mis with the band (0.5, 5)
  token_mask w_t  = 1[lo <= ρ_t <= hi]                    token mask, no IS weight (verl's rollout_rs=token)
  none       w_t  = 1

with ρ_t = exp(Δ_t). Every ratio is formed from a log-ratio clamped to ±20 (verl's safety bound), so a
product over a long sequence cannot overflow. Weights are 0 outside `response_mask` and detached, and
computed in the log-ratio's precision (at least float32: float64 in, float64 weights out). In float64
every preset equals verl's formulas and the IcePop paper's to 1e-9 relative
(`test_every_preset_equals_verl_and_icepop_formulas_in_float64` in tests/unit/test_rollout_mismatch.py).

Departure from verl, on purpose: a masked token keeps its place in the loss's denominator (its weight
is 0, as TRL's masks do), where verl also drops it from the normaliser; with `token-mean` the kept
tokens' gradients are then scaled by (kept tokens / trained tokens), so a preset that masks little
changes the step size little.

Every entry of `ROLLOUT_CORRECTIONS` has one signature and returns `(weights, stats)`: the (B, T)
weights and floats `weight_mean` (over trained tokens), `clipped_fraction` (share of trained tokens
whose weight was cut at C) and `masked_fraction` (share of trained tokens given weight 0 by a mask).
"""

from __future__ import annotations

import torch

from hybridflow.algos.masked import check_mask, masked_mean, masked_sum
from hybridflow.registry import Registry

LOG_RATIO_BOUND = 20.0

ROLLOUT_CORRECTIONS: Registry = Registry(
    "rollout correction",
    signature="fn(*, log_ratio, response_mask, cap, low, high) -> (weights (B, T), stats: dict[str, float])",
)

# [lo, hi] of each masking preset when algorithm.rollout_correction_low/high are null: verl's
# rollout_rs threshold 2 and its reciprocal for the token and sequence masks, verl's geometric
# preset's 1.001 and its reciprocal (verl sets lower = 1 / upper), and IcePop's α = 0.5, β = 5 (Ring-1T)
DEFAULT_BANDS: dict[str, tuple[float, float]] = {
    "token_mis": (0.5, 2.0), "seq_mis": (0.5, 2.0), "geo_mask": (1 / 1.001, 1.001), "icepop": (0.5, 5.0),
    "token_mask": (0.5, 2.0)}
# the presets that mask by the per-token ratio ρ_t: the mismatch metric counts tokens outside their band
TOKEN_BAND_PRESETS = frozenset({"token_mis", "icepop", "token_mask"})
# the presets that read the cap C (algorithm.rollout_correction_cap)
CAPPED = frozenset({"token_tis", "seq_tis"})


def correction_band(preset: str, low: float | None, high: float | None) -> tuple[float, float]:
    """The [lo, hi] a masking preset uses: the configured ends, or its `DEFAULT_BANDS` entry."""
    default_low, default_high = DEFAULT_BANDS.get(preset, (0.0, float("inf")))
    return (default_low if low is None else low, default_high if high is None else high)


def token_band(preset: str, cap: float, low: float | None, high: float | None) -> tuple[float, float]:
    """The per-token ratio band the mismatch metric `outside_band_fraction` counts against: a token
    preset's own band (token_mis, icepop, token_mask), else [1/C, C] with the TIS cap C."""
    if preset in TOKEN_BAND_PRESETS:
        return correction_band(preset, low, high)
    return (1.0 / cap, cap)


def _compute_dtype(log_ratio: torch.Tensor) -> torch.dtype:
    """The input's precision, at least float32: a 16-bit log-ratio is upcast, a float64 one kept."""
    return torch.promote_types(log_ratio.dtype, torch.float32)


def _token_log_ratio(log_ratio: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    check_mask(response_mask, log_ratio)
    delta = log_ratio.detach().to(_compute_dtype(log_ratio))
    return torch.where(response_mask, delta, 0.0).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def _sequence_log_ratio(log_ratio: torch.Tensor, response_mask: torch.Tensor, mean: bool = False) -> torch.Tensor:
    """(B, 1): Σ_t Δ_it (or its mean over the row's trained tokens), clamped to ±20."""
    check_mask(response_mask, log_ratio)
    delta = log_ratio.detach().to(_compute_dtype(log_ratio))
    summed = masked_mean(delta, response_mask, dim=1) if mean else masked_sum(delta, response_mask, dim=1)
    return summed.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).unsqueeze(1)


def _finish(weights: torch.Tensor, response_mask: torch.Tensor, clipped: torch.Tensor, masked: torch.Tensor
            ) -> tuple[torch.Tensor, dict[str, float]]:
    weights = torch.where(response_mask, weights, torch.zeros_like(weights))
    return weights, {"weight_mean": float(masked_mean(weights, response_mask)),
                     "clipped_fraction": float(masked_mean(clipped.float(), response_mask)),
                     "masked_fraction": float(masked_mean(masked.float(), response_mask))}


def _outside(ratio: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return (ratio < low) | (ratio > high)


@ROLLOUT_CORRECTIONS.register("none")
def no_correction(*, log_ratio, response_mask, cap, low, high):
    """w = 1 on every trained token. (B, T) in and out."""
    check_mask(response_mask, log_ratio)
    nothing = torch.zeros_like(response_mask)
    return _finish(torch.ones_like(log_ratio, dtype=_compute_dtype(log_ratio)), response_mask, nothing, nothing)


@ROLLOUT_CORRECTIONS.register("token_tis")
def token_tis(*, log_ratio, response_mask, cap, low, high):
    """w_t = min(ρ_t, C). (B, T) in and out."""
    ratio = torch.exp(_token_log_ratio(log_ratio, response_mask))
    return _finish(ratio.clamp(max=cap), response_mask, ratio > cap, torch.zeros_like(response_mask))


@ROLLOUT_CORRECTIONS.register("seq_tis")
def seq_tis(*, log_ratio, response_mask, cap, low, high):
    """w_it = min(Π_t ρ_it, C), the same on every token of sequence i. (B, T) in and out."""
    ratio = torch.exp(_sequence_log_ratio(log_ratio, response_mask)).expand_as(log_ratio)  # (B, T)
    return _finish(ratio.clamp(max=cap), response_mask, ratio > cap, torch.zeros_like(response_mask))


@ROLLOUT_CORRECTIONS.register("token_mis")
def token_mis(*, log_ratio, response_mask, cap, low, high):
    """w_t = ρ_t inside [lo, hi], 0 outside. (B, T) in and out."""
    ratio = torch.exp(_token_log_ratio(log_ratio, response_mask))
    masked = _outside(ratio, low, high)
    return _finish(torch.where(masked, 0.0, ratio), response_mask, torch.zeros_like(masked), masked)


@ROLLOUT_CORRECTIONS.register("seq_mis")
def seq_mis(*, log_ratio, response_mask, cap, low, high):
    """w_it = Π_t ρ_it when that product is inside [lo, hi], else 0 on the whole sequence. (B, T)."""
    ratio = torch.exp(_sequence_log_ratio(log_ratio, response_mask)).expand_as(log_ratio)
    masked = _outside(ratio, low, high)
    return _finish(torch.where(masked, 0.0, ratio), response_mask, torch.zeros_like(masked), masked)


@ROLLOUT_CORRECTIONS.register("geo_mask")
def geo_mask(*, log_ratio, response_mask, cap, low, high):
    """w_it = 1 when exp(mean_t Δ_it) is inside [lo, hi], else 0 on the whole sequence. (B, T)."""
    geometric = torch.exp(_sequence_log_ratio(log_ratio, response_mask, mean=True)).expand_as(log_ratio)
    masked = _outside(geometric, low, high)
    return _finish((~masked).to(geometric.dtype), response_mask, torch.zeros_like(masked), masked)


@ROLLOUT_CORRECTIONS.register("icepop")
def icepop(*, log_ratio, response_mask, cap, low, high):
    """w_t = ρ_t inside [lo, hi], 0 outside (IcePop's M(k) = k · 1[α <= k <= β]): token_mis, whose default
    band is IcePop's (0.5, 5) instead. (B, T) in and out."""
    return token_mis(log_ratio=log_ratio, response_mask=response_mask, cap=cap, low=low, high=high)


@ROLLOUT_CORRECTIONS.register("token_mask")
def token_mask(*, log_ratio, response_mask, cap, low, high):
    """w_t = 1 inside [lo, hi], 0 outside: a token mask without an IS weight (verl's rollout_rs=token).
    (B, T) in and out."""
    ratio = torch.exp(_token_log_ratio(log_ratio, response_mask))
    masked = _outside(ratio, low, high)
    return _finish((~masked).to(ratio.dtype), response_mask, torch.zeros_like(masked), masked)


def rollout_correction(preset: str, *, old_log_probs: torch.Tensor, sampler_log_probs: torch.Tensor,
                       response_mask: torch.Tensor, cap: float, low: float | None = None,
                       high: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The weights of `preset` for π_old = exp(old_log_probs) against μ = exp(sampler_log_probs), (B, T)
    each, with `response_mask` (B, T) True on trained tokens; a null end of the band is the preset's
    `DEFAULT_BANDS` one. The one place the recipe picks a correction by name."""
    band_low, band_high = correction_band(preset, low, high)
    return ROLLOUT_CORRECTIONS.get(preset)(log_ratio=old_log_probs - sampler_log_probs, response_mask=response_mask,
                                           cap=cap, low=band_low, high=band_high)
