"""Start a test's ranks as processes of their own, forked from one forkserver per test process.

A spawned rank is a fresh interpreter that imports torch, transformers and the test's module before its
first line (4-6 s of a 2-core CPU each); multiprocessing's forkserver (a clean process started once,
without the test process's threads or state) imports them once and forks every later rank from there.
The forkserver takes its environment and its preloaded modules from the first start in the test
process; a test that sets the ranks' environment (or needs a module not preloaded imported afresh)
spawns them instead."""

from __future__ import annotations

import multiprocessing

# What the ranks of the tests import: torch's collectives and checkpoints, the tiny model's code, the actor
PRELOAD = ["torch.distributed.checkpoint", "transformers.models.qwen2.modeling_qwen2", "workers.actor",
           "hybridflow.checkpoint"]


def start_ranks(fn, args: tuple, nprocs: int, preload: list[str] = ()) -> None:
    """`fn(rank, *args)` in `nprocs` processes forked from the forkserver; returns when all have exited
    (torch.multiprocessing raises, naming the rank, if one fails)."""
    import torch.multiprocessing as mp

    multiprocessing.get_context("forkserver").set_forkserver_preload([*PRELOAD, *preload])
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")
