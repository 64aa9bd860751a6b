"""Prompt batches for the step loop: shuffled per epoch, resumable from a saved position."""

from __future__ import annotations

from collections import deque

import torch


class PromptLoader:
    """Yields `prompts_per_step` rows at a time; each epoch is a fresh seeded permutation.

    `state_dict()` is (epoch, index into the epoch's permutation), plus what `requeue` changed:
    restoring it continues with exactly the rows an uninterrupted run would have drawn next.

    With `remember_batches` > 0 the loader keeps the row indices of its newest draws, and
    `requeue(n)` puts the rows of the newest n draws back (the `spike_recovery` step hook's
    `data: reshuffle`): they and the rest of the current epoch are drawn next, in a new seeded
    random order, so they are seen again but not as the same batches in the same sequence.
    """

    def __init__(self, rows: list, prompts_per_step: int, seed: int, remember_batches: int = 0) -> None:
        if prompts_per_step > len(rows):
            raise ValueError(f"trainer.prompts_per_step={prompts_per_step} is larger than the {len(rows)} training rows")
        self.rows, self.prompts_per_step, self.seed = rows, prompts_per_step, seed
        self.epoch, self.index = 0, 0
        self.queue: list[int] = []  # after a requeue: the rest of this epoch, in its new order
        self.requeues = 0
        self.recent: deque[list[int]] = deque(maxlen=remember_batches)  # newest draws, oldest first

    def _order(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.rows), generator=generator).tolist()

    def next_rows(self) -> list:
        if self.queue:
            picked, self.queue = self.queue[: self.prompts_per_step], self.queue[self.prompts_per_step :]
        else:
            if self.index + self.prompts_per_step > len(self.rows):  # drop the ragged tail of an epoch
                self.epoch, self.index = self.epoch + 1, 0
            picked = self._order(self.epoch)[self.index : self.index + self.prompts_per_step]
            self.index += self.prompts_per_step
        self.recent.append(picked)
        return [self.rows[i] for i in picked]

    def requeue(self, batches: int) -> int:
        """Put the rows of the newest `batches` draws back; returns how many rows went back.

        They are shuffled together with the rest of the current epoch's whole batches (the
        ragged tail stays out, as it would have): every row comes back exactly once, and since
        whole batches went back, every later batch is whole too."""
        if not 1 <= batches <= len(self.recent):
            raise ValueError(f"requeue({batches}): the loader remembers its last {len(self.recent)} draws "
                             f"(remember_batches={self.recent.maxlen}); build it with remember_batches >= {batches}")
        back = [i for _ in range(batches) for i in self.recent.pop()]
        whole = len(self.rows) - len(self.rows) % self.prompts_per_step
        rest = self.queue + self._order(self.epoch)[self.index : whole]
        self.index, self.requeues = whole, self.requeues + 1
        self.queue = reshuffle(rest + back, seed=self.seed * 1_000_003 + self.epoch, salt=self.requeues)
        return len(back)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "queue": list(self.queue), "requeues": self.requeues,
                "recent": [list(batch) for batch in self.recent]}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        # checkpoints written before requeue existed hold only (epoch, index)
        self.queue = [int(i) for i in state.get("queue", [])]
        self.requeues = int(state.get("requeues", 0))
        self.recent = deque(([int(i) for i in batch] for batch in state.get("recent", [])), maxlen=self.recent.maxlen)


def reshuffle(indices: list[int], seed: int, salt: int) -> list[int]:
    """`indices` in a seeded random order (`salt` tells the requeues of one epoch apart)."""
    generator = torch.Generator().manual_seed(seed * 7_919 + salt)
    return [indices[i] for i in torch.randperm(len(indices), generator=generator).tolist()]
