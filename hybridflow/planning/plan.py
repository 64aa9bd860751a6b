"""The run's plan: which devices each role gets and how generation is laid out, as one frozen value.

A `Plan` holds what placement decides — the pools (nodes x devices per node, CPUs per device, node
affinity), which pool each role runs on, the rollout's tensor-parallel size (and so its replicas),
the device (cpu or cuda) and the weight transport that serves the placement there, the schedule
depth (`trainer.max_staleness`) and whether pools pin their cores. Each stage decides one before
anything starts (hybridflow/planning/auto.py `decide_plan`: `Plan.from_config`, called there only,
or placement=auto's best) and passes it by argument in its `hybridflow.run.stage.Stage`, saved as
run_dir/plan.json: the launcher, the pool reservation, role spawning, the memory model, the plan's
checks and the weight sync receive it, and nothing outside this package reads the config's pools, roles' pools or rollout TP
(tests/unit/test_layering.py). The planner (hybridflow/planning/search.py) makes candidates of the
same type and prints the overrides (`Plan.overrides`) that select each one. Which nodes a pool lands
on is decided later, against the cluster's free resources (hybridflow/controller/placement.py),
and saved in the same file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from hybridflow.planning.workload import MODEL_ROLES
from hybridflow.rollout_schedules import Schedule, schedule_class


@dataclass(frozen=True)
class PoolPlan:
    name: str
    nodes: int
    devices_per_node: int
    roles: tuple[str, ...]  # the roles on the pool, fused into one process per device
    cpus_per_device: float = 1.0
    node_affinity: str | None = None  # a node label the pool's nodes must carry (placement.pools.<name>.node_affinity)
    exclusive_nodes: bool = False  # no other pool shares its nodes

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
    device: str = field(default="", compare=False)  # 'cpu' or 'cuda', filled by `with_transport`; not a search choice

    # --- what consumers ask ---------------------------------------------------------------
    def pool_of(self, role: str) -> PoolPlan:
        """The pool of `role`; a role of a family (`teacher.<name>`, one of several teachers) is on its family's."""
        family = role.split(".", 1)[0]
        for pool in self.pools:
            if role in pool.roles or family in pool.roles:
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

    @property
    def cpus(self) -> float:
        """The CPUs its pools reserve (devices x cpus_per_device): what a local Ray must have."""
        return sum(p.devices * p.cpus_per_device for p in self.pools)

    def replica_size(self, role: str) -> int:
        """Ranks that work as one replica of `role`: the rollout's tensor-parallel size, else 1."""
        return self.rollout_tp if role == "rollout" else 1

    # --- making one -----------------------------------------------------------------------
    @classmethod
    def from_config(cls, config, schedule: type[Schedule] | None = None) -> "Plan":
        """The plan a config selects: its pools (those placement.roles names; every role the config
        maps is on one, whether or not the recipe starts it), rollout TP, staleness, CPU pinning
        (placement.pin_cpus, or the schedule's `overlaps`), the device (`precision.device_of`, as the
        dtypes decide it) and the transport that serves them. `schedule`: the class trainer.max_staleness
        chooses, where the caller has it (`hybridflow.run.stage.prepare_stage`), else asked here."""
        placement = config.placement
        pools = []
        for name, pool in placement.pools.items():
            roles = tuple(r for r in MODEL_ROLES if placement.roles.get(r) == name)
            if roles:
                pools.append(PoolPlan(name, pool.nodes, pool.devices_per_node, roles, pool.cpus_per_device,
                                      pool.node_affinity, pool.exclusive_nodes))
        plan = cls(tuple(pools), config.rollout.tensor_parallel_size, config.trainer.max_staleness,
                   pins_cpus(config, schedule))
        from hybridflow.precision import device_of

        return plan.with_transport(device_of(placement.device.value))  # auto: the device the config's dtypes chose

    def with_transport(self, device: str) -> "Plan":
        """The plan on `device` ('cpu' or 'cuda'), with the registered transport that serves its
        placement there."""
        from dataclasses import replace

        from hybridflow.resharding.transports import transport_class

        return replace(self, device=device, transport=transport_class(self.rollout_colocated, device).name)

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

    def placing_every_role(self) -> "Plan":
        """The plan with every role it does not place (a reward function, an unused critic) on the
        actor's pool, as a config that maps no pool of its own for them runs them."""
        from dataclasses import replace

        placed = {r for p in self.pools for r in p.roles}
        extra = tuple(r for r in MODEL_ROLES if r not in placed)
        actor = self.pool_of("actor").name
        return replace(self, pools=tuple(replace(p, roles=p.roles + extra) if p.name == actor else p
                                         for p in self.pools))

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
                                   "cpus_per_device": p.cpus_per_device, "node_affinity": p.node_affinity,
                                   "exclusive_nodes": p.exclusive_nodes} for p in self.pools},
                "rollout_tensor_parallel_size": self.rollout_tp, "rollout_replicas": self.rollout_replicas,
                "max_staleness": self.max_staleness, "pin_cpus": self.pin_cpus, "device": self.device,
                "transport": self.transport,
                "family": self.family(), "overrides": self.overrides()}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def pins_cpus(config, schedule: type[Schedule] | None = None) -> bool:
    """Whether the pools pin their cores: placement.pin_cpus, else whether the schedule overlaps
    generation with training (`schedule`, else the one trainer.max_staleness chooses)."""
    pin = config.placement.pin_cpus
    if pin is not None:
        return pin
    return (schedule or schedule_class(config.trainer.max_staleness)).overlaps


# --- the plan file: one per stage, run_dir/plan.json -----------------------------------------------
PLAN_FILE = "plan.json"


def save_plan(run_dir, plan: Plan, **sections) -> Path:
    """Write run_dir/plan.json: {"plan": the plan, **sections} (placement=auto adds its prediction,
    rates and runners-up; the launcher adds "nodes", where each pool landed)."""
    path = Path(run_dir) / PLAN_FILE
    path.write_text(json.dumps({"plan": plan.to_dict(), **sections}, indent=2))
    return path


def add_to_plan_file(run_dir, key: str, value) -> Path:
    """Add (or replace) one section of run_dir/plan.json."""
    path = Path(run_dir) / PLAN_FILE
    saved = json.loads(path.read_text()) if path.is_file() else {}
    saved[key] = value
    path.write_text(json.dumps(saved, indent=2))
    return path
