"""What a worker is told about its place in its group, and how it is built: plain dataclasses,
importable without Ray.

Workers are plain classes (STYLE 8): they import this, the decorators and the errors, never
Ray, so a worker file can be imported, built and tested in a process with no Ray installed
(the GPU checks in bench/gpu_check.py run the actor that way).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


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


@dataclass
class RoleSpec:
    """A worker class and the keyword arguments its constructor takes after the context.

    `replica_size`: ranks that work as one data-parallel replica (a tensor-parallel vLLM
    engine spans `replica_size` ranks). Data-parallel calls then split their Batch over the
    replicas, give every rank of a replica the same part, and collect from each replica's
    first rank.

    Roles that share a pool are built into one process. Once every role of the process is built, a
    worker class with a `meet(peers)` method is handed the others (`introduce`): that is how a worker
    finds a peer it works with in-process (the actor finds the rollout engine it sends colocated weights to).
    """

    cls: type
    kwargs: dict[str, Any] = field(default_factory=dict)
    replica_size: int = 1

    def build(self, ctx: WorkerContext) -> Any:
        """The worker for one rank (in a WorkerHost, hybridflow/controller/hosts.py, or in-process in a test)."""
        if self.replica_size != getattr(ctx, "replica_size", 1):
            ctx = replace(ctx, replica_size=self.replica_size)
        return self.cls(ctx, **self.kwargs)


def introduce(workers: list) -> None:
    """Hand each worker that has a `meet(peers)` method the other workers of its process, once, after
    all of them are built (a host does it: hybridflow/controller/hosts.py; a test or a bench that builds
    workers in-process does it itself). A worker keeps the peer that has the capability it needs
    (`peer_with`), never a role's name, and holds nothing from it until it calls it."""
    for worker in workers:
        meet = getattr(worker, "meet", None)
        if meet is not None:
            meet([peer for peer in workers if peer is not worker])


def peer_with(peers: list, capability: type) -> Any:
    """The one of `peers` that has `capability` (a `typing.runtime_checkable` Protocol), or None when
    none has; a ValueError when several have, naming them (a process builds each role once)."""
    found = [peer for peer in peers if isinstance(peer, capability)]
    if len(found) > 1:
        raise ValueError(f"{len(found)} workers of this process are a {capability.__name__} "
                         f"({', '.join(type(p).__name__ for p in found)}); a worker meets one: build one of them per "
                         "process (placement.roles: give the others a pool of their own)")
    return found[0] if found else None
