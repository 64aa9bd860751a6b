"""Supervised fine-tuning: cross-entropy on the response (answer) tokens, one optimizer step over the
whole batch (recipes/sft.py through `ActorWorker.train_sft`)."""

from __future__ import annotations

import torch

from hybridflow.algos import aggregate_loss
from hybridflow.batch import Batch
from hybridflow.training.objectives.base import Objective
from hybridflow.training.sequences import loss_mask, response_log_probs


class SFTObjective(Objective):
    epochs = 1
    whole_batch = True

    def loss(self, model: torch.nn.Module, micro: Batch, counts: dict[str, float]) -> tuple[torch.Tensor, dict]:
        log_probs, _ = response_log_probs(model, micro, with_entropy=False)
        nll = -log_probs
        loss = aggregate_loss(nll, loss_mask(micro), "token-mean", global_token_count=counts["global_token_count"])
        return loss, {}  # the mini-batch loss is reported as actor/loss
