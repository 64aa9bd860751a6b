"""What a worker is told about its place in its group, and how it is built: plain dataclasses,
importable without Ray.

Workers are plain classes (STYLE 8): they import this, the decorators and the errors, never
Ray, so a worker file can be imported, built and tested in a process with no Ray installed
(the GPU checks in bench/gpu_check.py run the actor that way).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable


def _nothing_frees(callback: Callable[[], None]) -> None:
    """A worker built outside any host (a test, a bench): no teardown will run its callbacks."""


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
    replica_size: int = 1  # this role's ranks per replica (a tensor-parallel engine's TP; RoleSpec.replica_size)
    # `on_teardown(callback)`: run `callback` when the host frees this process's workers while the process lives on
    # (the one-process backend between stages; hybridflow/controller/hosts.py); a process that ends runs none
    on_teardown: Callable[[Callable[[], None]], None] = field(default=_nothing_frees, compare=False, repr=False)


@dataclass
class RoleSpec:
    """A worker class and the keyword arguments its constructor takes after the context.

    `replica_size`: ranks that work as one data-parallel replica (a tensor-parallel vLLM
    engine spans `replica_size` ranks). Data-parallel calls then split their Batch over the
    replicas, give every rank of a replica the same part, and collect from each replica's
    first rank.
    """

    cls: type
    kwargs: dict[str, Any] = field(default_factory=dict)
    replica_size: int = 1

    def build(self, ctx: WorkerContext) -> Any:
        """The worker for one rank (in a WorkerHost, hybridflow/controller/hosts.py, or in-process in a test)."""
        if self.replica_size != getattr(ctx, "replica_size", 1):
            ctx = replace(ctx, replica_size=self.replica_size)
        return self.cls(ctx, **self.kwargs)
