"""Worker groups: one controller call becomes per-rank calls on the ranks' hosts.

A `WorkerGroup` is the ranks of one role, each behind a `Host` (hybridflow/controller/hosts.py: the
protocol; `spawn_workers` in ray_host.py makes Ray's, `spawn_local` in local.py the one-process
backend's). Calling `group.method(batch)` splits the arguments by the method's dispatch mode, submits
the call to the hosts of the ranks its execute mode names, and gathers the results;
`group.method.remote(batch)` returns a `GroupFuture` instead, which can be passed straight into
another group's call: its data then moves between the hosts (`Host.apply`), never through the
controller.

Failures: the ranks' results are awaited together (`Host.ready`), so the first rank that raises is
reported at once as a `WorkerError` naming the class, method and rank, with the remote traceback,
even while the other ranks are still blocked in a collective waiting for it. Every wait ends by a
deadline (`wait_all`, hybridflow/controller/deadlines.py). Nothing here knows which backend runs.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Sequence

from hybridflow.batch import Batch
from hybridflow.controller import deadlines
from hybridflow.controller.decorators import Dispatch, Execute, MethodSpec, registered_methods
from hybridflow.controller.errors import CallTimeoutError, WorkerError, WorkerGroupBroken
from hybridflow.controller.hosts import Host

if TYPE_CHECKING:
    from hybridflow.controller.pools import ResourcePool


# ---- moving futures between groups without the controller ------------------------------------


def _gather(dispatch: Dispatch, pad: int, *parts: Any) -> Any:
    return _collect(dispatch, list(parts), pad)


def _gather_and_split(dispatch: Dispatch, pad: int, ranks: int, *parts: Any) -> tuple:
    batch = _collect(dispatch, list(parts), pad)
    if not isinstance(batch, Batch):
        raise TypeError(f"a data-parallel call needs a Batch argument, the future holds {type(batch).__name__}")
    padded, new_pad = batch.pad_to_multiple(ranks)
    return (*padded.chunk(ranks), new_pad)


def _collect(dispatch: Dispatch, results: list[Any], pad: int) -> Any:
    if dispatch is Dispatch.RANK_ZERO:
        return results[0]
    if dispatch is Dispatch.DP_SPLIT and results and all(isinstance(r, Batch) for r in results):
        return Batch.concat(results).unpad(pad)
    return results


class GroupFuture:
    """Pending results of one call on a worker group, one host reference per rank that ran it."""

    def __init__(self, group: "WorkerGroup", method: str, spec: MethodSpec, refs: list, ranks: list[int],
                 pad: Any) -> None:
        self.group, self.method, self.spec = group, method, spec
        self.refs, self.ranks, self.pad = refs, ranks, pad  # pad: rows, or a reference to them (`split_refs`)
        self.deadline = deadlines.current()  # the submitting stage's: kept when awaited in a later stage

    def get(self, timeout_s: float | None = None) -> Any:
        return wait_all([self], timeout_s)[0]

    def collect(self, results: list) -> Any:
        """The call's result from every rank's result (in rank order)."""
        pad = self.pad if isinstance(self.pad, int) else self.group.hosts[0].value(self.pad)
        if self.spec.execute is Execute.RANK_ZERO:
            return results[0]
        if self.spec.dispatch is Dispatch.DP_SPLIT:
            results = results[:: self.group.replica_size]  # one rank per replica
        return _collect(self.spec.dispatch, results, pad)

    def _data_refs(self) -> list:
        if self.spec.dispatch is Dispatch.DP_SPLIT:
            return self.refs[:: self.group.replica_size]
        return self.refs

    def single_ref(self) -> Any:
        """One reference to the gathered result (gathered by the hosts, not the controller)."""
        if self.spec.execute is Execute.RANK_ZERO or self.spec.dispatch is Dispatch.RANK_ZERO:
            return self.refs[0]
        return self.group.hosts[0].apply(_gather, (self.spec.dispatch, self.pad, *self._data_refs()))[0]

    def split_refs(self, ranks: int) -> tuple[list, Any]:
        """`ranks` references to equal chunks of the gathered Batch, and the pad they carry."""
        refs = self._data_refs()
        if self.spec.dispatch is Dispatch.DP_SPLIT and len(refs) == ranks:
            return list(refs), self.pad
        out = self.group.hosts[0].apply(_gather_and_split, (self.spec.dispatch, self.pad, ranks, *refs), ranks + 1)
        return out[:ranks], out[ranks]


# ---- the group --------------------------------------------------------------------------------


class _GroupMethod:
    def __init__(self, group: "WorkerGroup", name: str, spec: MethodSpec) -> None:
        self.group, self.name, self.spec = group, name, spec

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        future = self.remote(*args, **kwargs)
        return future.get() if self.spec.blocking else future

    def remote(self, *args: Any, **kwargs: Any) -> GroupFuture:
        return self.group._submit(self.name, self.spec, args, kwargs)


class WorkerGroup:
    """The ranks of one role, one `Host` each. Methods marked with `@register` are callable on the group."""

    def __init__(self, name: str, role: str, worker_cls: type, hosts: list[Host], infos: list[dict],
                 pool: ResourcePool | None = None, replica_size: int = 1) -> None:
        if len(hosts) % replica_size:
            raise ValueError(f"worker group {name!r}: {len(hosts)} ranks do not form replicas of {replica_size}")
        self.name, self.role, self.worker_cls = name, role, worker_cls
        self.hosts, self.infos, self.pool = hosts, infos, pool
        self.replica_size = replica_size
        self._methods = registered_methods(worker_cls)
        self._broken: str | None = None

    @property
    def world_size(self) -> int:
        return len(self.hosts)

    def __getattr__(self, name: str) -> _GroupMethod:
        methods = self.__dict__.get("_methods", {})
        if name in methods:
            return _GroupMethod(self, name, methods[name])
        raise AttributeError(
            f"{self.__dict__.get('worker_cls', type(None)).__name__} has no controller-callable method {name!r}; "
            f"registered: {sorted(methods)} (mark a method with @register to call it from the controller)"
        )

    def _submit(self, method: str, spec: MethodSpec, args: tuple, kwargs: dict) -> GroupFuture:
        if self._broken:
            raise WorkerGroupBroken(f"worker group {self.name!r} failed earlier ({self._broken}); start a new one")
        ranks = [0] if spec.execute is Execute.RANK_ZERO else list(range(self.world_size))
        per_rank, pad = _split_arguments(spec.dispatch, self.world_size, args, kwargs, self.replica_size)
        refs = [self.hosts[r].submit(self.role, method, *per_rank[r], spec.lane) for r in ranks]
        return GroupFuture(self, method, spec, refs, ranks, pad)

    def _wait(self, method: str, refs: list, ranks: list[int], timeout_s: float | None) -> list:
        """Results in rank order; the first failure on any rank raises at once."""
        return _await([(self, method, ref, rank) for ref, rank in zip(refs, ranks)], timeout_s)

    def _get_one(self, method: str, ref: Any, rank: int) -> Any:
        try:
            return self.hosts[rank].result(ref, self.worker_cls.__name__, method)
        except WorkerError as error:
            self._broken = f"{error.worker_class}.{error.method} on rank {error.rank}"
            raise

    def node_ids(self) -> list[str]:
        return [info["node_id"] for info in self.infos]

    def shutdown(self) -> None:
        """Tear down this group's hosts (shared with colocated roles: Ray's processes end, the one
        process frees its workers) and release its pool."""
        for host in self.hosts:
            host.teardown()
        if self.pool is not None:
            self.pool.remove()
        self._broken = "shut down"

    def pids(self) -> list[int]:
        return [info["pid"] for info in self.infos]


def _split_arguments(dispatch: Dispatch, ranks: int, args: tuple, kwargs: dict, replica_size: int = 1
                     ) -> tuple[list[tuple[tuple, dict]], Any]:
    """Per-rank (args, kwargs) for a call, and the number of pad rows the results will carry."""
    names = list(range(len(args))) + list(kwargs)
    values = list(args) + list(kwargs.values())
    per_rank_values: list[list[Any]] = [[] for _ in range(ranks)]
    pad: Any = 0
    for name, value in zip(names, values):
        if dispatch is Dispatch.DP_SPLIT and isinstance(value, (Batch, GroupFuture)):
            chunks, pad = _dp_chunks(value, ranks // replica_size)
            chunks = [c for c in chunks for _ in range(replica_size)]  # every rank of a replica: the same part
        elif dispatch is Dispatch.ALL_TO_ALL:
            if isinstance(value, GroupFuture):
                value = value.refs
            if not isinstance(value, Sequence) or len(value) != ranks:
                raise ValueError(f"all-to-all argument {name!r} must be a list of {ranks} entries, one per rank")
            chunks = list(value)
        else:
            shared = value.single_ref() if isinstance(value, GroupFuture) else value
            chunks = [shared] * ranks
        for r in range(ranks):
            per_rank_values[r].append(chunks[r])
    n_pos = len(args)
    return [(tuple(v[:n_pos]), dict(zip(list(kwargs), v[n_pos:]))) for v in per_rank_values], pad


def _dp_chunks(value: Batch | GroupFuture, ranks: int) -> tuple[list[Any], Any]:
    if isinstance(value, GroupFuture):
        return value.split_refs(ranks)
    padded, pad = value.pad_to_multiple(ranks)
    return padded.chunk(ranks), pad


def wait_all(futures: list[GroupFuture], timeout_s: float | None = None) -> list:
    """The results of several calls issued together (on one group or several), in order.

    The first failure on any rank of any of them raises at once, naming its group, method and
    rank, even while the others are blocked waiting for the failed peer. The wait ends at the
    earliest of: `timeout_s` (a `CallTimeoutError` naming every rank that has not answered), the
    deadline of the stage it runs in, and each call's own deadline (that of the stage it was
    submitted in), the last two raising `StageTimeoutError` naming the stage and its key
    (`hybridflow.controller.deadlines`).
    """
    calls = [(f.group, f.method, ref, rank) for f in futures for ref, rank in zip(f.refs, f.ranks)]
    bound = deadlines.earliest([deadlines.caller(timeout_s) if timeout_s is not None else None,
                                deadlines.current(), *(f.deadline for f in futures)])
    try:
        results = _await(calls, None if bound is None else bound.left(), None if bound is None else bound.timeout_s)
    except CallTimeoutError as exc:
        if bound is None or bound.by_caller:
            raise
        raise deadlines.overrun(bound.stage, bound.timeout_s, str(exc)) from None
    out, start = [], 0
    for f in futures:
        out.append(f.collect(results[start:start + len(f.refs)]))
        start += len(f.refs)
    return out


def _await(calls: list[tuple[WorkerGroup, str, Any, int]], timeout_s: float | None, named_s: float | None = None) -> list:
    """Each (group, method, ref, rank)'s result, in order; the first failure raises at once.
    Past `timeout_s` the error says `named_s` (the whole deadline, when part of it has passed)."""
    position: dict[Any, list[int]] = {}
    for i, (_, _, ref, _) in enumerate(calls):
        position.setdefault(ref, []).append(i)  # a call awaited twice is waited for once
    results: list[Any] = [None] * len(calls)
    pending = list(position)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
        group, _, _, rank = calls[position[pending[0]][0]]
        ready, pending = group.hosts[rank].ready(pending, wait_s)  # every host of a run has one backend
        if not ready:
            silent = [f"{g.worker_cls.__name__}.{m} rank {rank} (worker group {g.name!r})"
                      for g, m, _, rank in (calls[position[r][0]] for r in pending)]
            raise CallTimeoutError(f"no result within {named_s or timeout_s} s from: {', '.join(silent)}")
        for ref in ready:
            group, method, _, rank = calls[position[ref][0]]
            value = group._get_one(method, ref, rank)
            for i in position[ref]:
                results[i] = value
    return results
