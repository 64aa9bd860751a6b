"""Starting or joining Ray.

Without an address the controller starts a local Ray instance (the embedded default). With
`ray.address` set, or when the driver runs under `ray job submit` (which exports RAY_ADDRESS
to the job), it joins that cluster. The dashboard, when started, binds to loopback unless
`ray.dashboard_host` says otherwise.

Joining a cluster, the job's runtime environment also carries the code files the config names
(reward functions, agent tools and environments; hybridflow.controller.storage), so they need
not be on every node's disk.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

# The local Ray instance's settings. kill_worker_timeout_milliseconds: Ray's kill sends SIGTERM, and after
# this many milliseconds SIGKILL to the process id if that id is alive (5,000 by default). By then a machine
# that starts threads fast may have given the id to a thread of another process, which the SIGKILL ends:
# in CI it killed a vLLM rank a new group had just started. Ray SIGKILLs the process's group 200 ms after the
# SIGTERM anyway; a group's processes end themselves where they can (hybridflow.controller.ray_host `RayWorkerHost.end`).
RAY_SYSTEM_CONFIG = {"kill_worker_timeout_milliseconds": 250}
# The interpreter command Ray starts each worker process with (Ray's runtime_env `py_executable`), when set: a
# wrapper such as a profiler, or the tests' warm interpreter (tests/warm_workers.py), which forks each worker
# from a process that imported torch, transformers and vLLM once. Unset: Ray's own Python.
WORKER_PYTHON_ENV = "HYBRIDFLOW_WORKER_PYTHON"


def worker_python() -> str | None:
    """HYBRIDFLOW_WORKER_PYTHON, checked here before Ray starts: a command this node cannot run would leave
    every worker unstarted until Ray's registration timeout, with no word of why."""
    import shlex
    import shutil

    value = os.environ.get(WORKER_PYTHON_ENV)
    if not value:
        return None
    program = shlex.split(value)[0] if value.strip() else ""
    if not shutil.which(program):
        raise ValueError(f"{WORKER_PYTHON_ENV}={value!r}: {program!r} is not an executable on this node; give "
                         f"the command Ray should start each worker with (an executable path, then its "
                         f"arguments), or unset {WORKER_PYTHON_ENV} for Ray's own Python")
    return value


def join_address(address: str | None) -> str | None:
    """The cluster a driver joins: `ray.address`, else RAY_ADDRESS (which `ray job submit` exports to
    the job); None: it starts a local Ray. The driver reads RAY_ADDRESS here, at the edge, so workers
    never need to."""
    return address or os.environ.get("RAY_ADDRESS")


def unreachable_head(address: str | None, key: str) -> str | None:
    """Why the cluster at `address` (host:port, as `join_address` gives it) cannot be joined, or None.
    Joining a head that is gone, Ray retries for ever (a stale RAY_ADDRESS after `ray stop` waited
    silently past two minutes), so the command asks once, before anything starts, whether anything
    answers there. An address of another form (auto, ray://...) is left to Ray."""
    import socket

    if not address or "://" in address or address.count(":") != 1:  # auto, ray://..., IPv6: Ray's to judge
        return None
    host, port = address.rsplit(":", 1)
    if not port.isdigit():
        return None
    try:
        socket.create_connection((host, int(port)), timeout=10).close()
    except OSError as exc:
        return (f"{key}={address!r}: no Ray head answers at {host}:{port} ({exc.strerror or exc}); start the "
                "cluster (`ray start --head`), correct the address, or leave ray.address and RAY_ADDRESS unset "
                "to start a local Ray")
    return None


def connect(*, address: str | None, num_cpus: int | None, dashboard: bool, dashboard_host: str,
            namespace: str, env_vars: dict[str, str] | None = None, log_to_driver: bool = True,
            code_files: list[str] | None = None) -> str:
    """Initialise Ray once for this driver; returns 'joined <address>' or 'local'.

    `log_to_driver=False` (hybridflow.output.console, a quiet run): Ray neither forwards the workers'
    output to the driver's console nor gives its own logger a console handler; its messages go
    where the driver's root logger sends them (the run's logs/driver.log)."""
    import ray

    if ray.is_initialized():
        return "already connected"
    if not log_to_driver:
        ray_logger = logging.getLogger("ray")
        ray_logger.handlers.clear()
        ray_logger.propagate = True
    quiet = {} if log_to_driver else {"configure_logging": False}
    runtime_env = {"env_vars": dict(env_vars or {})}
    python = worker_python()
    if python:
        runtime_env["py_executable"] = python
    target = join_address(address)
    if target:
        shipped = _ship(code_files or [])
        if shipped:
            runtime_env["py_modules"] = [str(shipped)]
        ray.init(address=target, namespace=namespace, runtime_env=runtime_env, log_to_driver=log_to_driver, **quiet)
        log.info("joined Ray cluster at %s", target)
        return f"joined {target}"
    # address="local": always a new instance. Without it ray.init joins the last cluster that
    # `ray start` recorded in /tmp/ray/ray_current_cluster, even a dead one whose record a killed
    # head left behind (and then refuses num_cpus).
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=dashboard,
        dashboard_host=dashboard_host,
        namespace=namespace,
        runtime_env=runtime_env,
        log_to_driver=log_to_driver,
        _system_config=RAY_SYSTEM_CONFIG,
        **quiet,
    )
    log.info("started a local Ray instance with %s CPU slot(s)", ray.cluster_resources().get("CPU"))
    return "local"


def _ship(code_files: list[str]):
    """The package of code files for the job's py_modules (None: nothing to ship)."""
    import tempfile
    from pathlib import Path

    from hybridflow.controller.storage import stage_code_files

    if not code_files:
        return None
    package = stage_code_files(code_files, Path(tempfile.mkdtemp(prefix="hybridflow-code-")))
    log.info("shipping %d code file(s) to every node with the job: %s", len(code_files), ", ".join(code_files))
    return package
