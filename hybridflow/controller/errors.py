"""Errors that cross process boundaries keep the worker class, method and rank that failed."""

from __future__ import annotations


class WorkerError(RuntimeError):
    """A worker method raised (or its process died) on some rank.

    The message names the group, the worker class, the method and the rank, and carries the
    remote traceback, so the driver's error says exactly where to look.
    """

    def __init__(self, group: str, worker_class: str, method: str, rank: int, world_size: int, detail: str):
        self.group, self.worker_class, self.method = group, worker_class, method
        self.rank, self.world_size, self.detail = rank, world_size, detail
        super().__init__(
            f"{worker_class}.{method} failed on rank {rank} of {world_size} in worker group {group!r}:\n{detail}"
        )

    def __reduce__(self):
        return (WorkerError, (self.group, self.worker_class, self.method, self.rank, self.world_size, self.detail))


class WorkerGroupBroken(RuntimeError):
    """A call on a worker group that already failed; its processes may be stuck in a collective."""


class CallTimeoutError(TimeoutError):
    """No result within a caller's `timeout_s` from the ranks it names (a stage's deadline raises
    `hybridflow.controller.deadlines.StageTimeoutError` instead)."""
