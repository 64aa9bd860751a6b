"""Plain worker classes used by the controller tests (imported by Ray workers by module path)."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from hybridflow.batch import Batch
from hybridflow.controller import Dispatch, Execute, WorkerContext, register


class EchoWorker:
    def __init__(self, ctx: WorkerContext, scale: float = 1.0) -> None:
        self.ctx, self.scale = ctx, scale
        self.state = 0

    @register(Dispatch.ONE_TO_ALL)
    def whoami(self) -> dict:
        return {"rank": self.ctx.rank, "world_size": self.ctx.world_size, "pid": os.getpid(),
                "node_id": self.ctx.node_id, "backend": dist.get_backend(),
                "kernel_caches": {k: os.environ.get(k) for k in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")},
                "vllm_imported": "vllm.entrypoints.llm" in sys.modules}  # this worker never imports it

    @register(Dispatch.ONE_TO_ALL)
    def affinity(self) -> tuple[list[list[int]], int]:
        """The cores every thread of this process may run on, and torch's thread count."""
        import os

        import torch

        per_thread = []
        for tid in os.listdir("/proc/self/task"):
            try:
                per_thread.append(sorted(os.sched_getaffinity(int(tid))))
            except OSError:
                pass
        return per_thread, torch.get_num_threads()

    @register(Dispatch.ONE_TO_ALL)
    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return time.time()

    @register(Dispatch.ONE_TO_ALL)
    def all_reduce_rank(self) -> float:
        t = torch.tensor([float(self.ctx.rank + 1)])
        dist.all_reduce(t)
        return float(t.item())

    @register(Dispatch.DP_SPLIT)
    def double(self, batch: Batch) -> Batch:
        out = Batch({"x": batch["x"] * 2 * self.scale, "owner": torch.full((len(batch),), self.ctx.rank)},
                    {"tag": [f"{t}!" for t in batch["tag"]]})
        return out

    @register(Dispatch.DP_SPLIT)
    def add_one(self, batch: Batch) -> Batch:
        return Batch({"x": batch["x"] + 1})

    @register(Dispatch.RANK_ZERO)
    def rank_zero_value(self) -> int:
        return 100 + self.ctx.rank

    @register(Dispatch.ONE_TO_ALL, execute=Execute.RANK_ZERO)
    def only_rank_zero(self) -> int:
        return self.ctx.rank

    @register(Dispatch.ALL_TO_ALL)
    def take(self, item: int) -> int:
        return item * 10 + self.ctx.rank

    @register(Dispatch.ONE_TO_ALL)
    def set_state(self, value: int) -> None:
        self.state = value

    @register(Dispatch.ONE_TO_ALL)
    def get_state(self) -> int:
        return self.state

    @register(Dispatch.ONE_TO_ALL)
    def fail_on_rank(self, rank: int) -> float:
        """Rank `rank` raises; the others block in an all-reduce that can never complete."""
        if self.ctx.rank == rank:
            raise ValueError(f"deliberate failure on rank {rank}")
        t = torch.ones(1)
        dist.all_reduce(t)
        return float(t.item())


class CounterWorker:
    """A second role, colocated with EchoWorker in the fused-process test."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx

    @register(Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()


class BrokenInitWorker:
    def __init__(self, ctx: WorkerContext) -> None:
        raise RuntimeError("cannot build this worker")


class LingeringWorker:
    """Starts what libraries leave behind: a child process, and a thread that is not a daemon (Python's
    exit waits for it)."""

    def __init__(self, ctx: WorkerContext) -> None:
        import subprocess
        import threading

        self.child = subprocess.Popen(["sleep", "600"])
        threading.Thread(target=time.sleep, args=(600,)).start()

    @register(Dispatch.ONE_TO_ALL)
    def process_ids(self) -> tuple[int, int]:
        return os.getpid(), self.child.pid

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    @register(Dispatch.ONE_TO_ALL, blocking=False, lane="monitor")
    def hold_the_monitor_lane(self, seconds: float) -> None:
        """Blocks the lane the host's `end` runs on: a process that answers nothing."""
        time.sleep(seconds)
