"""The mapping search: every legal plan of a workload on a cluster, ranked by predicted seconds per step.

HybridFlow's Algorithm 1 (§6): enumerate the partitions of the roles into colocated sets (15 for
PPO's four models; here the rollout is a role of its own, so 52 for five), split the cluster's
devices over the sets (each set a divisor of a node's devices or a multiple of whole nodes,
together using every device), pick the rollout's tensor-parallel size and the schedule depth, drop
the plans the feasibility rules refuse (hybridflow/planning/rules.py), and price the rest with a
cost model (hybridflow/planning/cost.py). The paper's search takes up to half an hour because its
simulators model each 3D-parallel layout; here one closed form prices a plan in microseconds, so
the whole space is searched exactly.

A policy is one class: subclass `Policy`, give it a `name`, `register_policy` it, and select it with
`hybridflow plan --policy NAME` (a test registers a toy one).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

from hybridflow.planning.cost import CostModel, Prediction
from hybridflow.planning.plan import Plan, PoolPlan
from hybridflow.planning.rules import problems
from hybridflow.planning.workload import Cluster, Workload
from hybridflow.rollout_schedules import schedule_class
from hybridflow.registry import Registry


@dataclass(frozen=True)
class SearchOptions:
    # any rollout TP that divides the pool within a node, as the runtime runs (the default); False: 1 or the pool
    any_tp: bool = True
    depths: tuple[int, ...] = (0, 1)  # the schedule depths tried (trainer.max_staleness)


class Policy:
    """Proposes the plans to price; subclasses give `name` and `candidates`."""

    name = ""

    def candidates(self, workload: Workload, cluster: Cluster, options: SearchOptions) -> Iterator[Plan]:
        raise NotImplementedError


POLICIES: Registry[type[Policy]] = Registry("placement policy", "a Policy subclass with a `name`")


register_policy = POLICIES.add_class


def build_policy(name: str) -> Policy:
    return POLICIES.get(name)()


@register_policy
class Exhaustive(Policy):
    """Every colocated-set partition x device split x rollout TP x depth (the paper's Algorithm 1)."""

    name = "exhaustive"

    def candidates(self, workload: Workload, cluster: Cluster, options: SearchOptions) -> Iterator[Plan]:
        sizes = pool_sizes(cluster)
        schedules = {depth: schedule_class(depth) for depth in options.depths}  # asked once per depth
        for sets in set_partitions(list(workload.roles)):
            for split in device_splits(len(sets), cluster.devices, sizes):
                pools = tuple(make_pool(roles, n, cluster) for roles, n in zip(sets, split))
                rollout = next(p for p in pools if "rollout" in p.roles)
                for tp in tp_options(rollout.devices, cluster, options.any_tp):
                    for depth in options.depths:
                        overlaps = schedules[depth].overlaps
                        if overlaps and "actor" in rollout.roles:
                            continue  # an overlapping depth needs the rollout on its own pool (the rules say so)
                        fix = "actor" if schedules[depth].stale and workload.old_log_probs == "auto" else ""
                        yield Plan(pools, tp, depth, pin_cpus=overlaps and cluster.device == "cpu", old_log_probs=fix)


def set_partitions(items: list[str]) -> Iterator[list[tuple[str, ...]]]:
    """Every partition of `items` into non-empty sets (Bell(len) of them), the first item's set first."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in set_partitions(rest):
        for i in range(len(partition)):
            yield [tuple([first, *partition[i]]) if j == i else s for j, s in enumerate(partition)]
        yield [(first,), *partition]


def pool_sizes(cluster: Cluster) -> list[int]:
    """Device counts a pool may have: divisors of a node's devices, or whole nodes."""
    per_node = cluster.devices_per_node
    small = [d for d in range(1, per_node + 1) if per_node % d == 0]
    return small + [per_node * k for k in range(2, cluster.nodes + 1)]


def device_splits(sets: int, devices: int, sizes: list[int]) -> Iterator[tuple[int, ...]]:
    """Ways to give each of `sets` pools a size from `sizes`, together all `devices`."""
    if sets == 1:
        if devices in sizes:
            yield (devices,)
        return
    for first in sizes:
        if first < devices:
            for rest in device_splits(sets - 1, devices - first, sizes):
                yield (first, *rest)


def tp_options(devices: int, cluster: Cluster, any_tp: bool) -> list[int]:
    if any_tp:
        return [t for t in range(1, min(devices, cluster.devices_per_node) + 1) if devices % t == 0]
    return sorted({1, devices})


def make_pool(roles: tuple[str, ...], devices: int, cluster: Cluster) -> PoolPlan:
    name = "actor" if "actor" in roles else roles[0]
    if devices <= cluster.devices_per_node:
        return PoolPlan(name, 1, devices, roles, cluster.cores_per_device)
    return PoolPlan(name, devices // cluster.devices_per_node, cluster.devices_per_node, roles,
                    cluster.cores_per_device)


@dataclass
class Candidate:
    plan: Plan
    prediction: Prediction

    def to_dict(self) -> dict:
        return {"plan": self.plan.to_dict(), "prediction": self.prediction.to_dict()}


@dataclass
class SearchResult:
    ranked: list[Candidate]  # fastest first
    refused: list[tuple[Plan, list[str]]] = field(default_factory=list)
    seconds: float = 0.0
    considered: int = 0

    @property
    def best(self) -> Candidate:
        if not self.ranked:
            raise LookupError(self.why_none())
        return self.ranked[0]

    def why_none(self) -> str:
        shown = "\n".join(f"  - {plan.describe()}:\n      " + "\n      ".join(p) for plan, p in self.refused[:3])
        return (f"no plan fits: all {self.considered} candidate(s) were refused; the first few and why:\n{shown}\n"
                "Fix: more or larger devices, model.dtype=bfloat16, fewer prompts per step or shorter answers")


def search(workload: Workload, cluster: Cluster, cost: CostModel, policy: Policy | None = None,
           options: SearchOptions | None = None) -> SearchResult:
    """Every candidate of `policy`, the refused ones with their problems, the rest ranked by `cost`."""
    policy, options = policy or Exhaustive(), options or SearchOptions()
    start = time.perf_counter()
    ranked, refused, considered = [], [], 0
    for plan in policy.candidates(workload, cluster, options):
        considered += 1
        found = problems(plan, workload, cluster, options.any_tp)
        if found:
            refused.append((plan, found))
        else:
            ranked.append(Candidate(plan, cost.predict(plan, workload, cluster)))
    ranked.sort(key=lambda c: c.prediction.step_s)
    return SearchResult(ranked, refused, time.perf_counter() - start, considered)
