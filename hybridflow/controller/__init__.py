"""The single controller: resource pools, worker groups, dispatch modes, futures."""

from hybridflow.controller.decorators import Dispatch, Execute, register
from hybridflow.controller.errors import WorkerError, WorkerGroupBroken
from hybridflow.controller.pools import PoolSpec, ResourcePool
from hybridflow.controller.worker_group import (
    GroupFuture,
    RoleSpec,
    WorkerContext,
    WorkerGroup,
    spawn_workers,
    wait_all,
)

__all__ = [
    "Dispatch", "Execute", "register", "WorkerError", "WorkerGroupBroken", "PoolSpec", "ResourcePool",
    "GroupFuture", "RoleSpec", "WorkerContext", "WorkerGroup", "spawn_workers", "wait_all",
]
