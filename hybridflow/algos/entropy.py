"""Token log-probabilities and entropies from logits, and the entropy bonus.

Both work in float32 whatever the logits' dtype: bf16 log-softmax loses the small
differences between log-probs that the PPO ratio depends on. Half-precision logits are
upcast one sequence at a time, so without autograd (reference / old log-probs) the peak
float32 copy is (T, V), not (B, T, V); under autograd each row's float32 softmax is kept
for the backward pass anyway.
Logits must be finite (a -inf logit gives NaN entropy through 0 * -inf).
"""

from __future__ import annotations

from typing import Callable

import torch

from hybridflow.algos.aggregation import aggregate_loss
from hybridflow.algos.masked import check_mask


def _per_row_in_float32(fn: Callable[..., torch.Tensor], logits: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
    if logits.dtype in (torch.float32, torch.float64):
        return fn(logits, *rest)
    rows = [fn(row.float(), *(r[i] for r in rest)) for i, row in enumerate(logits)]
    return torch.stack(rows)


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    # H = -Σ p log p with log p = z - logsumexp(z)  =>  H = logsumexp(z) - Σ p z
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax of `logits` (B, T, V) -> (B, T), float32 (or float64)."""
    return _per_row_in_float32(_entropy, logits)


def _log_probs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    picked = logits.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def log_probs_from_logits(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token_ids]: logits (B, T, V), token_ids (B, T) int64 -> (B, T).

    `logits[:, t]` must be the distribution that produced `token_ids[:, t]` (the caller
    shifts the model output by one position).
    """
    if token_ids.shape != logits.shape[:-1]:
        raise ValueError(
            f"token_ids has shape {tuple(token_ids.shape)} but logits {tuple(logits.shape)}; token_ids "
            "must be (B, T) matching logits (B, T, V) (shift logits by one position first)"
        )
    if token_ids.dtype != torch.int64:
        raise TypeError(f"token_ids has dtype {token_ids.dtype}; pass token_ids.long()")
    return _per_row_in_float32(_log_probs, logits, token_ids)


def entropy_bonus(
    *,
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    coef: float,
    aggregation: str = "token-mean",
    global_token_count: int | None = None,
    global_sequence_count: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """coef * aggregate(H) over response tokens; the actor's loss is `policy_loss - bonus`.

    entropy (B, T) from `entropy_from_logits`, response_mask (B, T) bool (True = a real
    response token). Use the same aggregation and global counts as the policy loss so the
    two terms keep their ratio under any micro-batch split.
    """
    check_mask(response_mask, entropy)
    mean_entropy = aggregate_loss(
        entropy,
        response_mask,
        aggregation,
        global_token_count=global_token_count,
        global_sequence_count=global_sequence_count,
    )
    return coef * mean_entropy, {"entropy": float(mean_entropy.detach())}
