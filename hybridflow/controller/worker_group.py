"""Worker groups: one controller call becomes per-rank remote calls.

`spawn_workers(pool, {"actor": RoleSpec(ActorWorker, ...), "rollout": RoleSpec(...)})` starts
one host process (a Ray actor) per slot of the pool and builds every listed role inside it, so
roles that share a pool are fused into one process per device (one CUDA context, weights
shareable). It returns one `WorkerGroup` per role. Calling `group.method(batch)` splits the
arguments by the method's dispatch mode, runs it on the ranks its execute mode names, and
gathers the results; `group.method.remote(batch)` returns a `GroupFuture` instead, which can be
passed straight into another group's call: its data then moves between workers through Ray's
object store, never through the controller.

Failures: every rank's result is awaited with `ray.wait`, so the first rank that raises is
reported at once as a `WorkerError` naming the class, method and rank, with the remote
traceback, even while the other ranks are still blocked in a collective waiting for it.

The one-process backend (placement.backend=local, hybridflow/controller/local.py) builds the same
groups over a `LocalHost` in the driver's process: calls run when submitted, their results or
errors wait in a `LocalRef` until awaited, and nothing here imports Ray on that path (Ray is
imported where a Ray host, ref or pool is first met).
"""

from __future__ import annotations

import math
import os
import socket
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from hybridflow.batch import Batch
from hybridflow.controller.memory import MONITOR_LANE, cpu_kernel_cache_env, memory_kill
from hybridflow.controller import deadlines
from hybridflow.controller.context import RoleSpec, WorkerContext
from hybridflow.controller.decorators import Dispatch, Execute, MethodSpec, lanes, registered_methods
from hybridflow.controller.errors import WorkerError, WorkerGroupBroken
if TYPE_CHECKING:
    import ray

    from hybridflow.controller.pools import CoreLedger, ResourcePool


def is_local(obj: Any) -> bool:
    """A host or result of the one-process backend (hybridflow/controller/local.py), which marks them."""
    return getattr(obj, "one_process", False)


class WorkerHost:
    """The process behind one rank: builds the role workers and runs their methods.

    This plain class becomes a Ray actor in `spawn_workers`; it is the only place the
    worker classes meet Ray.
    """

    def __init__(self, group_name: str, rank: int, world_size: int, local_rank: int, node_id: str,
                 use_gpu: bool, roles: dict[str, RoleSpec], log_file: str | None = None) -> None:
        self.log_file = log_file
        if log_file is not None:
            redirect_output(log_file, f"{group_name} rank {rank} of {world_size}")
        self.group_name, self.rank, self.world_size = group_name, rank, world_size
        self.local_rank, self.node_id, self.use_gpu = local_rank, node_id, use_gpu
        self.roles = roles
        self.workers: dict[str, Any] = {}
        self.hanging: set[tuple[str, str]] = set()

    def inject_hang(self, role: str, method: str) -> None:
        """Fault injection: every later call of `role.method` in this process never returns."""
        self.hanging.add((role, method))

    def rendezvous_address(self) -> tuple[str, int]:
        """An address and a free port on this host for the group's process-group rendezvous."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        import ray

        return ray.util.get_node_ip_address(), port

    def setup(self, master_addr: str, master_port: int, collective_timeout_s: float,
              cores: tuple[int, int] | None = None) -> dict:
        import torch
        import torch.distributed as dist

        pinned = pin_threads(*cores) if cores is not None else None

        device = "cuda" if self.use_gpu else "cpu"
        backend = "nccl" if self.use_gpu else "gloo"
        if self.use_gpu:
            torch.cuda.set_device(0)  # Ray makes the bundle's GPU the only visible one
        if not dist.is_initialized():
            dist.init_process_group(
                backend=backend,
                init_method=f"tcp://{master_addr}:{master_port}",
                rank=self.rank,
                world_size=self.world_size,
                timeout=timedelta(seconds=collective_timeout_s),
            )
        ctx = WorkerContext(self.rank, self.world_size, self.local_rank, self.node_id, device, backend,
                            master_addr, master_port, self.group_name)
        for role, spec in self.roles.items():
            try:
                self.workers[role] = spec.build(ctx)
            except BaseException as exc:
                raise self._error(spec.cls.__name__, "__init__", exc) from None
        return {"rank": self.rank, "node_id": self.node_id, "pid": os.getpid(), "log_file": self.log_file,
                "cores": pinned}

    def call(self, role: str, method: str, *args: Any, **kwargs: Any) -> Any:
        if (role, method) in self.hanging:
            time.sleep(1e9)  # an injected fault: this call never returns
        worker = self.workers[role]
        try:
            return getattr(worker, method)(*args, **kwargs)
        except BaseException as exc:
            raise self._error(type(worker).__name__, method, exc) from None

    def _error(self, cls_name: str, method: str, exc: BaseException) -> WorkerError:
        detail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return WorkerError(self.group_name, cls_name, method, self.rank, self.world_size, detail)

    def info(self) -> dict:
        return {"rank": self.rank, "node_id": self.node_id, "pid": os.getpid(), "roles": list(self.workers)}

    def memory(self) -> dict[str, int]:
        """This process's peak memory since the last call, and now (hybridflow.controller.memory;
        called on lane "monitor", so it answers while the process works)."""
        from hybridflow.controller.memory import read_and_reset

        return read_and_reset(self.use_gpu)


# ---- moving futures between groups without the controller ------------------------------------


def _gather(dispatch: Dispatch, pad: int, *parts: Any) -> Any:
    return _collect(dispatch, list(parts), pad)


def _gather_and_split(dispatch: Dispatch, pad: int, ranks: int, *parts: Any) -> tuple:
    batch = _collect(dispatch, list(parts), pad)
    if not isinstance(batch, Batch):
        raise TypeError(f"a data-parallel call needs a Batch argument, the future holds {type(batch).__name__}")
    padded, new_pad = batch.pad_to_multiple(ranks)
    return (*padded.chunk(ranks), new_pad)


_TASKS: dict = {}


def _ray_task(fn):
    """`fn` as a Ray task (made on first use: the local backend never imports Ray)."""
    if fn not in _TASKS:
        import ray

        _TASKS[fn] = ray.remote(num_cpus=0)(fn)
    return _TASKS[fn]


def _collect(dispatch: Dispatch, results: list[Any], pad: int) -> Any:
    if dispatch is Dispatch.RANK_ZERO:
        return results[0]
    if dispatch is Dispatch.DP_SPLIT and results and all(isinstance(r, Batch) for r in results):
        return Batch.concat(results).unpad(pad)
    return results


class GroupFuture:
    """Pending results of one call on a worker group, one object reference per rank that ran it."""

    def __init__(self, group: "WorkerGroup", method: str, spec: MethodSpec, refs: list[ray.ObjectRef],
                 ranks: list[int], pad: int | ray.ObjectRef) -> None:
        self.group, self.method, self.spec = group, method, spec
        self.refs, self.ranks, self.pad = refs, ranks, pad
        self.deadline = deadlines.current()  # the submitting stage's: kept when awaited in a later stage

    def get(self, timeout_s: float | None = None) -> Any:
        return wait_all([self], timeout_s)[0]

    def collect(self, results: list) -> Any:
        """The call's result from every rank's result (in rank order)."""
        pad = self.pad
        if is_local(pad):
            pad = pad.get()
        elif not isinstance(pad, int):  # a Ray object reference, from a gather in the cluster
            import ray

            pad = ray.get(pad)
        if self.spec.execute is Execute.RANK_ZERO:
            return results[0]
        if self.spec.dispatch is Dispatch.DP_SPLIT:
            results = results[:: self.group.replica_size]  # one rank per replica
        return _collect(self.spec.dispatch, results, pad)

    def _data_refs(self) -> list[ray.ObjectRef]:
        if self.spec.dispatch is Dispatch.DP_SPLIT:
            return self.refs[:: self.group.replica_size]
        return self.refs

    def single_ref(self) -> ray.ObjectRef:
        """One reference to the gathered result (gathered in the cluster, not the controller)."""
        if self.spec.execute is Execute.RANK_ZERO or self.spec.dispatch is Dispatch.RANK_ZERO:
            return self.refs[0]
        if is_local(self.refs[0]):
            return type(self.refs[0]).of(_gather, self.spec.dispatch, self.pad, *self._data_refs())
        return _ray_task(_gather).remote(self.spec.dispatch, self.pad, *self._data_refs())

    def split_refs(self, ranks: int) -> tuple[list[ray.ObjectRef], int | ray.ObjectRef]:
        """`ranks` references to equal chunks of the gathered Batch, and the pad they carry."""
        refs = self._data_refs()
        if self.spec.dispatch is Dispatch.DP_SPLIT and len(refs) == ranks:
            return list(refs), self.pad
        if is_local(refs[0]):
            out = type(refs[0]).of(_gather_and_split, self.spec.dispatch, self.pad, ranks, *refs).parts(ranks + 1)
        else:
            out = _ray_task(_gather_and_split).options(num_returns=ranks + 1).remote(
                self.spec.dispatch, self.pad, ranks, *refs)
        return list(out[:ranks]), out[ranks]


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
    """The ranks of one role. Methods marked with `@register` are callable on the group."""

    def __init__(self, name: str, role: str, worker_cls: type, hosts: list, infos: list[dict],
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
        if is_local(self.hosts[0]):  # one process: the call runs now, its result waits to be awaited
            refs = [self.hosts[r].submit(self.role, method, *per_rank[r][0], **per_rank[r][1]) for r in ranks]
            return GroupFuture(self, method, spec, refs, ranks, pad)
        call = (lambda h: h.call.options(concurrency_group=spec.lane)) if spec.lane else (lambda h: h.call)
        refs = [call(self.hosts[r]).remote(self.role, method, *per_rank[r][0], **per_rank[r][1]) for r in ranks]
        return GroupFuture(self, method, spec, refs, ranks, pad)

    def _wait(self, method: str, refs: list[ray.ObjectRef], ranks: list[int], timeout_s: float | None) -> list:
        """Results in rank order; the first failure on any rank raises at once."""
        return _await([(self, method, ref, rank) for ref, rank in zip(refs, ranks)], timeout_s)

    def _get_one(self, method: str, ref: ray.ObjectRef, rank: int) -> Any:
        if is_local(ref):
            try:
                return ref.get()
            except WorkerError as error:
                self._broken = f"{error.worker_class}.{error.method} on rank {error.rank}"
                raise
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        try:
            return ray.get(ref)
        except RayTaskError as exc:
            cause = exc.cause if isinstance(exc.cause, WorkerError) else None
            error = cause or WorkerError(self.name, self.worker_cls.__name__, method, rank, self.world_size, str(exc))
        except RayActorError as exc:
            log_file = self.infos[rank].get("log_file") if rank < len(self.infos) else None
            why = memory_kill(str(exc))
            error = WorkerError(self.name, self.worker_cls.__name__, method, rank, self.world_size,
                                f"the worker process died{f' ({why})' if why else ''}: {exc}{output_tail(log_file)}")
        self._broken = f"{error.worker_class}.{error.method} on rank {error.rank}"
        raise WorkerError(error.group, error.worker_class, error.method, error.rank, error.world_size,
                          error.detail) from None

    def node_ids(self) -> list[str]:
        return [info["node_id"] for info in self.infos]

    def shutdown(self) -> None:
        """Kill this group's processes (shared with colocated roles) and release its pool; one process:
        free its workers' models (hybridflow/controller/local.py)."""
        if is_local(self.hosts[0]):
            for host in self.hosts:
                host.teardown()
            self._broken = "shut down"
            return
        import ray

        for host in self.hosts:
            ray.kill(host, no_restart=True)
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


def redirect_output(path: str, header: str) -> None:
    """This process's stdout and stderr, Python's and C's alike (vLLM, torch and Ray write from
    both), appended to `path` from now on."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    print(f"==== {header}, pid {os.getpid()}, {time.strftime('%Y-%m-%d %H:%M:%S')} ====", flush=True)


def output_tail(log_file: str | None, lines: int = 40) -> str:
    """The last lines a dead worker wrote, for its error (empty when there is no readable file)."""
    try:
        text = Path(log_file).read_text(errors="replace").splitlines()[-lines:] if log_file else []
    except OSError:
        return ""
    return f"\nits last output ({log_file}):\n" + "\n".join(text) if text else ""


def spawn_workers(
    pool: ResourcePool,
    roles: dict[str, RoleSpec],
    *,
    name: str | None = None,
    env_vars: dict[str, str] | None = None,
    collective_timeout_s: float = 600.0,
    setup_timeout_s: float = 600.0,
    log_dir: str | Path | None = None,
    cores: CoreLedger | None = None,
) -> dict[str, WorkerGroup]:
    """Start one process per slot of `pool` hosting every role in `roles`; one group per role.

    With `log_dir`, each process writes its stdout and stderr (everything the libraries in it
    print) to `<log_dir>/<pool>-rank<r>.log` instead of Ray's session logs (hybridflow.console).
    With `cores` (CPU pools), each process pins its threads to the cores the ledger hands it
    (`pin_threads`)."""
    if not roles:
        raise ValueError("spawn_workers needs at least one role")
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    name = name or f"{pool.spec.name}:{'+'.join(roles)}"
    slots = pool.create().slots()
    spec = pool.spec
    # a lane is a Ray concurrency group of one thread; "monitor" reads the process's memory (memory.py)
    extra_lanes = lanes(rs.cls for rs in roles.values()) | {MONITOR_LANE}
    host_cls = ray.remote(concurrency_groups={lane: 1 for lane in sorted(extra_lanes)})(WorkerHost)
    hosts = []
    for slot in slots:
        options = dict(
            num_cpus=spec.cpus_per_device,
            num_gpus=1 if spec.use_gpu else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(slot.placement_group, slot.bundle_index),
            runtime_env={"env_vars": {**({} if spec.use_gpu else cpu_kernel_cache_env()), **(env_vars or {})}},
        )
        log_file = None if log_dir is None else str(Path(log_dir) / f"{spec.name}-rank{slot.rank}.log")
        hosts.append(host_cls.options(**options).remote(
            name, slot.rank, len(slots), slot.bundle_index, slot.node_id, spec.use_gpu, roles, log_file))
    probe = WorkerGroup(name, "host", WorkerHost, hosts, [])
    addr, port = probe._get_one("rendezvous_address", hosts[0].rendezvous_address.remote(), 0)
    per_process = max(1, math.ceil(spec.cpus_per_device))
    shares = [cores.take(slot.node_id, per_process) if cores is not None and not spec.use_gpu else None
              for slot in slots]
    refs = [h.setup.remote(addr, port, collective_timeout_s, share) for h, share in zip(hosts, shares)]
    infos = probe._wait("setup", refs, list(range(len(hosts))), setup_timeout_s)
    return {role: WorkerGroup(name, role, rs.cls, hosts, infos, pool, rs.replica_size) for role, rs in roles.items()}


def pin_threads(start: int, count: int) -> list[int] | None:
    """Pin every thread of this process (threads it starts later inherit it) to `count` of the
    cores it may run on, from index `start`, and size torch's pool to them; returns the cores, or
    None (nothing changed) when they would run past this machine's: more processes than cores
    then share them as the OS schedules. On Linux; elsewhere a no-op."""
    import torch

    if not hasattr(os, "sched_setaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    if start + count > len(allowed):
        return None
    mine = allowed[start:start + count]
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), mine)
        except OSError:  # a thread that ended meanwhile
            pass
    torch.set_num_threads(count)
    os.environ["OMP_NUM_THREADS"] = str(count)
    return mine


def wait_all(futures: list[GroupFuture], timeout_s: float | None = None) -> list:
    """The results of several calls issued together (on one group or several), in order.

    The first failure on any rank of any of them raises at once, naming its group, method and
    rank, even while the others are blocked waiting for the failed peer. The wait ends at the
    earliest of: `timeout_s` (a `GetTimeoutError` naming every rank that has not answered), the
    deadline of the stage it runs in, and each call's own deadline (that of the stage it was
    submitted in), the last two raising `StageTimeoutError` naming the stage and its key
    (`hybridflow.controller.deadlines`).
    """
    calls = [(f.group, f.method, ref, rank) for f in futures for ref, rank in zip(f.refs, f.ranks)]
    if all(is_local(ref) for _, _, ref, _ in calls):  # one process: every call has finished
        results = [group._get_one(method, ref, rank) for group, method, ref, rank in calls]
        return _collected(futures, results)
    from ray.exceptions import GetTimeoutError

    bound = deadlines.earliest([deadlines.caller(timeout_s) if timeout_s is not None else None,
                                deadlines.current(), *(f.deadline for f in futures)])
    try:
        results = _await(calls, None if bound is None else bound.left(), None if bound is None else bound.timeout_s)
    except GetTimeoutError as exc:
        if bound is None or bound.by_caller:
            raise
        raise deadlines.overrun(bound.stage, bound.timeout_s, str(exc)) from None
    return _collected(futures, results)


def _collected(futures: list[GroupFuture], results: list) -> list:
    out, start = [], 0
    for f in futures:
        out.append(f.collect(results[start:start + len(f.refs)]))
        start += len(f.refs)
    return out


def _await(calls: list[tuple[WorkerGroup, str, ray.ObjectRef, int]], timeout_s: float | None,
           named_s: float | None = None) -> list:
    """Each (group, method, ref, rank)'s result, in order; the first failure raises at once.
    Past `timeout_s` the error says `named_s` (the whole deadline, when part of it has passed)."""
    import ray
    from ray.exceptions import GetTimeoutError

    position = {ref: i for i, (_, _, ref, _) in enumerate(calls)}
    results: list[Any] = [None] * len(calls)
    pending = list(position)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
        if not ready:
            silent = [f"{g.worker_cls.__name__}.{m} rank {rank} (worker group {g.name!r})"
                      for g, m, _, rank in (calls[position[r]] for r in pending)]
            raise GetTimeoutError(f"no result within {named_s or timeout_s} s from: {', '.join(silent)}")
        for ref in ready:
            group, method, _, rank = calls[position[ref]]
            results[position[ref]] = group._get_one(method, ref, rank)
    return results
