"""What the training loop (hybridflow.training.loop) asks of an objective (`Objective`), and the usual
cut of a mini-batch into micro-batches by response tokens (`token_split`).

Gradient accumulation is invariant to the micro-batch split: the loss of every micro-batch is
normalised by counts over the whole mini-batch on all ranks (`Split.counts`, over the data-parallel
group: the ranks of a sequence-parallel group hold the same rows), and the loop multiplies it by the
number of data-parallel groups to undo FSDP's gradient averaging (hybridflow/training/ulysses.py), so one micro-batch or four give the same
gradients (tests/unit/test_gradient_splits.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hybridflow.batch import Batch
from hybridflow.training.fsdp import all_reduce_sum
from hybridflow.training.packing import runs_packed
from hybridflow.training.sequences import computed_tokens, loss_mask, micro_batch_rows, mini_batches, row_facts
from hybridflow.training.shared_prompts import shares_prompts
from hybridflow.training.ulysses import data_group


@dataclass
class Split:
    """One mini-batch as this rank runs it: its micro-batches in order; each one's share of the rank's
    mini-batch (`micro_batch_stat` weighs its statistics by it); the counts over all ranks its loss is
    normalised by (handed to `Objective.loss`); and the split's own statistics for the mini-batch."""

    micro_batches: list[Batch]
    shares: list
    counts: dict[str, float]
    stats: dict = field(default_factory=dict)


class Objective:
    """A training objective, built for one update call (it may gather what it reports over that call).

    The loop runs `epochs` passes (None: the role's `epochs_per_step`) over the step's batch cut by
    `mini_batches` (each `samples_per_mini_batch // world` rows, or the whole batch with `whole_batch`),
    one optimizer step each; `split` cuts a mini-batch into micro-batches; `loss` is each micro-batch's
    loss, its part of the mini-batch's loss (normalised by `split`'s counts), with its statistics as
    0-dim tensors or floats. `fix` is said when a gradient is not finite; `first_mini_batch` names
    statistics of the first mini-batch, taken before any optimizer step, reported besides their
    average over the mini-batches ({statistic: the name it is reported under})."""

    needs: tuple[str, ...] = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
    epochs: int | None = None
    whole_batch = False
    fix = "or check the advantages/rewards for NaN"
    first_mini_batch: dict[str, str] = {}

    def check(self, batch: Batch) -> None:
        """Refuse a batch without a column in `needs`, naming them."""
        missing = [k for k in self.needs if k not in batch]
        if missing:
            raise KeyError(f"{type(self).__name__} needs the batch columns {missing}, which this batch lacks (it "
                           f"has {sorted(batch.keys())}); compute them before the update (hybridflow.batch_keys)")

    def mini_batches(self, batch: Batch, rows_per_mini_batch: int, generator: torch.Generator,
                     share: bool) -> list[Batch]:
        """Shuffled mini-batches of `rows_per_mini_batch` rows (hybridflow.training.sequences.mini_batches)."""
        return mini_batches(batch, rows_per_mini_batch, generator, share)

    def split(self, model: torch.nn.Module, mini: Batch, samples_per_micro_batch: int,
              tokens_per_micro_batch: int | None) -> Split:
        """Collective: `mini` cut by response tokens (`token_split`)."""
        return token_split(model, mini, samples_per_micro_batch, tokens_per_micro_batch)

    def accumulation_started(self) -> None:
        """Before each pass over a mini-batch's micro-batches (a float16 overflow runs the pass again)."""

    def loss(self, model: torch.nn.Module, micro: Batch, counts: dict[str, float]) -> tuple[torch.Tensor, dict]:
        raise NotImplementedError(f"{type(self).__name__} must define loss(model, micro, counts)")

    def results(self) -> dict[str, float]:
        """After the update: statistics the objective gathered itself, already combined over ranks."""
        return {}


def token_split(model: torch.nn.Module, mini: Batch, samples_per_micro_batch: int, tokens_per_micro_batch: int | None,
                keep: Callable[[Batch], Batch] | None = None) -> Split:
    """Collective: `mini`'s trained rows (`keep(mini)`, else all) in micro-batches by token budget
    (`micro_batch_rows`, packed or padded as the model runs). Counts: `global_token_count` and
    `global_sequence_count`, the loss-masked tokens and sequences of the whole mini-batch on all ranks;
    shares: each micro-batch's part of the rank's trained tokens. Statistics: `perf/*_tokens`
    (`computed_tokens`) and `actor/trained_sample_fraction`."""
    mask = loss_mask(mini)
    group = data_group(model)  # a sequence-parallel group's ranks hold the same rows: counted once
    tokens = all_reduce_sum(int(mask.sum()), group)
    seqs = all_reduce_sum(int(mask.any(dim=1).sum()), group)
    if tokens == 0:
        raise ValueError("a mini-batch has no response tokens on any rank; check rollout.max_response_tokens")
    trained = keep(mini) if keep is not None else mini
    packed, share = runs_packed(model), shares_prompts(model)
    facts = row_facts(trained, share=packed and share)
    rows = micro_batch_rows(trained, samples_per_micro_batch, tokens_per_micro_batch, packed, share, facts)
    micros = [trained.index(r) for r in rows]
    trained_tokens = loss_mask(trained).sum().clamp(min=1)
    stats = {**computed_tokens(facts, rows, packed), "actor/trained_sample_fraction": len(trained) / len(mini)}
    return Split(micros, [loss_mask(micro).sum() / trained_tokens for micro in micros],
                 {"global_token_count": tokens, "global_sequence_count": seqs}, stats)
