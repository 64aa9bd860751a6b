"""Preference optimisation (DPO and its kin, `PREFERENCE_LOSSES`): one optimizer step over a pair batch
(hybridflow.data.preference), the loss the mean over every pair on every rank.

Each micro-batch holds `samples_per_micro_batch` sequences, i.e. half as many pairs, both halves of a
pair in one forward pass; its loss is its pairs' share of the mean over all pairs on all ranks, so the
gradient is the same for any micro-batch split or rank count (tests/unit/test_dpo_actor.py)."""

from __future__ import annotations

import torch

from hybridflow.algos.preference import LENGTH_NORMALISED, compute_preference_loss
from hybridflow.batch import Batch
from hybridflow.data.preference import pair_sequences, pair_sums
from hybridflow.training.fsdp import all_reduce_sum
from hybridflow.training.ulysses import data_group
from hybridflow.training.objectives.base import Objective, Split
from hybridflow.training.sequences import response_log_probs


class PreferenceObjective(Objective):
    """`loss`: a name of `PREFERENCE_LOSSES`; `beta`, `label_smoothing`, `simpo_gamma` as it takes them.
    Needs the pairs and their reference log-probs (B,), summed or per token for the length-normalised
    losses. Statistics under TRL's names (`rewards/chosen`, `rewards/margins`, `logps/chosen`, ...)."""

    needs = ("prompt_ids", "prompt_mask", "chosen_ids", "chosen_mask", "rejected_ids", "rejected_mask",
             "ref_chosen_log_probs", "ref_rejected_log_probs")
    epochs = 1
    whole_batch = True
    fix = "or dpo.beta"

    def __init__(self, loss: str, beta: float, label_smoothing: float = 0.0, simpo_gamma: float = 0.5) -> None:
        self.name, self.beta, self.label_smoothing, self.simpo_gamma = loss, beta, label_smoothing, simpo_gamma

    def mini_batches(self, batch: Batch, rows_per_mini_batch: int, generator: torch.Generator,
                     share: bool) -> list[Batch]:
        return [batch]  # one step over every pair, in order

    def split(self, model: torch.nn.Module, pairs: Batch, samples_per_micro_batch: int,
              tokens_per_micro_batch: int | None) -> Split:
        """Collective: micro-batches of `samples_per_micro_batch // 2` pairs; counts: `pairs`, over all ranks (each
        sequence-parallel group once)."""
        micros = pairs.split(max(1, samples_per_micro_batch // 2))
        pairs_over_ranks = all_reduce_sum(len(pairs), data_group(model))
        return Split(micros, [len(micro) / len(pairs) for micro in micros], {"pairs": pairs_over_ranks})

    def loss(self, model: torch.nn.Module, micro: Batch, counts: dict[str, float]) -> tuple[torch.Tensor, dict]:
        sequences = pair_sequences(micro)
        log_probs, _ = response_log_probs(model, sequences, with_entropy=False)
        chosen, rejected = pair_sums(log_probs, sequences["response_mask"], per_token=self.name in LENGTH_NORMALISED)
        mean_loss, stats = compute_preference_loss(
            self.name, chosen_log_probs=chosen, rejected_log_probs=rejected,
            ref_chosen_log_probs=micro["ref_chosen_log_probs"], ref_rejected_log_probs=micro["ref_rejected_log_probs"],
            beta=self.beta, label_smoothing=self.label_smoothing, simpo_gamma=self.simpo_gamma)
        return mean_loss * (len(micro) / counts["pairs"]), stats  # means over this micro-batch's pairs
