"""Whether a plan can run: pure rules that return every problem of a candidate, never raise.

`problems(plan, workload, cluster)` lists why a plan cannot run on the cluster, each naming the
override to change: the rollout layout and the schedule (an overlapping depth needs the rollout on a pool of its own):
the same functions the config check raises with (`hybridflow.planning.layout`: `rollout_layout_problems`,
`overlap_problems`, `tp_head_problems`), the devices and nodes the
pools need, and memory: each device's terms (`memory_terms`) against what a device holds. The
planner drops a candidate with any problem and prints the memory terms of those it drops for memory.

The memory terms are the run's own memory model (hybridflow/checks/memory_budget.py `device_terms`, the
floor the preflight refuses a configured run with), given the workload instead of a config and
each pool of the plan instead of the actor's: the roles on a pool share its devices and all stay
resident (no offload between stages; on GPUs the run's own phases, `phases`: a colocated actor and
engine take turns, and the engine takes its `rollout.gpu_memory_utilization` share);
FSDP shards the trained roles' parameters, gradients and AdamW moments and the other models' weights
over the pool; the rollout holds 1/tp of the weights and a KV cache (on a CPU, vLLM's fixed
`rollout.kv_cache_space_gib`; on a GPU what its share leaves, at least one sequence at full length,
and generation runs in waves when the sequences do not all fit); one micro-batch's
activations and logits (`Workload.micro_batch_rows` rows; with `checkpointing`, one hidden vector per
layer and one layer's worth recomputed; 1/SP of their tokens per rank with sequence parallelism, plus its
all-to-all buffers and gathered values, and a pool whose ranks SP does not divide is refused); the actor's gathered embeddings; on a CPU the process's
measured runtime.
"""

from __future__ import annotations

from hybridflow.planning.plan import Plan, PoolPlan
from hybridflow.checks.memory_budget import GPU_MEMORY_SHARE, device_terms, gpu_device_phases
from hybridflow.planning.workload import GIB, Cluster, Workload
from hybridflow.rollout_schedules import schedule_class


def problems(plan: Plan, workload: Workload, cluster: Cluster, any_tp: bool = False) -> list[str]:
    """Every reason `plan` cannot run `workload` on `cluster` (empty: it can). `any_tp`: allow any
    rollout tensor-parallel size that divides the pool within a node (the paper's engines; this
    system's vLLM rollout runs one engine per rank or one across the pool)."""
    from hybridflow.planning.layout import overlap_problems, rollout_layout_problems, tp_head_problems

    out = [f"role {role!r} is on no pool" for role in workload.roles if not any(role in p.roles for p in plan.pools)]
    if out:
        return out
    rollout = plan.pool_of("rollout")
    if any_tp:
        if rollout.devices % plan.rollout_tp or plan.rollout_tp > cluster.devices_per_node:
            out.append(f"rollout.tensor_parallel_size={plan.rollout_tp}: must divide the rollout pool's "
                       f"{rollout.devices} devices and fit in one node ({cluster.devices_per_node} devices)")
        else:
            out += [f"rollout.tensor_parallel_size={plan.rollout_tp}: {why}"
                    for why in tp_head_problems(plan.rollout_tp, workload.heads, workload.kv_heads)]
    else:
        out += [f"{key}={value}: {allowed}" for key, value, allowed in rollout_layout_problems(
            plan.rollout_tp, rollout.devices, rollout.name, workload.heads, workload.kv_heads,
            colocated=plan.rollout_colocated, actor_pool=plan.pool_of("actor").name)]
    out += [f"{key}={value}: {allowed}"
            for key, value, allowed in overlap_problems(plan.max_staleness, schedule_class(plan.max_staleness).overlaps,
                                                        plan.rollout_colocated, rollout.name)]
    out += device_problems(plan, cluster)
    out += [f"{key}={size}: the {role} pool's {plan.devices_of(role)} device(s) do not divide into sequence-parallel "
            f"groups of {size}" for role, size in workload.sequence_parallel().items()
            for key in [("actor" if role == "reference" else role) + ".sequence_parallel_size"]
            if plan.devices_of(role) % size]
    if cluster.device == "cuda" and workload.engine_memory:
        share = workload.gpu_memory_utilization * cluster.device_memory_bytes
        need = workload.parameters * workload.rollout_bytes / plan.rollout_tp + kv_per_sequence(plan, workload)
        if share < need:
            out.append(f"rollout.gpu_memory_utilization={workload.gpu_memory_utilization}: the engine's share, "
                       f"{share / GIB:.1f} GiB of each GPU, is below its 1/{plan.rollout_tp} of the weights and one "
                       f"sequence's KV cache ({need / GIB:.1f} GiB)")
    usable = usable_bytes(cluster)
    for pool in plan.pools:
        for phase, terms in phases(plan, pool, workload, cluster).items():
            if sum(terms.values()) > usable:
                out.append(f"pool {pool.name!r} ({'+'.join(pool.roles)} on {pool.devices} device(s)) does not fit"
                           f"{phase}: {sum(terms.values()) / GIB:.1f} GiB per device, above "
                           f"{usable / GIB:.1f} GiB (of {cluster.device_memory_bytes / GIB:.1f}):"
                           + "".join(f"\n      {v / GIB:8.2f} GiB  {k}" for k, v in terms.items()))
    return out


def usable_bytes(cluster: Cluster) -> float:
    """What the memory terms of one device may sum to: a GPU's GPU_MEMORY_SHARE (the rest is the allocator's
    fragmentation and transient buffers), a CPU slot's whole share of its node."""
    return (GPU_MEMORY_SHARE if cluster.device == "cuda" else 1.0) * cluster.device_memory_bytes


def pool_peaks(plan: Plan, workload: Workload, cluster: Cluster) -> dict[str, float]:
    """Each pool's largest per-device sum of memory terms over the phases of the step (`phases`), by pool name."""
    return {pool.name: max(sum(terms.values()) for terms in phases(plan, pool, workload, cluster).values())
            for pool in plan.pools}


def phases(plan: Plan, pool: PoolPlan, workload: Workload, cluster: Cluster) -> dict[str, dict[str, float]]:
    """The memory terms a device of `pool` holds at once, per phase of the step: on GPUs the run's own
    GPU phases (hybridflow/checks/memory_budget.py `gpu_device_phases`: training, and with a vLLM engine
    its start, the weight sync and generation, the engine taking its `gpu_memory_utilization` share;
    `" (training)"` ...), on CPUs one phase, `""`, with every term."""
    if cluster.device != "cuda":
        return {"": memory_terms(plan, pool, workload, cluster)}
    held = [r for r in pool.roles if r in workload.roles]
    return {f" ({name})": terms for name, terms in gpu_device_phases(
        workload.memory_inputs(), held, pool.devices, plan.rollout_tp, cluster.device_memory_bytes).items()}


def device_problems(plan: Plan, cluster: Cluster) -> list[str]:
    """The pools need more devices or nodes than the cluster has (pools larger than a node take
    whole nodes; smaller ones are packed first-fit, largest first)."""
    out = []
    if plan.devices > cluster.devices:
        out.append(f"the pools take {plan.devices} devices; the cluster has {cluster.devices} ({cluster.describe()})")
    free = [cluster.devices_per_node] * cluster.nodes
    for pool in sorted(plan.pools, key=lambda p: -p.devices_per_node * p.nodes):
        if pool.devices_per_node > cluster.devices_per_node:
            out.append(f"pool {pool.name!r} asks {pool.devices_per_node} devices per node; nodes have "
                       f"{cluster.devices_per_node}")
            continue
        for _ in range(pool.nodes):
            node = next((i for i, f in enumerate(free) if f >= pool.devices_per_node), None)
            if node is None:
                out.append(f"pool {pool.name!r} ({pool.nodes} node(s) x {pool.devices_per_node}) finds no node with "
                           f"{pool.devices_per_node} free device(s) after the larger pools")
                break
            free[node] -= pool.devices_per_node
    return out


def kv_per_sequence(plan: Plan, workload: Workload) -> float:
    """Bytes of KV cache one sequence at full length takes on each of its engine's devices."""
    w = workload
    return (w.prompt_tokens + w.response_tokens) * w.kv_bytes_per_token() / plan.rollout_tp


def memory_terms(plan: Plan, pool: PoolPlan, workload: Workload, cluster: Cluster) -> dict[str, float]:
    """Bytes per device of `pool` with every role on it, term by term: the memory model of
    hybridflow/checks/memory_budget.py (`device_terms`), the KV cache on a GPU at its floor, one sequence at
    full length (the CPU's rule, and what `hybridflow plan` prints; on GPUs the rules check `phases`)."""
    kv = None if cluster.device == "cpu" else (
        f"rollout KV cache (one sequence at full length, 1/{plan.rollout_tp})", kv_per_sequence(plan, workload))
    held = [r for r in pool.roles if r in workload.roles]  # roles with a model
    return device_terms(workload.memory_inputs(), held, pool.devices, plan.rollout_tp, cluster.device, kv=kv)
