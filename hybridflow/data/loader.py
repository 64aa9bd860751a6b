"""Prompt batches for the step loop: shuffled per epoch, resumable from a saved position."""

from __future__ import annotations

import torch


class PromptLoader:
    """Yields `prompts_per_step` rows at a time; each epoch is a fresh seeded permutation.

    `state_dict()` is (epoch, index into the epoch's permutation): restoring it continues with
    exactly the rows an uninterrupted run would have drawn next.
    """

    def __init__(self, rows: list[dict], prompts_per_step: int, seed: int) -> None:
        if prompts_per_step > len(rows):
            raise ValueError(f"trainer.prompts_per_step={prompts_per_step} is larger than the {len(rows)} training rows")
        self.rows, self.prompts_per_step, self.seed = rows, prompts_per_step, seed
        self.epoch, self.index = 0, 0

    def _order(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.rows), generator=generator).tolist()

    def next_rows(self) -> list[dict]:
        if self.index + self.prompts_per_step > len(self.rows):  # drop the ragged tail of an epoch
            self.epoch, self.index = self.epoch + 1, 0
        order = self._order(self.epoch)
        picked = order[self.index : self.index + self.prompts_per_step]
        self.index += self.prompts_per_step
        return [self.rows[i] for i in picked]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
