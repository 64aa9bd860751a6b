"""The single controller: resource pools, worker groups, dispatch modes, futures.

What a worker file needs (the dispatch decorators, `WorkerContext`, `RoleSpec`, how the workers of one
process meet (`introduce`, `peer_with`), the errors) is imported eagerly and needs no Ray; the rest (pools,
worker groups, `wait_all`, the host protocol and Ray's host, hybridflow/controller/hosts.py) is imported
on first use, so importing a worker never imports Ray (STYLE 8: distribution is added from outside).
"""

from importlib import import_module

from hybridflow.controller.context import RoleSpec, WorkerContext, introduce, peer_with
from hybridflow.controller.decorators import Dispatch, Execute, register
from hybridflow.controller.errors import CallTimeoutError, WorkerError, WorkerGroupBroken

_RAY_SIDE = {
    "PoolSpec": "pools", "ResourcePool": "pools", "GroupFuture": "worker_group",
    "WorkerGroup": "worker_group", "spawn_workers": "ray_host", "wait_all": "worker_group", "Host": "hosts",
}

__all__ = ["Dispatch", "Execute", "register", "RoleSpec", "WorkerContext", "introduce", "peer_with", "WorkerError",
           "WorkerGroupBroken", "CallTimeoutError", *_RAY_SIDE]


def __getattr__(name: str):
    if name in _RAY_SIDE:
        return getattr(import_module(f"hybridflow.controller.{_RAY_SIDE[name]}"), name)
    raise AttributeError(f"module 'hybridflow.controller' has no attribute {name!r}")
