"""Dispatch metadata for worker methods.

A worker is a plain class. `@register(...)` on one of its methods records how the
controller turns one call into per-rank calls (the dispatch mode), which ranks run it (the
execute mode), whether the controller's call waits for the result, and in which lane of its
process it runs. Nothing here imports Ray: the metadata is read by
`hybridflow.controller.worker_group` when it wraps the class.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)

METHOD_SPEC_ATTR = "__hybridflow_method__"


class Dispatch(enum.Enum):
    ONE_TO_ALL = "one_to_all"  # every rank gets the same arguments; the result is a list per rank
    DP_SPLIT = "dp_split"  # Batch arguments are padded and split across ranks; Batch results concatenated
    RANK_ZERO = "rank_zero"  # every rank gets the same arguments; only rank 0's result is returned
    ALL_TO_ALL = "all_to_all"  # each argument is a list with one entry per rank; the result is a list per rank


class Execute(enum.Enum):
    ALL = "all"  # every rank runs the method (SPMD code with collectives)
    RANK_ZERO = "rank_zero"  # only rank 0 runs it (no collectives inside)


@dataclass(frozen=True)
class MethodSpec:
    dispatch: Dispatch
    execute: Execute
    blocking: bool
    lane: str | None = None


def register(
    dispatch: Dispatch = Dispatch.ONE_TO_ALL,
    execute: Execute = Execute.ALL,
    blocking: bool = True,
    lane: str | None = None,
) -> Callable[[F], F]:
    """Mark a worker method as callable from the controller.

    `blocking=False` makes the controller's plain call return a `GroupFuture`; every method
    can also be called non-blocking explicitly with `group.method.remote(...)`.
    `lane`: the method runs on a thread of its own named lane, one call at a time, beside the
    methods without a lane (which run one at a time on the default lane): a rollout receives
    weights on lane "weights" while it generates. The worker guards what the lanes share.
    """
    if execute is Execute.RANK_ZERO and dispatch in (Dispatch.DP_SPLIT, Dispatch.ALL_TO_ALL):
        raise ValueError(f"dispatch {dispatch.value} needs every rank; it cannot run with execute=rank_zero")

    def mark(fn: F) -> F:
        setattr(fn, METHOD_SPEC_ATTR, MethodSpec(dispatch, execute, blocking, lane))
        return fn

    return mark


def registered_methods(cls: type) -> dict[str, MethodSpec]:
    """The controller-callable methods of a worker class, by name (inherited ones included)."""
    specs = {}
    for name in dir(cls):
        spec = getattr(getattr(cls, name, None), METHOD_SPEC_ATTR, None)
        if isinstance(spec, MethodSpec):
            specs[name] = spec
    return specs


def lanes(classes) -> set[str]:
    """The lanes the registered methods of `classes` run on, besides the default one."""
    return {spec.lane for cls in classes for spec in registered_methods(cls).values() if spec.lane}
