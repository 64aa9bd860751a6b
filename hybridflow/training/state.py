"""The training state's methods shared by the trainable workers (actor, critic): its checkpoint saved and
loaded, and the whole model read or replaced (hybridflow.training.whole_model).

A worker that mixes this in has `ctx`, `model`, `optimizer`, `scheduler`, `dtype` (the compute dtype),
`loss_scale` (hybridflow.training.loss_scale) and an `updates` counter; the methods are collective over the worker's group (see hybridflow/checkpoint).
A checkpoint loads on another number of ranks than saved it (docs/checkpoints.md).
"""

from __future__ import annotations

import torch

from hybridflow.controller import Dispatch, register
from hybridflow.training import whole_model


class TrainingStateMixin:
    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, directory: str) -> None:
        """Collective: this rank's shard of model + optimizer, the scheduler, RNG, update count and
        float16's loss scale (a resume that started again at 2^16 would retry the backwards that the
        scale's first steps had backed off from, and its updates would differ)."""
        from hybridflow.checkpoint import save_training_state

        save_training_state(directory, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                            rank=self.ctx.rank, extra={"updates": self.updates,
                                                       "loss_scale": self.loss_scale.state_dict()})

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, directory: str) -> str | None:
        """Collective, on any number of ranks: a state saved by another rank count is resharded.
        Returns what that changed (`rank_change_note`), or None when the counts are equal."""
        from hybridflow.checkpoint import load_training_state, rank_change_note, saved_world_size

        extra = load_training_state(directory, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                                    rank=self.ctx.rank)
        self.updates = int((extra or {}).get("updates", 0))
        if "loss_scale" in (extra or {}):  # checkpoints before 2026-12-07 have none: the scale starts again
            self.loss_scale.load_state_dict(extra["loss_scale"])
        return rank_change_note(saved_world_size(directory), self.ctx.world_size)

    @register(Dispatch.RANK_ZERO)
    def full_state_dict(self) -> dict:
        """Collective: the full (unsharded) weights on the CPU, in the compute dtype (`model.dtype`, what
        the reference holds: the reference hooks merge the two); rank 0's copy is returned."""
        return whole_model.full_state_dict(self.model, self.dtype)

    @register(Dispatch.ONE_TO_ALL)
    def load_weights(self, weights: dict[str, torch.Tensor], reset_optimizer: bool = False) -> None:
        """Replace the weights with full tensors under Hugging Face names (e.g. a merge of checkpoints,
        from the `spike_recovery` step hook); `reset_optimizer` also clears Adam's moments."""
        whole_model.load_full_state_dict(self.model, weights, f"{type(self).__name__} rank {self.ctx.rank}")
        if reset_optimizer:
            self.optimizer.state.clear()
