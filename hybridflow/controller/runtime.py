"""Starting or joining Ray.

Without an address the controller starts a local Ray instance (the embedded default). With
`ray.address` set, or when the driver runs under `ray job submit` (which exports RAY_ADDRESS
to the job), it joins that cluster. The dashboard, when started, binds to loopback unless
`ray.dashboard_host` says otherwise.
"""

from __future__ import annotations

import logging
import os

import ray

log = logging.getLogger(__name__)


def connect(*, address: str | None, num_cpus: int | None, dashboard: bool, dashboard_host: str,
            namespace: str, env_vars: dict[str, str] | None = None) -> str:
    """Initialise Ray once for this driver; returns 'joined <address>' or 'local'."""
    if ray.is_initialized():
        return "already connected"
    runtime_env = {"env_vars": dict(env_vars or {})}
    # The driver reads RAY_ADDRESS here, at the edge, so workers never need to.
    target = address or os.environ.get("RAY_ADDRESS")
    if target:
        ray.init(address=target, namespace=namespace, runtime_env=runtime_env, log_to_driver=True)
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
        log_to_driver=True,
    )
    log.info("started a local Ray instance with %s CPU slot(s)", ray.cluster_resources().get("CPU"))
    return "local"
