"""The nodes every pool of a stage's plan lands on, assigned before any pool is reserved.

The stage's `Plan` (hybridflow/planning/plan.py) says how many nodes and devices each pool has;
this module says which nodes (a `NodeAssignment`, saved as the "nodes" section of the plan's file).
`plan_placement(pools, nodes)` is a pure function: given each pool's needs (nodes x devices per
node x one bundle per device, an optional node affinity, whether it keeps its nodes to itself)
and what each node of the cluster has *free*, it assigns every pool its nodes, or raises
`PlacementError` naming the pools, the nodes and what each has. Pools are placed hardest first
(exclusive, then with an affinity, then by the size of one node's worth of bundles), each node
chosen best-fit (the fitting node with the least left over), so two pools that each fill a node
get two nodes and a small pool does not take the one node a big pool needs. A greedy plan may
refuse a placement that an exhaustive search would find; the message then shows what was free.

`cluster_nodes()` reads the nodes and their free resources from Ray (the per-node view verl's
resource pool manager reads too); `ResourcePool.create` then reserves exactly the planned nodes.
Affinity: `key=value` is a Ray node label (`ray start --labels='{"tier": "gen"}'`), a bare name a
custom resource the node has (`ray start --resources='{"gen_node": 1}'`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

_EPS = 1e-9


@dataclass(frozen=True)
class PoolSpec:
    name: str
    nodes: int = 1
    devices_per_node: int = 1
    use_gpu: bool = False
    cpus_per_device: float = 1.0
    node_affinity: str | None = None  # 'label=value' (a Ray node label) or a custom resource name
    exclusive_nodes: bool = False  # no other pool on this pool's nodes

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.devices_per_node < 1:
            raise ValueError(
                f"pool {self.name!r}: nodes and devices_per_node must be >= 1, "
                f"got nodes={self.nodes}, devices_per_node={self.devices_per_node}"
            )
        if self.cpus_per_device <= 0:
            raise ValueError(f"pool {self.name!r}: cpus_per_device must be > 0, got {self.cpus_per_device}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def bundle(self) -> dict[str, float]:
        bundle = {"CPU": float(self.cpus_per_device)}
        if self.use_gpu:
            bundle["GPU"] = 1.0
        return bundle


class PlacementError(RuntimeError):
    """The pools do not fit the cluster's free resources; nothing was reserved."""


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    address: str
    total: dict[str, float]
    free: dict[str, float]
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.address} ({self.node_id[:8]})"


@dataclass(frozen=True)
class PoolPlacement:
    pool: str
    roles: tuple[str, ...]
    node_ids: tuple[str, ...]  # one per node of the pool, node-major rank order
    devices_per_node: int
    bundle: dict[str, float]

    def ranks_on(self, node_id: str) -> list[int]:
        return [i * self.devices_per_node + d for i, n in enumerate(self.node_ids) if n == node_id
                for d in range(self.devices_per_node)]


@dataclass(frozen=True)
class NodeAssignment:
    """Where each pool of the stage's plan (hybridflow/planning/plan.py) landed: its nodes and ranks."""

    pools: dict[str, PoolPlacement]
    nodes: list[NodeInfo]  # as they were when the plan was made

    def node(self, node_id: str) -> NodeInfo:
        return next(n for n in self.nodes if n.node_id == node_id)

    def node_ids(self) -> list[str]:
        return sorted({n for p in self.pools.values() for n in p.node_ids})

    def hosted_on(self, node_id: str) -> list[str]:
        """'pool <name> (<roles>) rank(s) <r>' for every pool with ranks on the node."""
        out = []
        for p in self.pools.values():
            ranks = p.ranks_on(node_id)
            if ranks:
                out.append(f"pool {p.pool!r} ({'+'.join(p.roles) or 'no role'}) rank(s) {_ranks(ranks)}")
        return out

    def lines(self) -> list[str]:
        """The plan as the console shows it: one line per pool, then the nodes it uses."""
        out = []
        for p in self.pools.values():
            where = ", ".join(f"{self.node(n).name} ranks {_ranks(p.ranks_on(n))}" for n in dict.fromkeys(p.node_ids))
            out.append(f"  pool {p.pool!r} ({'+'.join(p.roles) or 'no role'}): {len(p.node_ids)} node(s) x "
                       f"{p.devices_per_node} x {_res(p.bundle)} -> {where}")
        return out

    def to_dict(self) -> dict:
        return {
            "pools": {name: {"roles": list(p.roles), "devices_per_node": p.devices_per_node, "bundle": p.bundle,
                             "nodes": [{"node_id": n, "address": self.node(n).address, "ranks": p.ranks_on(n)}
                                       for n in dict.fromkeys(p.node_ids)]}
                      for name, p in self.pools.items()},
            "nodes": [{"node_id": n.node_id, "address": n.address, "total": n.total, "free_before": n.free,
                       "labels": n.labels} for n in self.nodes],
        }


def node_need(spec: PoolSpec) -> dict[str, float]:
    """What one node of the pool takes: its bundles summed (STRICT_PACK on one node)."""
    return {k: v * spec.devices_per_node for k, v in spec.bundle().items()}


def plan_placement(pools: list[PoolSpec], nodes: list[NodeInfo], roles: dict[str, list[str]] | None = None
                   ) -> NodeAssignment:
    """Every pool's nodes from what each node has free; raises PlacementError when they do not fit."""
    roles = roles or {}
    free = {n.node_id: dict(n.free) for n in nodes}
    owner: dict[str, set[str]] = {n.node_id: set() for n in nodes}  # node -> pools placed on it
    exclusive: set[str] = set()  # nodes an exclusive pool holds
    placed: dict[str, tuple[str, ...]] = {}
    for spec in sorted(pools, key=_difficulty):
        need = node_need(spec)
        chosen: list[str] = []
        for _ in range(spec.nodes):
            fits = [n for n in nodes if n.node_id not in chosen and n.node_id not in exclusive
                    and not (spec.exclusive_nodes and owner[n.node_id]) and _matches(n, spec.node_affinity)
                    and _fits(free[n.node_id], need)]
            if not fits:
                raise PlacementError(_refusal(spec, need, len(chosen), pools, nodes, free, owner, placed))
            best = min(fits, key=lambda n: (_leftover(free[n.node_id], need), nodes.index(n)))
            chosen.append(best.node_id)
            for k, v in need.items():
                free[best.node_id][k] = free[best.node_id].get(k, 0.0) - v
            owner[best.node_id].add(spec.name)
            if spec.exclusive_nodes:
                exclusive.add(best.node_id)
        placed[spec.name] = tuple(chosen)
    return NodeAssignment({s.name: PoolPlacement(s.name, tuple(roles.get(s.name, ())), placed[s.name],
                                                s.devices_per_node, s.bundle()) for s in pools}, list(nodes))


def _difficulty(spec: PoolSpec) -> tuple:
    need = node_need(spec)
    return (not spec.exclusive_nodes, spec.node_affinity is None, -need.get("GPU", 0.0), -need.get("CPU", 0.0),
            -spec.nodes, spec.name)


def _matches(node: NodeInfo, affinity: str | None) -> bool:
    if affinity is None:
        return True
    key, sep, value = affinity.partition("=")
    if sep:
        return node.labels.get(key.strip()) == value.strip()
    return node.total.get(affinity, 0.0) > 0


def _fits(free: dict[str, float], need: dict[str, float]) -> bool:
    return all(free.get(k, 0.0) + _EPS >= v for k, v in need.items())


def _leftover(free: dict[str, float], need: dict[str, float]) -> tuple[float, float]:
    return (free.get("GPU", 0.0) - need.get("GPU", 0.0), free.get("CPU", 0.0) - need.get("CPU", 0.0))


def _refusal(spec, need, got, pools, nodes, free, owner, placed) -> str:
    wants = f"{spec.nodes} node(s) with {_res(need)} free each"
    if spec.node_affinity:
        wants += f" and node affinity {spec.node_affinity!r}"
    if spec.exclusive_nodes:
        wants += ", none shared with another pool (exclusive_nodes)"
    lines = [f"placement plan refused: pool {spec.name!r} needs {wants}, and only {got} such node(s) remain"
             + (f" after placing {', '.join(repr(p) for p in placed)}" if placed else "") + ". Nothing was reserved."]
    lines.append("pools: " + "; ".join(f"{s.name!r} {s.nodes} node(s) x {s.devices_per_node} x {_res(s.bundle())}"
                                       + (f" affinity {s.node_affinity!r}" if s.node_affinity else "")
                                       + (" exclusive" if s.exclusive_nodes else "") for s in pools))
    for n in nodes:
        used = f", planned for {', '.join(sorted(owner[n.node_id]))}" if owner[n.node_id] else ""
        labels = {k: v for k, v in n.labels.items() if not k.startswith("ray.io/")}
        lines.append(f"  node {n.name}: free {_res(n.free)} of {_res(n.total)}"
                     + (f", labels {labels}" if labels else "") + used
                     + (f", left after the plan so far {_res(free[n.node_id])}" if used else ""))
    if not nodes:
        lines.append("  (no alive node)")
    lines.append("Fix: lower placement.pools.<name>.nodes / devices_per_node / cpus_per_device, drop a node_affinity "
                 "or exclusive_nodes, or add nodes to the cluster (docs/cluster.md).")
    return "\n".join(lines)


def _res(resources: dict[str, float]) -> str:
    shown = {k: v for k, v in resources.items() if k in ("CPU", "GPU") or not (
        k.startswith("node:") or k in ("memory", "object_store_memory") or k.startswith("accelerator_type"))}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(shown.items())) + "}"


def _ranks(ranks: list[int]) -> str:
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def cluster_nodes() -> list[NodeInfo]:
    """The alive nodes with their total and free resources and labels, head first."""
    import ray
    from ray._private.state import available_resources_per_node  # a DeveloperAPI: the per-node free view

    free = available_resources_per_node()
    out = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        total = {k: float(v) for k, v in node.get("Resources", {}).items()}
        out.append(NodeInfo(node["NodeID"], node.get("NodeManagerAddress", "?"), total,
                            {k: float(v) for k, v in free.get(node["NodeID"], {}).items()},
                            dict(node.get("Labels") or {})))
    out.sort(key=lambda n: "node:__internal_head__" not in n.total)
    return out


def dead_nodes(node_ids: list[str]) -> list[str]:
    """Those of `node_ids` that Ray no longer counts alive."""
    import ray

    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    return [n for n in node_ids if n not in alive]
