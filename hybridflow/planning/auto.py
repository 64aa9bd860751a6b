"""The stage's plan, decided once before Ray starts; placement=auto: the planner's best plan for it.

`decide_plan(config)` (called by hybridflow.run.stage.prepare_stage, before anything starts) decides the
stage's one `Plan`: the config's own, or with placement.planner.auto the best
of the plans of the run's workload on its cluster — this machine (its GPUs or its cores, on the
device the run computes on), or the Ray cluster the run joins (`ray.address`, or RAY_ADDRESS under
`ray job submit`) — with the rates of
`placement.planner.rates` (or the device's built-in profile), keeps the run's own
`trainer.max_staleness` (a learning choice, not a placement one), and returns the best plan (its
pools, roles and rollout tensor-parallel size; the config itself is not rewritten, but for the
sequence parallelism below), which the runner
hands to everything that places, sizes or moves inside the stage (`hybridflow.run.stage.Stage`). The
runner saves it as run_dir/plan.json (the plan, its prediction per stage, the rates' source and the
runners-up); the metrics logger adds the stage's `plan/predicted_<stage>_s` to every step, beside the measured `timing/<stage>_s`. When no plan fits,
it raises `InputError` listing why the first candidates were refused (each memory term, in GiB): no
worker has started.

Sequence parallelism is the one config key placement=auto may change (docs/long_sequences.md): when no plan
fits at the configured `<role>.sequence_parallel_size`s, the search runs again at the smallest larger size
the heads admit at which a plan fits (`split_sequences`), and the stage runs with that config
(`Decision.config`), says so in one console line and records it in plan.json ("sequence_parallel"). A
configured size at which a plan fits is kept.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hybridflow.checks.memory_budget import (SP_KEYS, admitted_sequence_parallel, raise_sequence_parallel,
                                             sequence_parallel_keys)
from hybridflow.config.schema import HybridFlowConfig
from hybridflow.planning.cost import STAGES, Rates, build_cost_model
from hybridflow.planning.plan import PLAN_FILE, Plan
from hybridflow.planning.rules import pool_peaks, usable_bytes
from hybridflow.planning.search import SearchOptions, SearchResult, build_policy, search
from hybridflow.planning.workload import GIB, Cluster, Workload
from hybridflow.rollout_schedules import Schedule

RUNNERS_UP = 4


def cluster_for(config) -> Cluster:
    """The cluster the run will use: the Ray cluster it will join (`ray.address`, or RAY_ADDRESS under
    `ray job submit`; read, then disconnected), or this machine."""
    from hybridflow.controller.runtime import join_address

    from hybridflow.precision import device_of

    device = device_of(config.placement.device.value)  # the device the plan runs on, as the dtypes chose it
    address = join_address(config.ray.address)
    if address is None:
        return Cluster.this_machine(device)
    import ray

    ray.init(address=address, namespace=config.ray.namespace, log_to_driver=False)
    try:
        return Cluster.from_ray(device)
    finally:
        ray.shutdown()


def plan_search(config, cluster: Cluster, rates: Rates, depths: tuple[int, ...] | None = None) -> SearchResult:
    planner = config.placement.planner
    cost = build_cost_model(planner.cost_model, rates)
    depths = depths if depths is not None else (config.trainer.max_staleness,)
    return search(Workload.from_config(config), cluster, cost, build_policy(planner.policy),
                  SearchOptions(depths=depths))


@dataclass(frozen=True)
class SequenceSplit:
    """The sequence-parallel sizes a run takes where the configured ones fit no plan: the config that carries
    them, its search, and why: the longest sequence's per-device peak on the best plan's pool that holds the
    most, at the configured sizes and at the chosen ones, against what a device may use."""
    config: HybridFlowConfig
    result: SearchResult
    chosen: dict[str, int]  # the keys raised: {"actor.sequence_parallel_size": 2, ...}
    configured: dict[str, int]  # those keys as configured
    admitted: tuple[int, ...]  # the sizes above the configured ones that the heads admit, tried in order
    tokens: int  # the longest sequence: data.max_prompt_tokens + rollout.max_response_tokens
    pool: str
    peak_configured_bytes: float
    peak_chosen_bytes: float
    limit_bytes: float

    def line(self, who: str) -> str:
        """One console line, `who` first ("hybridflow: placement=auto")."""
        keys = ", ".join(f"{k}={v}" for k, v in self.chosen.items())
        was = ", ".join(f"{k}={v}" for k, v in self.configured.items())
        return (f"{who} chose {keys} (configured: {was}): with the longest sequence (data.max_prompt_tokens + "
                f"rollout.max_response_tokens = {self.tokens} tokens) a rank of pool {self.pool!r} peaks at "
                f"{self.peak_configured_bytes / GIB:.2f} GiB at the configured size, above the "
                f"{self.limit_bytes / GIB:.2f} GiB a rank may use, and at {self.peak_chosen_bytes / GIB:.2f} GiB split "
                f"over {max(self.chosen.values())} ranks (the smallest size the heads admit, of {list(self.admitted)}, "
                "at which a plan fits; docs/long_sequences.md)")

    def to_dict(self) -> dict:
        """What plan.json records under "sequence_parallel"."""
        return {"chosen": self.chosen, "configured": self.configured, "admitted": list(self.admitted),
                "longest_sequence_tokens": self.tokens, "pool": self.pool,
                "peak_configured_gib": self.peak_configured_bytes / GIB,
                "peak_chosen_gib": self.peak_chosen_bytes / GIB, "limit_gib": self.limit_bytes / GIB}


def split_sequences(config, cluster: Cluster, search_with: Callable[[HybridFlowConfig], SearchResult]
                    ) -> tuple[SequenceSplit | None, list[int]]:
    """Where no plan fits `config` (`search_with(config)` ranked none): the smallest sequence-parallel size
    above the configured ones that the heads admit (`admitted_sequence_parallel`) at which `search_with`
    ranks a plan, every role that splits sequences raised to it where configured below it (the search
    refuses a plan whose pools it does not divide), and the sizes tried; (None, tried) when none fits, and
    (None, []) when no role splits sequences or model.pack_sequences=false (the padded path runs at SP 1)."""
    keys = sequence_parallel_keys(config.model_roles)
    if not keys or config.model.pack_sequences is False:
        return None, []
    sizes = admitted_sequence_parallel(config, keys)
    for size in sizes:
        raised, chosen = raise_sequence_parallel(config, keys, size)
        result = search_with(raised)
        if not result.ranked:
            continue
        best = result.best.plan
        before = pool_peaks(best, Workload.from_config(config), cluster)
        after = pool_peaks(best, Workload.from_config(raised), cluster)
        pool = max(before, key=before.get)
        configured = {k: getattr(config, k.split(".")[0]).sequence_parallel_size for k in chosen}
        return SequenceSplit(raised, result, chosen, configured, tuple(sizes),
                             config.data.max_prompt_tokens + config.rollout.max_response_tokens, pool,
                             before[pool], after[pool], usable_bytes(cluster)), sizes
    return None, sizes


def no_split_said(config, tried: list[int]) -> str:
    """The refusal's sentence when no larger sequence-parallel size fits either (empty when none was tried)."""
    if not tried:
        return ""
    keys = ", ".join(SP_KEYS[k] for k in sequence_parallel_keys(config.model_roles))
    return (f"\nNor with more sequence parallelism: {keys} was searched at each size above the configured one "
            f"that the heads admit ({tried}), and no plan fits at any")


@dataclass(frozen=True)
class Decision:
    """The stage's plan, the config it runs with (the given one, or with placement=auto's sequence-parallel
    sizes: `split_line` says so) and what placement=auto said of it (`prediction`, `record`, `line`: None, {},
    None for the config's own plan)."""
    plan: Plan
    config: HybridFlowConfig
    prediction: dict | None = None
    record: dict = dataclasses.field(default_factory=dict)
    line: str | None = None
    split_line: str | None = None


def decide_plan(config, schedule: type[Schedule] | None = None) -> Decision:
    """The stage's plan, decided once before anything starts: the config's own (`Plan.from_config`, called
    here only), or with placement.planner.auto the planner's best for this cluster (with the CPUs per
    device and the pinning of the config's own), and the console line that says what it chose. The
    config is not rewritten, but for the sequence-parallel sizes placement=auto raises where the configured
    ones fit no plan (`split_sequences`); `hybridflow.run.stage.prepare_stage` checks the plan. `schedule`: the
    class trainer.max_staleness chooses, where the caller has it (`Plan.from_config`)."""
    own = Plan.from_config(config, schedule)  # on the device the config's dtypes chose
    if not config.placement.planner.auto:
        return Decision(own, config)
    from hybridflow.data.checks import InputError
    from hybridflow.planning.device_rates import choose_rates

    try:
        cluster = cluster_for(config)
        choice = choose_rates(config.placement.planner.rates, cluster.device)
        rates = choice.rates
        result = plan_search(config, cluster, rates)
    except (ValueError, KeyError) as exc:  # a cluster, rates file, policy or cost model it cannot use
        raise InputError(f"placement=auto: {exc}") from None
    split = None
    if not result.ranked:
        split, tried = split_sequences(config, cluster, lambda raised: plan_search(raised, cluster, rates))
        if split is None:
            raise InputError(f"placement=auto on {cluster.describe()}: {result.why_none()}"
                             + no_split_said(config, tried))
        config, result = split.config, split.result
    best = result.best
    cpus = own.pool_of("actor").cpus_per_device  # what the search does not choose: each process's CPUs, pinning
    placed = best.plan.placing_every_role()
    plan = dataclasses.replace(placed, pin_cpus=own.pin_cpus,
                               pools=tuple(dataclasses.replace(p, cpus_per_device=cpus) for p in placed.pools))
    record = {"cluster": dataclasses.asdict(cluster), "rates": rates.to_dict(), "rates_choice": choice.to_dict(),
              "search": {"considered": result.considered, "refused": len(result.refused), "seconds": result.seconds},
              "runners_up": [c.to_dict() for c in result.ranked[1:1 + RUNNERS_UP]],
              **({"sequence_parallel": split.to_dict()} if split else {})}
    seconds = (f"{best.prediction.step_s:.2f} s/step (" + ", ".join(f"{s} {best.prediction.stages[s]:.2f}"
                                                                 for s in STAGES) + ")")
    said = (f"ranked with rates {choice.note}; on that device: {seconds}" if choice.borrowed
            else f"predicted {seconds} with rates {choice.note}")
    line = (f"hybridflow: placement=auto chose {best.plan.describe()} on {cluster.describe()}: {said}, best of "
            f"{len(result.ranked)} plans that fit ({result.considered} considered in {result.seconds:.2f} s; "
            f"saved as the run's {PLAN_FILE})")
    return Decision(plan.with_transport(own.device), config, best.prediction.to_dict(), record, line,
                    split.line("hybridflow: placement=auto") if split else None)


def compare_measured(run_dir: Path) -> str | None:
    """With a plan.json (placement=auto): the measured mean of each stage over the steps after the
    first (the first warms caches), saved into plan.json beside the prediction, and one console
    line comparing them; None without a plan or with fewer than two steps."""
    path, metrics = Path(run_dir) / PLAN_FILE, Path(run_dir) / "metrics.jsonl"
    if not path.is_file() or not metrics.is_file() or "prediction" not in json.loads(path.read_text()):
        return None
    from hybridflow.planning.calibrate import stage_means
    from hybridflow.output.tracking import read_metrics

    rows = read_metrics(run_dir)[1:]
    if not rows:
        return None
    saved = json.loads(path.read_text())
    predicted = {**saved["prediction"]["stages"], "step": saved["prediction"]["step_s"]}
    measured = stage_means(rows)
    saved["measured"] = {"stages": measured, "steps": [r["step"] for r in rows]}
    path.write_text(json.dumps(saved, indent=2))
    error = (predicted["step"] - measured["step"]) / max(measured["step"], 1e-9)
    from hybridflow.planning.device_rates import update_from_measured

    borrowed = saved.get("rates_choice", {}).get("provenance") == "borrowed"
    line = (f"hybridflow: placement=auto {'ranked with borrowed rates that gave' if borrowed else 'predicted'} "
            f"{predicted['step']:.2f} s/step, measured {measured['step']:.2f} ({error:+.0%}; mean of steps "
            f"{rows[0]['step']}-{rows[-1]['step']}): " + ", ".join(f"{s} {predicted[s]:.2f}/{measured[s]:.2f}"
                                                                  for s in STAGES) + f" ({path})")
    fitted = update_from_measured(saved, predicted, measured)
    return line if fitted is None else f"{line}\n{fitted}"
