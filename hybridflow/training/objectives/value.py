"""The critic's objective: the clipped value loss (`clipped_value_loss`, PPO's value function loss) on
the returns, the values the critic computed before the update as the old ones (`CriticWorker.update_critic`).

Values are learned where the policy acts: on the sampled tokens (`loss_mask`), cut into micro-batches as
the policy's are (`token_split`, every row trained)."""

from __future__ import annotations

import torch

from hybridflow.algos import clipped_value_loss
from hybridflow.batch import Batch
from hybridflow.training.objectives.base import Objective, Split, token_split
from hybridflow.training.sequences import loss_mask, response_values


class ValueObjective(Objective):
    """`clip_range`: critic.value_clip_range (None: the plain squared error); `aggregation`:
    critic.loss_aggregation. Needs response tokens, `values` and `returns`. Statistics under `critic/`
    (`critic/value_loss`, `critic/value_clip_fraction`, `critic/value_mean`, `critic/return_mean`)."""

    needs = (*Objective.needs, "values", "returns")
    fix = "or check the returns for NaN"

    def __init__(self, clip_range: float | None, aggregation: str) -> None:
        self.clip_range, self.aggregation = clip_range, aggregation

    def split(self, model: torch.nn.Module, mini: Batch, samples_per_micro_batch: int,
              tokens_per_micro_batch: int | None) -> Split:
        """Collective: `token_split` of every row, without its statistics: a step's `perf/*_tokens` and
        `actor/trained_sample_fraction` are the actor's update's."""
        split = token_split(model, mini, samples_per_micro_batch, tokens_per_micro_batch)
        split.stats = {}
        return split

    def loss(self, model: torch.nn.Module, micro: Batch, counts: dict[str, float]) -> tuple[torch.Tensor, dict]:
        loss, stats = clipped_value_loss(
            values=response_values(model, micro), old_values=micro["values"], returns=micro["returns"],
            response_mask=loss_mask(micro), clip_range=self.clip_range, aggregation=self.aggregation, **counts)
        return loss, {f"critic/{k}": v for k, v in stats.items()}
