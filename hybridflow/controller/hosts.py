"""Hosts: what runs each rank of a worker group, and the protocol the controller speaks to it.

A worker group (hybridflow/controller/worker_group.py) turns one controller call into per-rank calls
and hands each to its rank's `Host`. The group, its futures and the wait speak only this protocol:

- `submit(role, method, args, kwargs, lane)` starts `role.method` on the rank (role None: a method of
  the rank's `WorkerHost` itself: setup, memory, rendezvous_address, inject_hang) and returns a
  reference to its outcome, of the backend's own kind; a reference may be an argument of a later
  call on any host of the same backend, which then receives its value;
- `ready(refs, timeout_s)` waits until at least one of `refs` (from any hosts of this backend) has an
  outcome, at most `timeout_s`: (finished, unfinished), nothing finished when the time ran out;
- `result(ref, worker_class, method)` the value of a finished call, or a `WorkerError` naming
  `worker_class.method` on this rank with the remote traceback (or how the process died);
- `value(ref)` the plain value of a reference made by `apply`;
- `apply(fn, args, returns)` `fn(*args)` next to the data, argument references replaced by their
  values, as `returns` references (a future passed between groups never visits the controller);
- `kill()` ends the rank at once (a planted fault); `teardown()` frees what the rank holds before
  the next stage: a process of its own ends, one that lives on drops its workers (what they hold of
  each other goes with them).

Two backends: `RayHost` (hybridflow/controller/ray_host.py, one Ray actor per rank, the only
module of the worker-group machinery that imports Ray) and `LocalHost` (hybridflow/controller/
local.py, the driver's own process). Another is one file with a subclass of `Host`
(tests/unit/test_host_protocol.py drives a worker group through one that runs calls in threads).

`WorkerHost` is the rank itself, whatever runs it: it builds the role workers and runs their
methods, turning a failure into the `WorkerError` the controller raises. Roles that share a pool are
built into one process; once every role is built, the host introduces them to each other, once
(`introduce`, hybridflow/controller/context.py): each worker class with a `meet(peers)` method is
handed the other workers of its process, and keeps the one whose capability it needs (the actor a
rollout engine that loads colocated weights, the exact engine the actor that offers its module). The
host knows no role: the workers find each other by what they can do, not by a name.
"""

from __future__ import annotations

import abc
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from hybridflow.controller.context import RoleSpec, WorkerContext, introduce
from hybridflow.controller.errors import WorkerError
from hybridflow.controller.memory import read_and_reset


class Host(abc.ABC):
    """One rank of a worker group as the controller sees it (the protocol: module docstring)."""

    @abc.abstractmethod
    def submit(self, role: str | None, method: str, args: tuple, kwargs: dict, lane: str | None = None) -> Any:
        """Start `role.method(*args, **kwargs)` (role None: the WorkerHost's own method), on the
        worker's `lane` (a concurrency group of one thread; None: the main one); a reference to it."""

    @abc.abstractmethod
    def ready(self, refs: list, timeout_s: float | None) -> tuple[list, list]:
        """(finished, unfinished) of `refs`, in their order, once one has finished or `timeout_s` passed."""

    @abc.abstractmethod
    def result(self, ref: Any, worker_class: str, method: str) -> Any:
        """The call's value; a `WorkerError` naming `worker_class.method` and this rank if it failed."""

    @abc.abstractmethod
    def value(self, ref: Any) -> Any:
        """The value behind a reference `apply` made."""

    @abc.abstractmethod
    def apply(self, fn: Callable, args: tuple, returns: int = 1) -> list:
        """`fn(*args)` where the data is, references among `args` replaced by their values: `returns`
        references (one per item of the tuple `fn` returns when `returns` > 1)."""

    @abc.abstractmethod
    def kill(self) -> None:
        """End this rank now."""

    @abc.abstractmethod
    def teardown(self) -> None:
        """Free what this rank holds, so the next stage gets the device."""

    def ask(self, method: str, *args: Any, lane: str | None = None) -> Any:
        """A method of the rank's `WorkerHost`, awaited (no deadline: a quick question)."""
        return self.result(self.submit(None, method, args, {}, lane), WorkerHost.__name__, method)


class WorkerHost:
    """The rank behind one host: builds the role workers and runs their methods.

    A plain class: a Ray actor in hybridflow/controller/ray_host.py, an object in the driver in
    hybridflow/controller/local.py; it is the only place the worker classes meet a backend.
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

    def setup(self, master_addr: str, master_port: int, collective_timeout_s: float,
              cores: tuple[int, int] | None = None) -> dict:
        """The process group over the group's ranks (once per process), then the roles."""
        import torch
        import torch.distributed as dist

        pinned = pin_threads(*cores) if cores is not None else None
        if self.use_gpu:
            torch.cuda.set_device(0)  # Ray makes the bundle's GPU the only visible one
        if not dist.is_initialized():
            dist.init_process_group(
                backend="nccl" if self.use_gpu else "gloo",
                init_method=f"tcp://{master_addr}:{master_port}",
                rank=self.rank,
                world_size=self.world_size,
                timeout=timedelta(seconds=collective_timeout_s),
            )
        return {**self.build_roles(master_addr, master_port), "cores": pinned}

    def build_roles(self, master_addr: str = "127.0.0.1", master_port: int = 0) -> dict:
        """Every role's worker for this rank (the process group, if any, made before), then the workers
        introduced to each other (each one's `meet(peers)`, once)."""
        ctx = WorkerContext(self.rank, self.world_size, self.local_rank, self.node_id,
                            "cuda" if self.use_gpu else "cpu", "nccl" if self.use_gpu else "gloo",
                            master_addr, master_port, self.group_name)
        for role, spec in self.roles.items():
            try:
                self.workers[role] = spec.build(ctx)
            except BaseException as exc:
                raise self._error(spec.cls.__name__, "__init__", exc) from None
        try:
            introduce(list(self.workers.values()))
        except BaseException as exc:
            raise self._error("+".join(type(w).__name__ for w in self.workers.values()), "meet", exc) from None
        return {"rank": self.rank, "node_id": self.node_id, "pid": os.getpid(), "log_file": self.log_file}

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
        return read_and_reset(self.use_gpu)

    def teardown(self) -> None:
        """Drop the workers: what they hold, of each other too (the peers they met), goes with them."""
        self.workers.clear()


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
