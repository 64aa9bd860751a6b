"""Prompt batches for the step loop: shuffled per epoch, resumable from a saved position."""

from __future__ import annotations

from collections import deque

import torch


class PromptLoader:
    """Yields `prompts_per_step` rows at a time; each epoch is a fresh seeded permutation.

    `state_dict()` is (epoch, index into the epoch's permutation), plus what `requeue` changed:
    restoring it continues with exactly the rows an uninterrupted run would have drawn next.

    With `remember_batches` > 0 the loader keeps the row indices of its newest draws (with the
    step each was drawn for, when `next_rows` is told), and `requeue(n)` puts the rows of the
    newest n draws back (the `spike_recovery` step hook's `data: reshuffle`): they and the rest
    of the current epoch are drawn next, in a new seeded random order, so they are seen again but
    not as the same batches in the same sequence.
    """

    def __init__(self, rows: list, prompts_per_step: int, seed: int, remember_batches: int = 0) -> None:
        if prompts_per_step > len(rows):
            raise ValueError(f"trainer.prompts_per_step={prompts_per_step} is larger than the {len(rows)} training rows")
        self.rows, self.prompts_per_step, self.seed = rows, prompts_per_step, seed
        self.epoch, self.index = 0, 0
        self.queue: list[int] = []  # after a requeue: the rest of this epoch, in its new order
        self.requeues = 0
        self.last_picked: list[int] = []
        # newest draws, oldest first: (the step drawn for, or None; row indices)
        self.recent: deque[tuple[int | None, list[int]]] = deque(maxlen=remember_batches)

    def _order(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.rows), generator=generator).tolist()

    def next_rows(self, step: int | None = None) -> list:
        """The next `prompts_per_step` rows; `step`: the step they are drawn for (an asynchronous
        run draws ahead of the step it trains)."""
        if self.queue:
            picked, self.queue = self.queue[: self.prompts_per_step], self.queue[self.prompts_per_step :]
        else:
            if self.index + self.prompts_per_step > len(self.rows):  # drop the ragged tail of an epoch
                self.epoch, self.index = self.epoch + 1, 0
            picked = self._order(self.epoch)[self.index : self.index + self.prompts_per_step]
            self.index += self.prompts_per_step
        self.recent.append((step, picked))
        self.last_picked = picked  # the rows' indices, for the record of what a step trained on
        return [self.rows[i] for i in picked]

    def requeue(self, batches: int, through_step: int | None = None) -> int:
        """Put the rows of the newest `batches` draws back; returns how many rows went back. With
        `through_step`, draws made for later steps (batches in flight, drawn ahead) stay drawn,
        and the `batches` draws before them go back.

        They are shuffled together with the rest of the current epoch's whole batches (the
        ragged tail stays out, as it would have): every row comes back exactly once, and since
        whole batches went back, every later batch is whole too."""
        ahead = 0 if through_step is None else \
            sum(1 for step, _ in self.recent if step is not None and step > through_step)
        if not 1 <= batches <= len(self.recent) - ahead:
            raise ValueError(f"requeue({batches}): the loader remembers its last {len(self.recent)} draws, {ahead} of "
                             f"them drawn ahead (remember_batches={self.recent.maxlen}); build it with "
                             f"remember_batches >= {batches + ahead}")
        kept = [self.recent.pop() for _ in range(ahead)]
        back = [i for _ in range(batches) for i in self.recent.pop()[1]]
        self.recent.extend(reversed(kept))
        whole = len(self.rows) - len(self.rows) % self.prompts_per_step
        rest = self.queue + self._order(self.epoch)[self.index : whole]
        self.index, self.requeues = whole, self.requeues + 1
        self.queue = reshuffle(rest + back, seed=self.seed * 1_000_003 + self.epoch, salt=self.requeues)
        return len(back)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "queue": list(self.queue), "requeues": self.requeues,
                "recent": [{"step": step, "rows": list(batch)} for step, batch in self.recent]}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        # checkpoints written before requeue existed hold only (epoch, index)
        self.queue = [int(i) for i in state.get("queue", [])]
        self.requeues = int(state.get("requeues", 0))
        self.recent = deque((_draw(d) for d in state.get("recent", [])), maxlen=self.recent.maxlen)


def _draw(saved: dict | list) -> tuple[int | None, list[int]]:
    """A remembered draw from a checkpoint (a bare list of rows: saved before draws had steps)."""
    if isinstance(saved, dict):
        return saved["step"], [int(i) for i in saved["rows"]]
    return None, [int(i) for i in saved]


def reshuffle(indices: list[int], seed: int, salt: int) -> list[int]:
    """`indices` in a seeded random order (`salt` tells the requeues of one epoch apart)."""
    generator = torch.Generator().manual_seed(seed * 7_919 + salt)
    return [indices[i] for i in torch.randperm(len(indices), generator=generator).tolist()]
