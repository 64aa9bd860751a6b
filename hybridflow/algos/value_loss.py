"""The critic's clipped value loss (PPO as in OpenAI baselines ppo2 / Ziegler et al. 2019).

L_t = ½ max((V_t - R_t)², (V_old,t + clip(V_t - V_old,t, -ε, ε) - R_t)²), aggregated over
response tokens. Clipping keeps one update from moving a value estimate more than ε
away from the one the advantages were computed with.
"""

from __future__ import annotations

import torch

from hybridflow.algos.aggregation import aggregate_loss
from hybridflow.algos.masked import check_mask, masked_mean


def clipped_value_loss(
    *,
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    clip_range: float | None = 0.2,
    aggregation: str = "token-mean",
    global_token_count: int | None = None,
    global_sequence_count: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss; all inputs (B, T), response_mask True = a real response token.

    `clip_range=None` gives the plain ½ (V - R)². Stats: `value_loss`, `value_clip_fraction`
    (tokens where the clipped branch is the larger one, so their gradient is 0),
    `value_mean`, `return_mean`.
    """
    check_mask(response_mask, values)
    if clip_range is not None and clip_range <= 0:
        raise ValueError(f"clip_range={clip_range} must be > 0, or None to turn value clipping off")
    old_values, returns = old_values.detach(), returns.detach()
    unclipped = (values - returns) ** 2
    if clip_range is None:
        squared, clipped = unclipped, torch.zeros_like(response_mask)
    else:
        clipped_values = old_values + (values - old_values).clamp(-clip_range, clip_range)
        clipped_squared = (clipped_values - returns) ** 2
        squared = torch.maximum(unclipped, clipped_squared)
        clipped = clipped_squared > unclipped
    loss = aggregate_loss(
        0.5 * squared,
        response_mask,
        aggregation,
        global_token_count=global_token_count,
        global_sequence_count=global_sequence_count,
    )
    with torch.no_grad():  # 0-dim tensors where the loss is: read once per mini-batch (hybridflow.algos)
        stats = {
            "value_loss": loss.detach(),
            "value_clip_fraction": masked_mean(clipped.float(), response_mask),
            "value_mean": masked_mean(values.detach(), response_mask),
            "return_mean": masked_mean(returns, response_mask),
        }
    return loss, stats
