"""The Ray backend: one Ray actor per rank (a `WorkerHost` in a process of its own), behind the host
protocol (hybridflow/controller/hosts.py). The worker-group machinery meets Ray only here.

`spawn_workers(pool, {"actor": RoleSpec(ActorWorker, ...), "rollout": RoleSpec(...)})` starts one
process per slot of the pool and builds every listed role inside it, so roles that share a pool are
fused into one process per device (one CUDA context, weights shareable). It returns one `WorkerGroup`
per role. A call's reference is a Ray object reference: passed into another group's call, its data
moves between workers through Ray's object store, never through the controller (`apply` runs the
gather or re-split as a small Ray task in the cluster). `ready` is `ray.wait`, so the first rank
that raises is reported at once, even while the others are still blocked in a collective.

Ray is imported on first use, not with this module: hybridflow.run.launch imports `spawn_workers` on
every run, Ray's import blocked on the one-process backend's.
"""

from __future__ import annotations

import math
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from hybridflow.controller.context import RoleSpec
from hybridflow.controller.decorators import lanes
from hybridflow.controller.errors import WorkerError
from hybridflow.controller.hosts import Host, WorkerHost, output_tail
from hybridflow.controller.memory import MONITOR_LANE, cpu_kernel_cache_env, memory_kill
from hybridflow.controller.worker_group import WorkerGroup

if TYPE_CHECKING:
    from hybridflow.controller.pools import CoreLedger, ResourcePool


def _ray():
    import ray  # on first use: importing this module needs no Ray (module docstring)

    return ray


class RayWorkerHost(WorkerHost):
    """The `WorkerHost` a Ray actor runs: it also names its node's address for the group's rendezvous."""

    def rendezvous_address(self) -> tuple[str, int]:
        """An address and a free port on this host for the group's process-group rendezvous."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return _ray().util.get_node_ip_address(), port

    def end(self) -> None:
        """End this process from inside it: the workers dropped, then Ray's own exit (`exit_actor`),
        which tells the node the process is going and ends the processes it started. Called on the
        monitor lane, so it runs while the default lane is inside a call (a rank stuck in a collective
        its peer left): Ray's exit then waits for that call, and a thread ends the process
        `EXIT_GRACE_S` after the teardown (as it does when Python's exit waits on a thread a library left
        running), or `TEARDOWN_GRACE_S` after the call if the teardown itself does not return.

        Not Ray's kill: it sends SIGTERM and, five seconds later, SIGKILL to the process id if that id is
        alive, and on a machine that starts threads fast the id may by then name a thread of another
        process (Ray 2.60, raylet/worker.cc `KillAsync`): in CI it killed a vLLM rank a new group had
        just started. A process that ends itself is marked dead by its node, which kills nothing later."""
        deadline = [time.monotonic() + TEARDOWN_GRACE_S]
        threading.Thread(target=_exit_at, args=(deadline,), daemon=True).start()
        self.teardown()
        deadline[0] = min(deadline[0], time.monotonic() + EXIT_GRACE_S)
        sys.stdout.flush()
        sys.stderr.flush()
        _ray().actor.exit_actor()


# Seconds a host that asked Ray to exit may take to end once its workers are dropped (`RayWorkerHost.end`);
# seconds the dropping may take (a vLLM engine whose last reference goes shuts down, collecting garbage twice:
# 1.7-2.5 s on a 2-core EPYC); and seconds the driver waits for the host before it kills the process (one
# whose monitor lane does not answer either): more than the two before it.
EXIT_GRACE_S = 1.0
TEARDOWN_GRACE_S = 6.0
END_TIMEOUT_S = 10.0


def _exit_at(deadline: list[float]) -> None:
    """End the process at `deadline[0]` (monotonic seconds), which the caller may bring forward."""
    while time.monotonic() < deadline[0]:
        time.sleep(min(0.1, max(0.0, deadline[0] - time.monotonic())))
    os._exit(0)


_TASKS: dict = {}


class RayHost(Host):
    """One rank: a Ray actor running a `RayWorkerHost`; references are Ray object references."""

    def __init__(self, actor: Any, group_name: str, rank: int, world_size: int, log_file: str | None) -> None:
        self.actor, self.group_name, self.rank, self.world_size = actor, group_name, rank, world_size
        self.log_file = log_file  # where the process writes: its last lines name a death

    def submit(self, role: str | None, method: str, args: tuple, kwargs: dict, lane: str | None = None) -> Any:
        call = self.actor.call if role is not None else getattr(self.actor, method)
        if lane:
            call = call.options(concurrency_group=lane)
        return call.remote(*((role, method) if role is not None else ()), *args, **kwargs)

    def ready(self, refs: list, timeout_s: float | None) -> tuple[list, list]:
        return _ray().wait(refs, num_returns=1, timeout=timeout_s)

    def result(self, ref: Any, worker_class: str, method: str) -> Any:
        from ray.exceptions import RayActorError, RayTaskError

        try:
            return _ray().get(ref)
        except RayTaskError as exc:
            cause = exc.cause if isinstance(exc.cause, WorkerError) else None
            error = cause or WorkerError(self.group_name, worker_class, method, self.rank, self.world_size, str(exc))
        except RayActorError as exc:
            why = memory_kill(str(exc))
            error = WorkerError(self.group_name, worker_class, method, self.rank, self.world_size,
                                f"the worker process died{f' ({why})' if why else ''}: {exc}{output_tail(self.log_file)}")
        raise WorkerError(error.group, error.worker_class, error.method, error.rank, error.world_size,
                          error.detail) from None

    def value(self, ref: Any) -> Any:
        return _ray().get(ref)

    def apply(self, fn: Callable, args: tuple, returns: int = 1) -> list:
        if fn not in _TASKS:
            _TASKS[fn] = _ray().remote(num_cpus=0)(fn)
        out = _TASKS[fn].options(num_returns=returns).remote(*args)
        return list(out) if returns > 1 else [out]

    def kill(self) -> None:
        _ray().kill(self.actor, no_restart=True)

    def teardown(self) -> None:
        """The process ends, and everything its roles held with it: it ends itself
        (`RayWorkerHost.end`), or is killed if it has not within `END_TIMEOUT_S`."""
        ended, _ = _ray().wait([self.actor.end.options(concurrency_group=MONITOR_LANE).remote()],
                               timeout=END_TIMEOUT_S)
        if not ended:
            self.kill()


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
    print) to `<log_dir>/<pool>-rank<r>.log` instead of Ray's session logs (hybridflow.output.console).
    With `cores` (CPU pools), each process pins its threads to the cores the ledger hands it
    (`hybridflow.controller.hosts.pin_threads`)."""
    if not roles:
        raise ValueError("spawn_workers needs at least one role")
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    name = name or f"{pool.spec.name}:{'+'.join(roles)}"
    slots = pool.create().slots()
    spec = pool.spec
    # a lane is a Ray concurrency group of one thread; "monitor" reads the process's memory (memory.py)
    extra_lanes = lanes(rs.cls for rs in roles.values()) | {MONITOR_LANE}
    actor_cls = _ray().remote(concurrency_groups={lane: 1 for lane in sorted(extra_lanes)})(RayWorkerHost)
    hosts = []
    for slot in slots:
        options = dict(
            num_cpus=spec.cpus_per_device,
            num_gpus=1 if spec.use_gpu else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(slot.placement_group, slot.bundle_index),
            runtime_env={"env_vars": {**({} if spec.use_gpu else cpu_kernel_cache_env()), **(env_vars or {})}},
        )
        log_file = None if log_dir is None else str(Path(log_dir) / f"{spec.name}-rank{slot.rank}.log")
        actor = actor_cls.options(**options).remote(
            name, slot.rank, len(slots), slot.bundle_index, slot.node_id, spec.use_gpu, roles, log_file)
        hosts.append(RayHost(actor, name, slot.rank, len(slots), log_file))
    probe = WorkerGroup(name, "host", WorkerHost, hosts, [])
    addr, port = probe._get_one("rendezvous_address", hosts[0].submit(None, "rendezvous_address", (), {}), 0)
    per_process = max(1, math.ceil(spec.cpus_per_device))
    shares = [cores.take(slot.node_id, per_process) if cores is not None and not spec.use_gpu else None
              for slot in slots]
    refs = [h.submit(None, "setup", (addr, port, collective_timeout_s, share), {}) for h, share in zip(hosts, shares)]
    infos = probe._wait("setup", refs, list(range(len(hosts))), setup_timeout_s)
    return {role: WorkerGroup(name, role, rs.cls, hosts, infos, pool, rs.replica_size) for role, rs in roles.items()}
