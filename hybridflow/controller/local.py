"""The one-process backend (placement.backend=local): the driver and every role's workers in one
process, on one device (one GPU, or the CPU), behind the same worker-group and future API as Ray.

Where a Ray run has one host process per device, this has one `LocalHost` in the driver's process (a
`Host`, hybridflow/controller/hosts.py); `spawn_local` builds every role in it and returns the same
`WorkerGroup`s (hybridflow/controller/worker_group.py). A call runs when it is submitted and its result,
or its error, waits in a `LocalRef`: the `WorkerError` is raised where a Ray run raises it, at the wait.
What a Ray call gets by crossing processes is kept: the arguments and the result are copied (a worker
that changes a batch in place does not change the driver's), and the host keeps the torch random state
of its own, swapped in around each call as a process of its own would have it.
One torch.distributed group of world size 1 (NCCL on CUDA, gloo on the CPU) serves FSDP2 and vLLM, made
once and kept for the process's life: vLLM keeps its own groups built on it from one engine to the next.
`teardown` frees the stage's models before the next stage: the workers go, and with them what they hold
of each other (the peers they met when the host built them, hybridflow/controller/hosts.py), which a
garbage collection frees.

Nothing here imports Ray. What one process cannot do is refused before anything starts
(hybridflow/checks/rules.py `check_local_backend`).
"""

from __future__ import annotations

import copy
import gc
import socket
from typing import Any, Callable

from hybridflow.controller.context import RoleSpec
from hybridflow.controller.hosts import Host, WorkerHost
from hybridflow.controller.worker_group import WorkerGroup


class LocalRef:
    """The outcome of a call already made: its value, or the error it raised."""

    __slots__ = ("value", "error")

    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error

    @classmethod
    def of(cls, fn: Callable, *args: Any) -> "LocalRef":
        """`fn(*args)` now, with any LocalRef among `args` replaced by its value."""
        try:
            return cls(fn(*(a.get() if isinstance(a, LocalRef) else a for a in args)))
        except BaseException as exc:
            return cls(error=exc)

    def get(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value

    def parts(self, count: int) -> list["LocalRef"]:
        """A tuple result as `count` refs (Ray's num_returns)."""
        if self.error is not None:
            return [LocalRef(error=self.error)] * count
        return [LocalRef(v) for v in self.value]


class LocalHost(Host):
    """The one rank of a one-process run: a `WorkerHost` (the same role building, calls and errors)
    in the driver's process, with the random state and argument copies of a process of its own."""

    def __init__(self, group_name: str, device: str, roles: dict[str, RoleSpec]) -> None:
        self.worker_host = WorkerHost(group_name, 0, 1, 0, "local", device == "cuda", roles, log_file=None)
        self.device = device
        self.rng: dict | None = None  # this host's torch random state, between calls

    def setup(self, collective_timeout_s: float) -> dict:
        """The process group of world size 1 (once per process: later stages reuse it) and the roles."""
        import torch.distributed as dist

        port = 0
        if not dist.is_initialized():
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        return self._in_own_state(self.worker_host.setup, "127.0.0.1", port, collective_timeout_s)

    def submit(self, role: str | None, method: str, args: tuple, kwargs: dict, lane: str | None = None) -> LocalRef:
        """The call, run now (one thread: `lane` changes nothing) on copies of its arguments."""
        args, kwargs = _resolved(args), {k: _resolved([v])[0] for k, v in kwargs.items()}
        fn = getattr(self.worker_host, method) if role is None else self.worker_host.call
        try:
            value = self._in_own_state(fn, *(() if role is None else (role, method)), *copy.deepcopy(args),
                                       **copy.deepcopy(kwargs))
            return LocalRef(copy.deepcopy(value))
        except BaseException as exc:  # a WorkerError naming the role, method and rank, as under Ray
            return LocalRef(error=exc)

    def ready(self, refs: list, timeout_s: float | None) -> tuple[list, list]:
        return list(refs), []  # every call finished when it was submitted

    def result(self, ref: LocalRef, worker_class: str, method: str) -> Any:
        return ref.get()  # its error is already the WorkerHost's WorkerError

    def value(self, ref: LocalRef) -> Any:
        return ref.get()

    def apply(self, fn: Callable, args: tuple, returns: int = 1) -> list:
        out = LocalRef.of(fn, *args)
        return out.parts(returns) if returns > 1 else [out]

    def kill(self) -> None:
        """A process cannot end itself and go on driving: the nearest is to free its workers (a planted
        kill is refused with placement.backend=local before start, hybridflow/checks/rules.py)."""
        self.teardown()

    def teardown(self) -> None:
        """Free the stage's models: the workers (a collection frees the ones that met each other), cached device
        memory."""
        self.worker_host.teardown()
        gc.collect()
        if self.device == "cuda":
            import torch

            torch.cuda.empty_cache()

    def _in_own_state(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """`fn` run with this host's torch random state, the driver's put back after."""
        driver = _rng_state(self.device)
        if self.rng is not None:
            _set_rng_state(self.rng, self.device)
        try:
            return fn(*args, **kwargs)
        finally:
            self.rng = _rng_state(self.device)
            _set_rng_state(driver, self.device)


def _resolved(values) -> list:
    """Arguments with every `LocalRef` (a future passed from another group) replaced by its value."""
    return [v.get() if isinstance(v, LocalRef) else v for v in values]


def _rng_state(device: str) -> dict:
    import torch

    state = {"cpu": torch.get_rng_state()}
    if device == "cuda":
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict, device: str) -> None:
    import torch

    torch.set_rng_state(state["cpu"])
    if device == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def spawn_local(name: str, device: str, roles: dict[str, RoleSpec], collective_timeout_s: float = 600.0) -> dict:
    """Every role of `roles` built in this process on `device`; one `WorkerGroup` per role."""
    if not roles:
        raise ValueError("spawn_local needs at least one role")
    host = LocalHost(name, device, roles)
    info = host.setup(collective_timeout_s)
    return {role: WorkerGroup(name, role, rs.cls, [host], [info], None, rs.replica_size) for role, rs in roles.items()}
