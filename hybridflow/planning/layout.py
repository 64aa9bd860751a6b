"""Which rollout layouts can run: pure rules shared by the config check and the planner.

Each function returns every problem of a layout as (key, value, what is allowed), or as reasons;
the stage's plan check (`hybridflow.checks.rules`) reports the first, the planner
(`hybridflow.planning.rules.problems`) drops a candidate with any, and the preflight's model check
(`hybridflow.checks.model`) words vLLM's head split with `tp_head_problems`. Nothing here reads a
config: the callers pass the numbers.
"""

from __future__ import annotations

from typing import Any


def rollout_layout_problems(tp: int, ranks: int, pool: str, heads: int, kv_heads: int, engine=None,
                            colocated: bool = True, actor_pool: str = "") -> list[tuple[str, Any, str]]:
    """(key, value, what is allowed) for each reason a rollout of tensor-parallel size `tp` on pool
    `pool` of `ranks` ranks cannot run; the config check raises the first, the planner
    (hybridflow/planning/rules.py) drops a candidate with any. `heads` 0: the model's are unknown.
    `engine`: the `RolloutEngine` (hybridflow/config/engines.py); None: one that can run any layout."""
    problems = []
    if engine is not None and not engine.tensor_parallel and tp != 1:
        problems.append(("rollout.tensor_parallel_size", tp, f"rollout={engine.name} generates with one whole model "
                         "per rank; tensor parallelism needs an engine that splits one (rollout=vllm)"))
    if engine is not None and not engine.own_pool and not colocated:
        problems.append(("placement.roles.rollout", pool, f"rollout={engine.name} receives weights only in the "
                         f"actor's processes: set placement.roles.rollout={actor_pool} (or use rollout=vllm on a "
                         "pool of its own)"))
    if ranks % tp:
        divisors = [d for d in range(1, ranks + 1) if ranks % d == 0]
        problems.append(("rollout.tensor_parallel_size", tp, f"the rollout pool {pool!r} has {ranks} rank(s), which "
                         f"{tp}-rank engines do not divide: use one of {divisors} ({ranks} // TP engines), or give "
                         f"the pool a multiple of {tp} ranks (placement.pools.{pool}.devices_per_node)"))
    if heads:
        problems += [("rollout.tensor_parallel_size", tp, why) for why in tp_head_problems(tp, heads, kv_heads)]
    return problems


def overlap_problems(depth: int, overlaps: bool, rollout_colocated: bool, rollout_pool: str
                     ) -> list[tuple[str, Any, str]]:
    """(key, value, what is allowed) when schedule depth `depth` overlaps generation with training (`overlaps`:
    its schedule's, `hybridflow.rollout_schedules.schedule_class(depth).overlaps`) and the rollout shares the
    actor's processes; the config check raises it, the planner drops the plan."""
    if overlaps and rollout_colocated:
        return [("placement.roles.rollout", rollout_pool, f"trainer.max_staleness={depth} overlaps generation with "
                 "training, which needs the rollout on a pool of its own (placement=disaggregated); colocated roles "
                 "share one process")]
    return []


def tp_head_problems(tp: int, heads: int, kv_heads: int) -> list[str]:
    """Why vLLM cannot split a model of `heads` attention heads and `kv_heads` key/value heads over
    `tp` ranks, each with its fix (empty: it can). The stage's plan check (hybridflow/checks/rules.py) and the
    planner both say it with these words."""
    problems = []
    if heads % tp:
        problems.append(f"does not divide the {heads} attention heads, and vLLM splits them evenly across ranks; "
                        f"fix: a tensor_parallel_size that divides {heads}")
    if (kv_heads >= tp and kv_heads % tp) or (kv_heads < tp and tp % kv_heads):
        problems.append(f"neither divides the {kv_heads} key/value heads nor is a multiple of them (vLLM splits or "
                        f"replicates them evenly); fix: a tensor_parallel_size that divides {kv_heads} or is a "
                        "multiple of it")
    return problems
