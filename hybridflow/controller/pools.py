"""Resource pools: Ray placement groups built from a spec (nodes x devices per node).

A pool reserves one bundle per device: one GPU (plus a few CPUs) on a GPU cluster, or a
CPU slot on a machine without GPUs. Each node's bundles form one STRICT_PACK placement
group pinned to a distinct node, so rank r of a pool always lives on node r // devices_per_node
and a pool of two nodes really spans two nodes. Ranks are numbered node-major.

Which nodes: those a placement plan gave the pool (hybridflow.controller.placement, one plan for
all pools of a run, from each node's free resources); a pool created without a plan plans for
itself alone, from what is free now.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # Ray is imported where a pool is reserved: specs and plans need none
    from ray.util.placement_group import PlacementGroup

from hybridflow.controller.placement import PoolSpec, cluster_nodes, plan_placement  # the spec lives with its plan

NODE_ID_LABEL = "ray.io/node-id"


@dataclass(frozen=True)
class Slot:
    """Where one rank runs: a bundle of a placement group on a known node."""

    rank: int
    placement_group: PlacementGroup
    bundle_index: int
    node_id: str


class ResourcePool:
    def __init__(self, spec: PoolSpec, node_ids: list[str] | None = None) -> None:
        if node_ids is not None and len(node_ids) != spec.nodes:
            raise ValueError(f"pool {spec.name!r}: {len(node_ids)} node(s) given for nodes={spec.nodes}")
        self.spec, self.node_ids = spec, node_ids
        self._groups: list[tuple[PlacementGroup, str]] = []

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    def create(self, timeout_s: float = 60.0) -> "ResourcePool":
        """Reserve the pool's bundles; raises naming the pool if the cluster cannot hold it."""
        if self._groups:
            return self
        import ray
        from ray.util.placement_group import placement_group

        nodes = self.node_ids or self._pick_nodes()
        for i, node_id in enumerate(nodes):
            bundles = [self.spec.bundle() for _ in range(self.spec.devices_per_node)]
            pg = placement_group(
                bundles,
                strategy="STRICT_PACK",
                name=f"hybridflow-{self.spec.name}-node{i}",
                bundle_label_selector=[{NODE_ID_LABEL: node_id}] * len(bundles),
            )
            self._groups.append((pg, node_id))
        ready = [pg.ready() for pg, _ in self._groups]
        done, pending = ray.wait(ready, num_returns=len(ready), timeout=timeout_s)
        if pending:
            self.remove()
            raise RuntimeError(
                f"resource pool {self.spec.name!r} could not reserve {self.spec.nodes} node(s) x "
                f"{self.spec.devices_per_node} bundle(s) of {self.spec.bundle()} within {timeout_s:.0f} s; "
                f"cluster resources available: {ray.available_resources()}. "
                "Reduce placement.pools.<name>.devices_per_node / nodes, or add nodes."
            )
        return self

    def _pick_nodes(self) -> list[str]:
        """A plan for this pool alone, from what each alive node has free now."""
        return list(plan_placement([self.spec], cluster_nodes()).pools[self.spec.name].node_ids)

    def slots(self) -> list[Slot]:
        if not self._groups:
            raise RuntimeError(f"resource pool {self.spec.name!r} is not created yet; call create() first")
        slots = []
        for pg, node_id in self._groups:
            for b in range(self.spec.devices_per_node):
                slots.append(Slot(len(slots), pg, b, node_id))
        return slots

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for pg, _ in self._groups:
            remove_placement_group(pg)
        self._groups = []


class CoreLedger:
    """Hands out CPU cores per node, in order, to the processes of one run's pools: a process
    asking for `count` cores on a node gets the next `count` core indices there (an index into
    that node's cores, which only the process itself can read). Pure bookkeeping, no Ray."""

    def __init__(self) -> None:
        self.next: dict[str, int] = {}

    def take(self, node_id: str, count: int) -> tuple[int, int]:
        start = self.next.get(node_id, 0)
        self.next[node_id] = start + count
        return start, count
