"""Predicted seconds per step of a plan: the paper's `d_cost`, plus the weight transition and overlap.

`CostModel.predict(plan, workload, cluster)` returns a `Prediction`: each stage's seconds and the
step's. `Analytical` (the default, registered as "analytical") follows HybridFlow's §6 / Appendix C:

- per role, a time on its pool's n devices: training and forward passes compute-bound
  (6·P·T and 2·P·T FLOPs over n devices' rates) with FSDP's gathers and reductions overlapped with
  compute on GPUs, after it on CPUs (each optimizer step gathers the parameters twice and
  reduce-scatters the gradients in the master dtype through each device, at the pool's collective bandwidth:
  within a node or across nodes); generation memory-bound (each decode step of a replica reads 1/tp
  of the weights and its sequences' KV cache, or is bound by its FLOPs, plus a fixed cost per engine
  step and per tensor-parallel step; sequences beyond what the KV cache holds run in later waves);
- within a pool the roles' times add (they take turns on its devices), across pools a stage takes
  the slowest pool, and the stages add up: generate + score (forward passes) + update;
- unlike the paper, the weight transition is a stage of its own (`transition`): the bytes the
  resharding engine moves (colocated: what each rank's FSDP shard lacks; on a pool of its own: the
  broadcast transport's, each TP rank's slice once to all its replicas at once, so the whole model
  once over the training side's link) at the bandwidth between them, and on GPUs with the actor and
  rollout on one pool the trips to host memory that let them take turns (the actor's training
  state out and back, vLLM's weights out and back when it sleeps); and at `max_staleness >= 1` generation
  overlaps scoring and updating, so a step takes max(generate + the work of the roles sharing the
  rollout's pool, score + update) + transition.

Each time also carries a fixed cost per call (`Rates.call_s`: the controller's round trip, Python;
`Rates.sync_s` per weight sync: its check and the engine's load session), which dominates on
small models. The rates come from a device profile (`profiles.py`, datasheet
numbers with stated efficiencies) or are fitted on the user's machine (`calibrate.py`).

A new cost model is one class: subclass `CostModel`, give it a `name`, and `register_cost_model` it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from hybridflow.config.schema import STEP_STAGES
from hybridflow.planning.plan import Plan, PoolPlan
from hybridflow.planning.rules import kv_per_sequence
from hybridflow.planning.workload import Cluster, Workload
from hybridflow.registry import Registry

# The stages the cost model prices, each with the step stage (STEP_STAGES) whose timing it predicts: the
# paper's "transition" is the weight sync; the advantages (milliseconds) are not priced.
PRICED_STAGES = {"generate": "generate", "score": "score", "update": "update", "transition": "weight_sync"}
assert set(PRICED_STAGES.values()) <= set(STEP_STAGES)
STAGES = tuple(PRICED_STAGES)


@dataclass(frozen=True)
class Rates:
    """What one device does per second, and the fixed costs; how they were found is `source`."""

    train_flops_per_s: float  # sustained in the update (forward + backward)
    forward_flops_per_s: float  # sustained in a forward pass (log-probs, values) and in prefill
    decode_bytes_per_s: float  # memory bandwidth a decode step reads weights and KV cache at
    decode_flops_per_s: float  # sustained in decode (bounds large batches)
    decode_step_s: float  # fixed per engine step (scheduler, sampling, kernel launches)
    tp_step_s: float  # added per decode step by tensor parallelism (its all-reduces), per extra rank
    call_s: float  # fixed per stage call (controller round trip)
    intra_node_bytes_per_s: float  # collectives within a node (FSDP, colocated resharding, pools on one node)
    inter_node_bytes_per_s: float  # collectives across nodes
    sync_s: float = 0.0  # fixed per weight sync (its check, the engine's load session)
    exchange_bytes_per_s: float = 0.0  # the colocated resharding exchange (0: intra_node_bytes_per_s)
    send_bytes_per_s: float = 0.0  # one flat buffer from one pool to another on a node (0: intra_node_bytes_per_s)
    host_bytes_per_s: float = 0.0  # offload to and reload from host memory (0: no offload)
    # FSDP's collectives run beside compute (GPUs: NCCL on its own streams) or after it (a CPU's
    # cores do both): a role's time is max(compute, comm) or their sum
    comm_overlap: bool = True
    source: str = ""
    # ((stage, factor), ...): each stage's predicted seconds times its factor, the running fit's
    # correction on a device whose runs measured otherwise (hybridflow/planning/device_rates.py)
    stage_scale: tuple = ()

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "Rates":
        values = dict(values)
        values["stage_scale"] = tuple((str(s), float(f)) for s, f in values.get("stage_scale", ()))
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> "Rates":
        return cls.from_dict(json.loads(text))


@dataclass
class Prediction:
    stages: dict[str, float]  # seconds of each of STAGES
    step_s: float
    roles: dict[str, float] = field(default_factory=dict)  # seconds of each role's work, for the printout

    def to_dict(self) -> dict:
        return {"step_s": self.step_s, "stages": self.stages, "roles": self.roles}


class CostModel:
    """Predicts a plan's seconds per step; subclasses give `name` and `predict`."""

    name = ""

    def __init__(self, rates: Rates) -> None:
        self.rates = rates

    def predict(self, plan: Plan, workload: Workload, cluster: Cluster) -> Prediction:
        raise NotImplementedError


COST_MODELS: Registry[type[CostModel]] = Registry("cost model", "a CostModel subclass with a `name`")


register_cost_model = COST_MODELS.add_class


def build_cost_model(name: str, rates: Rates) -> CostModel:
    return COST_MODELS.get(name)(rates)


@register_cost_model
class Analytical(CostModel):
    name = "analytical"

    def predict(self, plan: Plan, workload: Workload, cluster: Cluster) -> Prediction:
        from hybridflow.rollout_schedules import schedule_class

        schedule = schedule_class(plan.max_staleness)
        roles: dict[str, float] = {}
        score_by_pool, update_by_pool = {}, {}
        actor_forward = workload.actor_forwards(schedule.stale)
        for pool in plan.pools:
            score = update = 0.0
            for role in pool.roles:
                if role == "actor":
                    if actor_forward:
                        roles["actor forward"] = self.forward_s(workload, pool, cluster)
                        score += roles["actor forward"]
                    roles["actor update"] = self.train_s(workload, pool, cluster)
                    update += roles["actor update"]
                elif role == "critic":
                    roles["critic forward"] = self.forward_s(workload, pool, cluster)
                    roles["critic update"] = self.train_s(workload, pool, cluster)
                    score, update = score + roles["critic forward"], update + roles["critic update"]
                elif role in ("reference", "reward", "teacher"):
                    roles[f"{role} forward"] = self.forward_s(workload, pool, cluster)
                    score += roles[f"{role} forward"]
            score_by_pool[pool.name], update_by_pool[pool.name] = score, update
        stages = {"generate": self.generate_s(plan, workload, cluster),
                  "score": max(score_by_pool.values()) + self.rates.call_s,  # the reward function's call
                  "update": max(update_by_pool.values()),
                  "transition": self.transition_s(plan, workload, cluster)}
        scale = dict(self.rates.stage_scale)
        stages = {stage: seconds * scale.get(stage, 1.0) for stage, seconds in stages.items()}
        roles["rollout generate"] = stages["generate"]
        if schedule.overlaps and not plan.rollout_colocated:
            # the next batch generates while this one is scored and trained; the rollout's pool also
            # does the work of the roles that share it
            rollout = plan.pool_of("rollout").name
            busy = (stages["generate"] + score_by_pool[rollout] * scale.get("score", 1.0)
                    + update_by_pool[rollout] * scale.get("update", 1.0))
            step = max(busy, stages["score"] + stages["update"]) + stages["transition"]
        else:
            step = sum(stages.values())
        return Prediction(stages, step, roles)

    # --- one role on one pool -----------------------------------------------------------------
    def collective_bytes_per_s(self, devices: int, cluster: Cluster) -> float:
        r = self.rates
        return r.intra_node_bytes_per_s if devices <= cluster.devices_per_node else r.inter_node_bytes_per_s

    def fsdp_s(self, workload: Workload, pool: PoolPlan, cluster: Cluster, passes: int) -> float:
        """Seconds of FSDP's collectives: `passes` times the parameters' (n-1)/n through each device."""
        n = pool.devices
        if n == 1:
            return 0.0
        moved = passes * workload.parameters * workload.compute_bytes * (n - 1) / n
        return moved / self.collective_bytes_per_s(n, cluster)

    def forward_s(self, workload: Workload, pool: PoolPlan, cluster: Cluster) -> float:
        compute = 2 * workload.parameters * workload.tokens / (pool.devices * self.rates.forward_flops_per_s)
        return self.rates.call_s + self.together(compute, self.fsdp_s(workload, pool, cluster, 1))

    def together(self, compute_s: float, comm_s: float) -> float:
        return max(compute_s, comm_s) if self.rates.comm_overlap else compute_s + comm_s

    def train_s(self, workload: Workload, pool: PoolPlan, cluster: Cluster) -> float:
        flops_per_token = 8 if workload.checkpointing else 6  # a recomputed forward with checkpointing
        compute = workload.epochs * flops_per_token * workload.parameters * workload.tokens / (
            pool.devices * self.rates.train_flops_per_s)
        # per optimizer step: the parameters gathered for forward and for backward (compute dtype),
        # the gradients reduce-scattered in the master dtype (FSDP2's reduce_dtype)
        passes = workload.optimizer_steps * (2 + workload.master_bytes / workload.compute_bytes)
        return self.rates.call_s + self.together(compute, self.fsdp_s(workload, pool, cluster, passes))

    def generate_s(self, plan: Plan, workload: Workload, cluster: Cluster) -> float:
        """Prefill, then one decode step per response token, per wave of sequences that fit the KV cache."""
        r, w, tp = self.rates, workload, plan.rollout_tp
        per_replica = -(-w.sequences // plan.rollout_replicas)
        concurrent = min(per_replica, kv_capacity(plan, w, cluster))
        waves = -(-per_replica // concurrent)
        prefill = 2 * w.parameters * per_replica * w.prompt_tokens / (tp * r.forward_flops_per_s)
        context = w.prompt_tokens + w.response_tokens / 2  # the mean length a decode step reads
        read = (w.parameters * w.rollout_bytes + concurrent * context * w.kv_bytes_per_token()) / tp
        compute = 2 * w.parameters * concurrent / (tp * r.decode_flops_per_s)
        step = max(read / r.decode_bytes_per_s, compute) + r.decode_step_s + (tp - 1) * r.tp_step_s
        return r.call_s + prefill + waves * w.response_tokens * step

    def transition_s(self, plan: Plan, workload: Workload, cluster: Cluster) -> float:
        """Moving the actor's new weights into the engines (and, on GPUs with colocated training,
        the training state out of the way of generation and back)."""
        r, w = self.rates, workload
        rollout = plan.pool_of("rollout")
        engine_bytes = w.parameters * w.rollout_bytes / plan.rollout_tp  # what each rollout rank holds
        if plan.rollout_colocated:
            n = rollout.devices
            moved = max(0.0, engine_bytes - w.parameters * w.rollout_bytes / n)  # its own shard is at hand
            exchange = r.exchange_bytes_per_s if n <= cluster.devices_per_node and r.exchange_bytes_per_s else \
                self.collective_bytes_per_s(n, cluster)
            seconds = moved / exchange
            if r.host_bytes_per_s and cluster.device == "cuda":  # the two take turns on the devices
                actor_state = 4 * w.parameters * w.master_bytes / n  # parameters, gradients, moments
                seconds += 2 * (actor_state + engine_bytes) / r.host_bytes_per_s  # out and back, each
        else:  # the broadcast transport: each layout's slice (one per TP rank) broadcast to its ranks at once,
            # the layouts together: the whole model once over the training side's link, whatever the replicas
            same_node = plan.devices <= cluster.devices_per_node
            send = (r.send_bytes_per_s or r.intra_node_bytes_per_s) if same_node else r.inter_node_bytes_per_s
            seconds = engine_bytes * plan.rollout_tp / send
        return r.sync_s + seconds


def kv_capacity(plan: Plan, workload: Workload, cluster: Cluster) -> int:
    """Sequences at full length one engine holds at once: on a CPU, rollout.kv_cache_space_gib; on a
    GPU, what the engine's share of each device (rollout.gpu_memory_utilization, as vLLM sizes its
    cache) leaves after its 1/tp of the weights."""
    w = workload
    per_sequence = kv_per_sequence(plan, w)
    if cluster.device == "cpu":
        return max(1, int(w.kv_cache_gib * 2 ** 30 / per_sequence))
    free = w.gpu_memory_utilization * cluster.device_memory_bytes - w.parameters * w.rollout_bytes / plan.rollout_tp
    return max(1, int(free / per_sequence))
