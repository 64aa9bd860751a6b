"""Token log-probabilities and entropies from logits, and the entropy bonus.

Both work in float32 whatever the logits' dtype: bf16 log-softmax loses the small
differences between log-probs that the PPO ratio depends on. Half-precision logits are
upcast one sequence at a time, so without autograd (reference / old log-probs) the peak
float32 copy is (T, V), not (B, T, V); under autograd each row's float32 softmax is kept
for the backward pass anyway.
Logits must be finite (a -inf logit gives NaN entropy through 0 * -inf).

`token_log_probs_and_entropy` is what the workers call: both quantities from one pass over
each chunk of rows' vocabulary, in float32. Chunks hold up to `FLOAT32_CHUNK_BYTES` of float32
logits; when a micro-batch needs more than one chunk, each chunk is recomputed in the backward pass
under autograd (activation checkpointing) instead of keeping its float32 copy, softmax and
products. A large micro-batch's logits then exist once, in the model's compute dtype: for SmolLM2's
49,152-token vocabulary and 16 x 64 response tokens that is 0.2 GB in bfloat16, against ~1.2 GB
for a float32 copy, its softmax and the entropy's product kept for the backward pass.
A micro-batch whose float32 logits fit one chunk (a small vocabulary, short answers) is computed
in one call without recomputation: a chunk per row and a checkpoint per chunk cost more time
than they save memory there (the tiny model's SFT step: 128 checkpointed rows took 1.6x a plain
loop's step, bench/sft_step.py). `with_entropy=False` (SFT's loss needs none) skips the softmax
product.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.utils.checkpoint

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


FLOAT32_CHUNK_BYTES = 64 * 2 ** 20  # float32 logits reduced at once (a chunk of rows)
# On CUDA a 64 MiB chunk is ~110 tokens of a 151,936-token vocabulary: the packed policy update at
# Qwen2.5-0.5B shapes on an H200 took 2.12 s so and 1.72 s with the vocabulary in one chunk per
# micro-batch (peak 21.3 -> 32.9 GiB; the plain loop's 43.7), bench/gpu_check.py --diagnose. 1 GiB
# (~1,800 such tokens a chunk): 1.18 s against one chunk's 1.09 s, peak 32.0 against 44.5 GiB (and
# 4% slower, 12.5 GiB less at 1.5B; docs/results/gpu.md "No host waits inside a micro-batch").
CUDA_FLOAT32_CHUNK_BYTES = 2 ** 30


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    z = logits.float()
    return z / temperature if temperature > 0 and temperature != 1.0 else z


def _chunk_log_probs_and_entropy(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float,
                                 with_entropy: bool, entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    z = _tempered(logits, temperature)
    lse = torch.logsumexp(z, dim=-1)
    log_probs = z.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return log_probs, torch.zeros_like(log_probs)
    with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):  # last: a recompute stops before it
        entropy = lse - (torch.softmax(z, dim=-1) * z).sum(dim=-1)  # H = logsumexp(z) - sum p z
    return log_probs, entropy


def tempered_log_softmax_at(logits: torch.Tensor, position: int, *, temperature: float = 1.0,
                            rows_per_chunk: int | None = None) -> torch.Tensor:
    """log softmax(logits[:, position] / temperature): logits (B, T, V) -> (B, V) float32, computed as
    `token_log_probs_and_entropy` computes every position of the same logits (the same chunks of rows,
    the tempered float32 logits and their logsumexp over the vocabulary at every position of a chunk),
    so that its entry at any token is bitwise the log-prob that function returns for that token at
    `position`: a reduction over a tensor of another shape (the one position alone) may add in another
    order. The exact rollout engine samples from it (hybridflow/training/exact_layout.py)."""
    rows = rows_per_chunk or rows_per_float32_chunk(logits.shape, on_cuda=logits.is_cuda)
    parts = []
    for chunk in logits.split(rows):
        z = _tempered(chunk, temperature)
        lse = torch.logsumexp(z, dim=-1)  # (b, T): every position's, as token_log_probs_and_entropy reduces
        parts.append(z[:, position] - lse[:, position, None])
    return torch.cat(parts)


def rows_per_float32_chunk(logits_shape: torch.Size, on_cuda: bool = False) -> int:
    """Rows of (B, T, V) logits whose float32 copy fits `FLOAT32_CHUNK_BYTES`
    (`CUDA_FLOAT32_CHUNK_BYTES` on a GPU; at least 1)."""
    row_bytes = 4 * max(1, logits_shape[1] * logits_shape[2])
    return max(1, (CUDA_FLOAT32_CHUNK_BYTES if on_cuda else FLOAT32_CHUNK_BYTES) // row_bytes)


def token_log_probs_and_entropy(logits: torch.Tensor, token_ids: torch.Tensor, *, temperature: float = 1.0,
                                rows_per_chunk: int | None = None, with_entropy: bool = True,
                                entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits / temperature)[token_ids] and the entropy of softmax(logits / temperature):
    logits (B, T, V) in any float dtype, token_ids (B, T) int64 -> two (B, T) float32 tensors (the
    entropy all 0 when `with_entropy` is False; outside autograd when `entropy_grad` is False: a
    metric, not a loss term, so no backward pass keeps or recomputes it). `temperature` 0 or 1
    leaves the logits as they are. Computed `rows_per_chunk` rows at a time (None: as many as
    `FLOAT32_CHUNK_BYTES` holds, `CUDA_FLOAT32_CHUNK_BYTES` on a GPU); with autograd and more than one chunk, each chunk is recomputed in
    the backward pass (see the module docstring). The chunks are `torch.split` views, whose backward
    is one concatenation: a chunk taken by indexing would give its gradient as a zero-filled
    tensor of the whole micro-batch's logits, one per chunk (on an H200 at Qwen2.5-0.5B's 151,936
    tokens and 16 rows of 512 that doubled the policy update, bench/gpu_check.py)."""
    if token_ids.shape != logits.shape[:-1]:
        raise ValueError(f"token_ids has shape {tuple(token_ids.shape)} but logits {tuple(logits.shape)}; token_ids "
                         "must be (B, T) matching logits (B, T, V) (shift logits by one position first)")
    if token_ids.dtype != torch.int64:
        raise TypeError(f"token_ids has dtype {token_ids.dtype}; pass token_ids.long()")
    rows = rows_per_chunk or rows_per_float32_chunk(logits.shape, on_cuda=logits.is_cuda)
    recompute = torch.is_grad_enabled() and logits.requires_grad and logits.shape[0] > rows
    parts = []
    for chunk, ids in zip(logits.split(rows), token_ids.split(rows)):
        args = (chunk, ids, temperature, with_entropy, entropy_grad)
        parts.append(torch.utils.checkpoint.checkpoint(_chunk_log_probs_and_entropy, *args, use_reentrant=False)
                     if recompute else _chunk_log_probs_and_entropy(*args))
    if not parts:
        empty = logits.new_zeros(token_ids.shape, dtype=torch.float32)
        return empty, empty.clone()
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


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
