"""What a worker is told about its place in its group: a plain dataclass, importable without Ray.

Workers are plain classes (STYLE 8): they import this, the decorators and the errors, never
Ray, so a worker file can be imported, built and tested in a process with no Ray installed
(the GPU checks in bench/gpu_check.py run the actor that way).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerContext:
    """What a worker is told about its place: given explicitly, never read from the environment.

    When the worker is built, the default torch.distributed process group of its process is
    already initialised over the ranks of its group (gloo on CPU, NCCL on GPU).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    node_id: str = "local"
    device: str = "cpu"
    backend: str = "gloo"
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    group_name: str = "local"  # the worker group's name: roles fused into one process share it
