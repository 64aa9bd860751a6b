"""The one loop that trains any objective (hybridflow.training.objectives), shared by the trained roles
(workers/actor.py, workers/critic.py).

An update runs the objective's passes over a step's batch in mini-batches, one optimizer step each:
every micro-batch's forward and backward with FSDP2's gradient reduction held back where it can be,
the float16 loss scale and its retry of an overflowed backward (hybridflow.training.loss_scale),
clipping, then one scheduler step, and the gradients freed before whatever follows (a weight sync);
its statistics are weighed so that no micro-batch split changes
them (`micro_batch_stat`), read from the device once per mini-batch and averaged over mini-batches and
ranks. The objective says what is minimised and how a batch is cut; the loop says nothing about it.
"""

from __future__ import annotations

import torch

from hybridflow.algos import micro_batch_stat
from hybridflow.batch import Batch
from hybridflow.controller import Dispatch, register
from hybridflow.training.fsdp import accumulating, all_reduce_mean_dict, all_reduce_sum, read_floats
from hybridflow.training.loss_scale import clipped_step
from hybridflow.training.objectives.base import Objective, Split
from hybridflow.training.sequences import TOKEN_COUNTS
from hybridflow.training.shared_prompts import shares_prompts
from hybridflow.training.ulysses import data_group, data_parallel_size


class TrainingLoopMixin:
    """A worker that mixes this in has `ctx`, `cfg` (its role's config node: `samples_per_mini_batch`,
    `samples_per_micro_batch`, `tokens_per_micro_batch`, `epochs_per_step`, `optim.max_grad_norm`),
    `model`, `optimizer`, `scheduler`, `loss_scale` (a LossScale), `seed` and an `updates` counter. Its
    mini-batches are shuffled by a generator seeded `seed * shuffle_seed_stride + updates`: each role
    draws its own order."""

    shuffle_seed_stride = 100003

    def run_objective(self, batch: Batch, objective: Objective, role: str) -> dict:
        """`objective.epochs` (else `<role>.epochs_per_step`) passes over `batch` in its mini-batches
        (`<role>.samples_per_mini_batch` over the ranks, or the whole batch), an optimizer step each, then
        a scheduler step. Returns the objective's statistics averaged over mini-batches and ranks, the
        loop's own under the role's name (`<role>/loss`: each mini-batch's over all ranks,
        `<role>/grad_norm` before clipping, `<role>/lr` in force for the next update), the split's
        `perf/*_tokens` summed over mini-batches and ranks, and the objective's own (`results`)."""
        objective.check(batch)
        self.model.train()
        batch = batch.to(self.ctx.device)
        world = data_parallel_size(self.model, self.ctx.world_size)  # a sequence-parallel group's ranks: one share
        rows_per_mini = len(batch) if objective.whole_batch or not self.cfg.samples_per_mini_batch else \
            self.cfg.samples_per_mini_batch // world
        generator = torch.Generator().manual_seed(self.seed * self.shuffle_seed_stride + self.updates)
        refusal = f"{role} update {self.updates}; lower {role}.optim.lr {objective.fix}"
        totals: dict[str, float] = {}
        figures: dict[str, float] = {}  # the loop's own: the loss and the gradient norm
        computed: dict[str, float] = {}  # perf/*_tokens: summed over mini-batches and ranks, not averaged
        n_mini, first = 0, {}
        for _ in range(objective.epochs or self.cfg.epochs_per_step):
            for mini in objective.mini_batches(batch, rows_per_mini, generator, shares_prompts(self.model)):
                mini_stats, mini_figures = self.train_mini_batch(mini, objective, world, refusal)
                for k in [k for k in TOKEN_COUNTS if k in mini_stats]:
                    computed[k] = computed.get(k, 0) + mini_stats.pop(k)
                for k, v in mini_stats.items():
                    totals[k] = totals.get(k, 0.0) + v
                for k, v in mini_figures.items():
                    figures[k] = figures.get(k, 0.0) + v
                first = first or mini_stats
                n_mini += 1
        self.scheduler.step()
        self.updates += 1
        self.free_gradients()  # before the weight sync that follows: it holds no gradients
        stats = {k: v / n_mini for k, v in totals.items()}
        stats.update({f"{role}/{k}": v / n_mini for k, v in figures.items()})
        stats.update({name: first[key] for key, name in objective.first_mini_batch.items() if key in first})
        stats[f"{role}/lr"] = self.scheduler.get_last_lr()[0]
        reduced = all_reduce_mean_dict({**stats, **computed})
        return {**reduced, **{k: reduced[k] * world for k in computed}, **objective.results()}

    def free_gradients(self) -> None:
        """The update's gradients freed (set to None) once its last optimizer step is taken, so that the
        weight sync after it holds parameters, AdamW moments and the engine's weights but no gradients
        (hybridflow/checks/memory_budget.py, the GPU's "weight sync" phase). Nothing after an update reads them:
        its grad norm and loss are read already, the step hooks read those metrics, and the LoRA fold, the
        weight sync and the checksums read the parameters; the next mini-batch zeroes them anyway. A test
        that compares an update's gradients keeps them by replacing this on its worker."""
        self.optimizer.zero_grad(set_to_none=True)

    def train_mini_batch(self, mini: Batch, objective: Objective, world: int, refusal: str = "this update"
                         ) -> tuple[dict, dict]:
        """One optimizer step on a mini-batch cut by `objective.split`; a float16 backward that overflowed
        runs again at half the loss scale (hybridflow.training.loss_scale); a gradient norm that is not
        finite otherwise raises, naming `refusal`. Returns the objective's and the split's statistics, and
        the loop's figures: `loss`, the mini-batch's over all ranks, and `grad_norm` before clipping."""
        split = objective.split(self.model, mini, self.cfg.samples_per_micro_batch, self.cfg.tokens_per_micro_batch)
        grad_norm = None
        while grad_norm is None:
            stats, loss = self._accumulate(split, objective, world)
            grad_norm = clipped_step(self.model, self.optimizer, self.loss_scale, self.cfg.optim.max_grad_norm, refusal)
        stats.update(split.stats)
        return stats, {"loss": all_reduce_sum(loss, data_group(self.model)), "grad_norm": grad_norm}

    def _accumulate(self, split: Split, objective: Objective, world: int) -> tuple[dict, float]:
        """Zero the gradients, then every micro-batch's forward and backward (the loss times the loss
        scale and `world`, the data-parallel groups: FSDP averages over every rank, and the SP ranks of a
        sequence-parallel group each differentiate the same loss, hybridflow/training/ulysses.py). Returns the micro-batches' statistics
        weighed by their shares (`micro_batch_stat`) and their loss on this rank, read from the device once."""
        self.optimizer.zero_grad(set_to_none=True)
        objective.accumulation_started()
        loss_total, weighted = 0.0, {}
        for micro, share in accumulating(self.model, zip(split.micro_batches, split.shares)):
            loss, stats = objective.loss(self.model, micro, split.counts)  # nothing here waits for the device
            (loss * (world * self.loss_scale.scale)).backward()
            loss_total = loss_total + loss.detach()
            for k, v in stats.items():  # loss parts add up, means weigh by shares: no split changes them
                weighted[k] = weighted.get(k, 0.0) + micro_batch_stat(k, v, share, world)
        read = {**weighted, "loss": loss_total}
        read_floats(read)  # the one wait for the device in this mini-batch's micro-batches
        return {k: read[k] for k in weighted}, read["loss"]

    @register(Dispatch.ONE_TO_ALL)
    def scale_lr(self, factor: float) -> float:
        """Multiply the lr of the next update only (the scheduler sets the one after from its own
        formula): the `lr_burst` step hook's injected divergence. Returns the lr now in force."""
        for group in self.optimizer.param_groups:
            group["lr"] *= factor
        return self.optimizer.param_groups[0]["lr"]
