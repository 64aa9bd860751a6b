"""Reductions over the valid entries of a tensor, selected by a boolean mask.

Every function takes `mask` with `True` = a valid entry (for response tensors: a real
response token). Masked-out entries are never read arithmetically (they go through
`torch.where`, not a multiplication), so padding that holds NaN or Inf cannot leak in.
"""

from __future__ import annotations

import torch


def check_mask(mask: torch.Tensor, like: torch.Tensor, *, name: str = "response_mask") -> None:
    """Raise if `mask` is not a bool tensor with the shape of `like`."""
    if mask.dtype != torch.bool:
        raise TypeError(
            f"{name} has dtype {mask.dtype}; it must be torch.bool (True = a real response "
            f"token): pass `{name}.bool()` or build it with a comparison"
        )
    if mask.shape != like.shape:
        raise ValueError(
            f"{name} has shape {tuple(mask.shape)} but the tensor it masks has shape "
            f"{tuple(like.shape)}; both must be (B, T) over the same response tokens"
        )


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ values[mask], over `dim` (or everything when `dim` is None)."""
    kept = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of values[mask] over `dim`; a slice with no valid entry gives 0 (not NaN)."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, *, unbiased: bool = True) -> torch.Tensor:
    """Variance of all values[mask] (Bessel-corrected when `unbiased`).

    With fewer than two valid entries the unbiased variance is undefined; 0 is returned so
    that whitening a one-token batch gives zeros instead of NaN.
    """
    count = mask.sum()
    mean = masked_sum(values, mask) / count.clamp(min=1)
    squares = masked_sum((values - mean) ** 2, mask)
    denominator = (count - 1) if unbiased else count
    return torch.where(denominator > 0, squares / denominator.clamp(min=1), torch.zeros_like(squares))


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """(x - mean) / (std + eps) with mean and unbiased std over values[mask]; 0 where masked.

    Shapes: values (B, T), mask (B, T) bool -> (B, T).
    """
    mean = masked_mean(values, mask)
    std = masked_var(values, mask).sqrt()
    whitened = (values - mean) / (std + eps)
    return torch.where(mask, whitened, torch.zeros_like(whitened))
