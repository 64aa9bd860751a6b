"""Checkpoint methods shared by the trainable workers (actor, critic).

A worker that mixes this in has `ctx`, `model`, `optimizer`, `scheduler` and an `updates`
counter; the methods are collective over the worker's group (see hybridflow/checkpoint). A
checkpoint loads on another number of ranks than saved it (docs/checkpoints.md).
"""

from __future__ import annotations

from hybridflow.controller import Dispatch, register


class TrainingStateMixin:
    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, directory: str) -> None:
        """Collective: this rank's shard of model + optimizer, the scheduler, RNG and update count."""
        from hybridflow.checkpoint import save_training_state

        save_training_state(directory, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                            rank=self.ctx.rank, extra={"updates": self.updates})

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, directory: str) -> str | None:
        """Collective, on any number of ranks: a state saved by another rank count is resharded.
        Returns what that changed (`rank_change_note`), or None when the counts are equal."""
        from hybridflow.checkpoint import load_training_state, rank_change_note, saved_world_size

        extra = load_training_state(directory, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                                    rank=self.ctx.rank)
        self.updates = int((extra or {}).get("updates", 0))
        return rank_change_note(saved_world_size(directory), self.ctx.world_size)
