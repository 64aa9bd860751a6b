"""Loss aggregation: how a (B, T) matrix of per-token losses becomes one scalar.

Gradient accumulation must not depend on how a mini-batch is split into micro-batches.
Each mode therefore divides by a count over the *whole mini-batch* when the caller passes
it (`global_token_count`, `global_sequence_count`); the micro-batch losses then sum to the
mini-batch loss exactly, so the caller sums them and must NOT divide by the number of
micro-batches. Without the global counts the local counts are used (one micro-batch).

Counting rules (the caller's global counts must follow them):
  - tokens: entries with mask True;
  - sequences: rows with at least one True entry, so the all-False padding rows that
    data-parallel chunking adds are not counted.

"seq-mean-token-sum-norm" (Dr. GRPO, Liu et al. 2025) divides each sequence's token sum by
a constant, which is the padded width T of `loss_mat`; it is split-invariant only when every
micro-batch is padded to the same width (e.g. the maximum response length).
"""

from __future__ import annotations

import torch

from hybridflow.algos.masked import check_mask, masked_sum
from hybridflow.registry import Registry

LOSS_AGGREGATIONS: Registry = Registry(
    "loss aggregation",
    signature=(
        "fn(loss_mat: (B, T) tensor, mask: (B, T) bool tensor, *, global_token_count: int | None "
        "= None, global_sequence_count: int | None = None) -> scalar tensor"
    ),
)


def _denominator(local: torch.Tensor, global_count: int | None, name: str) -> torch.Tensor | int:
    if global_count is None:
        return local.clamp(min=1)  # an all-padding micro-batch gives loss 0, not NaN
    if global_count <= 0:
        raise ValueError(
            f"{name}={global_count} must be a positive count over the whole mini-batch "
            f"(or None to use this micro-batch's own count)"
        )
    return global_count


def _sequence_count(mask: torch.Tensor) -> torch.Tensor:
    return mask.any(dim=-1).sum()


@LOSS_AGGREGATIONS.register("token-mean")
def token_mean(loss_mat, mask, *, global_token_count=None, global_sequence_count=None):
    """Σ_{i,t} m_it l_it / Σ_{i,t} m_it : every token weighs the same (DAPO's token-level loss)."""
    return masked_sum(loss_mat, mask) / _denominator(mask.sum(), global_token_count, "global_token_count")


@LOSS_AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(loss_mat, mask, *, global_token_count=None, global_sequence_count=None):
    """(1/N) Σ_i (Σ_t m_it l_it / Σ_t m_it) : every sequence weighs the same (GRPO paper, GSPO)."""
    per_sequence = masked_sum(loss_mat, mask, dim=-1) / mask.sum(dim=-1).clamp(min=1)  # (B,)
    count = _denominator(_sequence_count(mask), global_sequence_count, "global_sequence_count")
    return per_sequence.sum() / count


@LOSS_AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(loss_mat, mask, *, global_token_count=None, global_sequence_count=None):
    """(1/N) Σ_i Σ_t m_it l_it : mean over sequences of the summed token losses."""
    count = _denominator(_sequence_count(mask), global_sequence_count, "global_sequence_count")
    return masked_sum(loss_mat, mask) / count


@LOSS_AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(loss_mat, mask, *, global_token_count=None, global_sequence_count=None):
    """(1/N) Σ_i (Σ_t m_it l_it) / T with T = loss_mat.shape[-1] : Dr. GRPO's length-unbiased loss."""
    count = _denominator(_sequence_count(mask), global_sequence_count, "global_sequence_count")
    return masked_sum(loss_mat, mask) / (count * loss_mat.shape[-1])


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    aggregation: str = "token-mean",
    *,
    global_token_count: int | None = None,
    global_sequence_count: int | None = None,
) -> torch.Tensor:
    """Reduce `loss_mat` (B, T) over `mask` (B, T, True = counted) with the named mode."""
    check_mask(mask, loss_mat, name="mask")
    return LOSS_AGGREGATIONS.get(aggregation)(
        loss_mat, mask, global_token_count=global_token_count, global_sequence_count=global_sequence_count
    )


# Statistics that are a micro-batch's part of its mini-batch's loss: the loss functions normalise each
# micro-batch by the whole mini-batch's counts (on every rank), so these add up over micro-batches
# and ranks. Every other statistic is a mean within its micro-batch, weighted by its tokens. Under a
# role's namespace the name is the same statistic (`critic/value_loss`).
LOSS_PART_STATS = frozenset({"policy_loss", "kl_loss", "value_loss"})


def micro_batch_stat(key: str, value, token_share, world: int = 1):
    """One micro-batch's `value` of statistic `key`, as it adds into its mini-batch's figure: a loss
    part (`LOSS_PART_STATS`, under any namespace: `critic/value_loss`) as it is, times `world` (the figure is later averaged over ranks, and each rank holds its part
    of the loss, so the mean is their sum); any other statistic weighted by `token_share`, the
    micro-batch's share of the rank's trained tokens. Either way the figure does not depend on how
    the rows were split into micro-batches. Floats or 0-dim tensors (a tensor in, a tensor out)."""
    return value * world if key.rpartition("/")[2] in LOSS_PART_STATS else value * token_share
