"""Running past one machine, at the edge where config meets the cluster (docs/cluster.md).

- `reserve_pools`: the nodes every pool of the stage's plan about to be spawned lands on, from what
  each node has free (hybridflow.controller.placement), printed and saved as the "nodes" section of
  the stage's plan file, run_dir/plan.json;
  the shared-storage check on the nodes it uses (hybridflow.controller.storage); then the pools,
  each pinned to its planned nodes. A plan that cannot fit raises before any pool is reserved.
- `code_files`: the code files the config names, shipped with the job when it joins a cluster.
- `lost_nodes` / `wait_until_plan_fits`: after a failure, which planned nodes left the cluster
  (and what they hosted), and a bounded wait until the placement fits the cluster again.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from hybridflow.output import console
from hybridflow.config.schema import HybridFlowConfig
from hybridflow.controller.placement import NodeAssignment, PlacementError
from hybridflow.controller.pools import PoolSpec, ResourcePool
from hybridflow.planning.plan import Plan, PoolPlan, add_to_plan_file

# the stage's run directory, the NodeAssignment of its pools once reserved, and the nodes whose storage was checked
_STATE: dict = {"run_dir": None, "nodes": None, "storage_checked": set()}
_REPORT_LAG_S = 5.0  # Ray's per-node free resources trail a release by up to about a second


class NodeLostError(RuntimeError):
    """A node hosting pools left the cluster mid-run; the message names it, its pools and ranks."""


def use_run_dir(run_dir: Path | None) -> None:
    """Where the plan is saved and which directory the storage check writes (set by the runner)."""
    _STATE.update(run_dir=None if run_dir is None else Path(run_dir), nodes=None, storage_checked=set())


def pool_spec(pool: PoolPlan, gpu: bool) -> PoolSpec:
    return PoolSpec(pool.name, pool.nodes, pool.devices_per_node, gpu, pool.cpus_per_device, pool.node_affinity,
                    pool.exclusive_nodes)


def _pool_specs(plan: Plan, names) -> list[PoolSpec]:
    pools = {p.name: p for p in plan.pools}
    return [pool_spec(pools[name], plan.device == "cuda") for name in names]


def assign_nodes(plan: Plan, pool_roles: dict[str, list[str]]) -> NodeAssignment:
    """The nodes of these pools of `plan` from the cluster's free resources now. An assignment that
    would fit the nodes' totals is retried for a moment, so a release that Ray has not reported yet
    does not refuse it; one that cannot fit even an empty cluster is refused at once."""
    import dataclasses

    from hybridflow.controller.placement import cluster_nodes, plan_placement

    specs = _pool_specs(plan, pool_roles)
    deadline = time.monotonic() + _REPORT_LAG_S
    while True:
        nodes = cluster_nodes()
        try:
            return plan_placement(specs, nodes, pool_roles)
        except PlacementError:
            empty = [dataclasses.replace(n, free=dict(n.total)) for n in nodes]
            if time.monotonic() > deadline or not _fits(specs, empty):
                raise
            time.sleep(0.5)


def _fits(specs: list[PoolSpec], nodes) -> bool:
    from hybridflow.controller.placement import plan_placement

    try:
        plan_placement(specs, nodes)
        return True
    except PlacementError:
        return False


def reserve_pools(config: HybridFlowConfig, plan: Plan, pool_roles: dict[str, list[str]]) -> dict[str, ResourcePool]:
    """Assign nodes, show, save and check; then one ResourcePool per pool pinned to its nodes."""
    assigned = assign_nodes(plan, pool_roles)
    _STATE["nodes"] = assigned
    run_dir = _STATE["run_dir"]
    saved = ""
    if run_dir is not None:
        saved = f"; saved to {add_to_plan_file(run_dir, 'nodes', assigned.to_dict())}"
    console.say(f"hybridflow: placement plan ({len(assigned.node_ids())} of {len(assigned.nodes)} node(s){saved}):\n"
                + "\n".join(assigned.lines()))
    if config.placement.check_storage:
        check_plan_storage(config, assigned)
    specs = dict(zip(pool_roles, _pool_specs(plan, pool_roles)))
    return {name: ResourcePool(specs[name], list(p.node_ids)) for name, p in assigned.pools.items()}


def check_plan_storage(config: HybridFlowConfig, plan: NodeAssignment) -> None:
    """The storage check on every planned node other than the driver's own (whose disk the
    preflight already read), once per node per run."""
    import ray

    from hybridflow.controller.storage import check_storage

    here = ray.get_runtime_context().get_node_id()
    nodes = {n: plan.node(n).name for n in plan.node_ids() if n != here and n not in _STATE["storage_checked"]}
    if not nodes:
        return
    reads = {key: str(path) for key, path in (("model.path", config.model.path),
                                               ("reward.reward_model.path", config.reward.reward_model.path),
                                               ("data.train_path", config.data.train_path),
                                               ("data.val_path", config.data.val_path)) if path is not None}
    run_dir = _STATE["run_dir"]
    start = time.perf_counter()
    check_storage(nodes, reads, code_files_by_key(config), None if run_dir is None else str(run_dir))
    _STATE["storage_checked"].update(nodes)
    console.say(f"hybridflow: shared storage checked on {len(nodes)} node(s) in {time.perf_counter() - start:.1f} s: "
                f"{len(reads)} input(s), {len(code_files_by_key(config))} code file(s)"
                + (", the run directory writable" if run_dir is not None else ""))


def code_files_by_key(config: HybridFlowConfig) -> dict[str, str]:
    """Config key -> file, for every `path/to/file.py:name` the workers load."""
    refs = {key: spec.fn for spec, key in zip(config.reward.function_specs(), config.reward.function_keys())}
    refs.update({f"rollout.agent[{i}]": ref.removeprefix("openenv:") for i, ref in enumerate(config.rollout.agent or [])})
    refs.update({f"rollout.openenv.{key}": ref for key in ("action", "observation")
                 if (ref := getattr(config.rollout.openenv, key)) is not None})
    return {key: ref.rpartition(":")[0] for key, ref in refs.items() if ref.rpartition(":")[0].endswith(".py")}


def code_files(config: HybridFlowConfig) -> list[str]:
    return sorted(set(code_files_by_key(config).values()))


_DIED_NODE = re.compile(r"node has died\. Node Id: ([0-9a-f]+)")


def lost_nodes(error: BaseException) -> str | None:
    """When planned nodes left the cluster: a message naming each, with the pools and ranks it
    hosted; None when every planned node is alive (the failure was something else)."""
    plan: NodeAssignment | None = _STATE["nodes"]
    if plan is None:
        return None
    from hybridflow.controller.placement import dead_nodes

    named = set(_DIED_NODE.findall(str(error)))
    gone = [n for n in plan.node_ids() if n in named] or dead_nodes(plan.node_ids())
    if not gone:
        return None
    parts = [f"node {plan.node(n).name} left the cluster; it hosted {', '.join(plan.hosted_on(n))}" for n in gone]
    return "; ".join(parts)


def wait_until_plan_fits(plan: Plan, wait_s: float) -> None:
    """Return once the pools of `plan` last reserved fit the cluster's free resources (on the remaining nodes,
    or on nodes that joined since); past `wait_s` raise the refusal, naming pools and nodes."""
    assigned: NodeAssignment | None = _STATE["nodes"]
    if assigned is None:
        return
    pool_roles = {name: list(p.roles) for name, p in assigned.pools.items()}
    deadline = time.monotonic() + wait_s
    announced = False
    while True:
        try:
            assign_nodes(plan, pool_roles)
            return
        except PlacementError as exc:
            if time.monotonic() > deadline:
                raise PlacementError(f"the cluster did not regain room for the pools within {wait_s:g} s "
                                     f"(placement.node_wait_s): {exc}") from None
            if not announced:
                console.say(f"hybridflow: waiting up to {wait_s:g} s (placement.node_wait_s) for the cluster to "
                            "fit the pools again")
                announced = True
            time.sleep(2.0)
