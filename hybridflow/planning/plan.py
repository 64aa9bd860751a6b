"""The run's plan: which devices each role gets and how generation is laid out, as one frozen value.

A `Plan` holds what placement decides — the pools (nodes x devices per node), which pool each
role runs on, the rollout's tensor-parallel size (and so its replicas), the weight transport that
serves the placement, the schedule depth (`trainer.max_staleness`) and whether pools pin their
cores. `Plan.from_config` makes it once from a config; the launcher, the weight sync and the
feasibility rules (hybridflow/planning/rules.py) read it, and the planner
(hybridflow/planning/search.py) makes candidates of the same type and prints the overrides
(`Plan.overrides`) that select each one. Which nodes a pool lands on is decided later, against
the cluster's free resources (hybridflow/controller/placement.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from hybridflow.planning.workload import MODEL_ROLES


@dataclass(frozen=True)
class PoolPlan:
    name: str
    nodes: int
    devices_per_node: int
    roles: tuple[str, ...]  # the roles on the pool, fused into one process per device
    cpus_per_device: float = 1.0

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node


@dataclass(frozen=True)
class Plan:
    pools: tuple[PoolPlan, ...]
    rollout_tp: int = 1
    max_staleness: int = 0
    pin_cpus: bool = False
    old_log_probs: str = ""  # set when the depth needs another trainer.old_log_probs than the config's ('' keeps it)
    transport: str = field(default="", compare=False)  # filled by `with_transport`; not a search choice

    # --- what consumers ask ---------------------------------------------------------------
    def pool_of(self, role: str) -> PoolPlan:
        for pool in self.pools:
            if role in pool.roles:
                return pool
        raise KeyError(f"the plan puts role {role!r} on no pool (pools: {self.describe()})")

    def devices_of(self, role: str) -> int:
        return self.pool_of(role).devices

    @property
    def rollout_colocated(self) -> bool:
        return "actor" in self.pool_of("rollout").roles

    @property
    def rollout_replicas(self) -> int:
        return self.devices_of("rollout") // self.rollout_tp

    @property
    def devices(self) -> int:
        return sum(p.devices for p in self.pools)

    # --- making one -----------------------------------------------------------------------
    @classmethod
    def from_config(cls, config) -> "Plan":
        """The plan a config selects: its pools (those placement.roles names; every role the config
        maps is on one, whether or not the recipe starts it), rollout TP, staleness, CPU pinning
        (placement.pin_cpus, or the schedule's `overlaps`) and transport."""
        from hybridflow.rollout_schedules import schedule_class

        placement = config.placement
        pools = []
        for name, pool in placement.pools.items():
            roles = tuple(r for r in MODEL_ROLES if placement.roles.get(r) == name)
            if roles:
                pools.append(PoolPlan(name, pool.nodes, pool.devices_per_node, roles, pool.cpus_per_device))
        pin = placement.pin_cpus if placement.pin_cpus is not None else \
            schedule_class(config.trainer.max_staleness).overlaps
        plan = cls(tuple(pools), config.rollout.tensor_parallel_size, config.trainer.max_staleness, pin)
        from hybridflow.precision import device_of

        return plan.with_transport(device_of(placement.device.value))  # auto: the device the config's dtypes chose

    def with_transport(self, device: str) -> "Plan":
        """The plan with the registered transport that serves its placement on `device`."""
        from dataclasses import replace

        from hybridflow.resharding.transports import transport_class

        return replace(self, transport=transport_class(self.rollout_colocated, device).name)

    # --- showing one ----------------------------------------------------------------------
    def overrides(self) -> list[str]:
        """The command-line overrides that select this plan: its pools (added, or replacing one of the
        same name), every role's pool (a role the plan does not place, such as a reward function,
        goes on the actor's pool), the rollout's tensor-parallel size and the schedule depth."""
        out = []
        for p in self.pools:
            out.append(f"++placement.pools.{p.name}={{nodes:{p.nodes},devices_per_node:{p.devices_per_node}"
                       + (f",cpus_per_device:{p.cpus_per_device:g}" if p.cpus_per_device != 1 else "") + "}")
        out += [f"placement.roles.{role}={pool}" for role, pool in self.role_pools().items()]
        out += [f"rollout.tensor_parallel_size={self.rollout_tp}", f"trainer.max_staleness={self.max_staleness}"]
        if self.old_log_probs:
            out.append(f"trainer.old_log_probs={self.old_log_probs}")
        return out

    def role_pools(self) -> dict[str, str]:
        """Every role's pool; a role the plan does not place goes on the actor's pool."""
        actor = self.pool_of("actor").name
        return {role: next((p.name for p in self.pools if role in p.roles), actor) for role in MODEL_ROLES}

    def describe(self) -> str:
        """One line: `{actor,reference}x2 | {rollout}x1 tp1, depth 0`."""
        sets = " | ".join("{" + ",".join(p.roles) + "}" + f"x{p.devices}" for p in self.pools)
        return f"{sets}, rollout tp{self.rollout_tp}x{self.rollout_replicas}, depth {self.max_staleness}"

    def family(self) -> str:
        """The paper's names (§8.3): colocate (one set), standalone (one role per set), else split."""
        if len(self.pools) == 1:
            return "colocate"
        if all(len([r for r in p.roles if r != "rollout"]) <= 1 for p in self.pools):
            return "standalone"
        return "split"

    def to_dict(self) -> dict:
        return {"pools": {p.name: {"nodes": p.nodes, "devices_per_node": p.devices_per_node, "roles": list(p.roles),
                                   "cpus_per_device": p.cpus_per_device} for p in self.pools},
                "rollout_tensor_parallel_size": self.rollout_tp, "rollout_replicas": self.rollout_replicas,
                "max_staleness": self.max_staleness, "pin_cpus": self.pin_cpus, "transport": self.transport,
                "family": self.family(), "overrides": self.overrides()}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)
