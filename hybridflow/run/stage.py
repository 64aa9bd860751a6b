"""A stage, decided once before anything starts and passed by argument: `Stage`.

A run is one stage; a pipeline runs several, each its own. What a stage runs on is decided in two
phases, both before Ray starts and before any worker exists:

1. the config as this machine runs it (`hybridflow.checks.rules.resolved`: the dtypes, the weight probe's
   tolerance) and what the config alone shows is wrong (`config_problems`) — both at compose
   (`hybridflow.config.to_config`);
2. `prepare_stage(config)`: the plan (the config's own, or placement=auto's best on the cluster:
   `hybridflow.planning.auto.decide_plan`, the one caller of `Plan.from_config`, with the sequence-parallel
   sizes it raises where the configured ones fit no plan: the stage's config carries them), what the plan
   shows is wrong (`plan_problems`, raised as one `ConfigError`), the micro-batch sizes left null
   chosen for the plan's pools (hybridflow/checks/memory_budget.py, entered once), and the console lines saying
   so. The schedule trainer.max_staleness chooses is asked for once and handed to the plan and its checks.

The result is frozen and is the one answer from then on: the runner hands it to the recipe, the
recipe to `hybridflow.run.lifecycle.start_run`, and that to Ray's start, the pool reservation, the
role specs (recipes/roles.py), the weight sync and the metrics logger (the plan's prediction).
`Stage.device` is the plan's device. Nothing reads a plan from a context variable or a module's state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hybridflow.checks.rules import plan_problems
from hybridflow.config import ConfigError
from hybridflow.config.schema import HybridFlowConfig
from hybridflow.checks.memory_budget import resolve_micro_batches
from hybridflow.checks.model import half_precision_note
from hybridflow.planning.auto import decide_plan
from hybridflow.planning.plan import Plan, save_plan
from hybridflow.precision import precision_line
from hybridflow.rollout_schedules import schedule_class


@dataclass(frozen=True)
class Stage:
    config: HybridFlowConfig  # resolved: dtypes, probe tolerance, micro-batch sizes (and placement=auto's SP) filled in
    plan: Plan  # its pools, each role's pool, the rollout's TP, the device and the weight transport
    prediction: dict | None = None  # placement=auto's prediction per stage, for `plan/predicted_<stage>_s`
    record: dict = field(default_factory=dict)  # placement=auto's search, saved beside the plan in plan.json
    said: tuple[str, ...] = ()  # the console lines that say what was decided

    @property
    def device(self) -> str:
        """'cpu' or 'cuda': the one answer after planning."""
        return self.plan.device

    def predicted_metrics(self) -> dict[str, float]:
        """`plan/predicted_<stage>_s` and `plan/predicted_step_s` of placement=auto's choice ({} without one)."""
        if self.prediction is None:
            return {}
        out = {f"plan/predicted_{stage}_s": float(seconds) for stage, seconds in self.prediction["stages"].items()}
        out["plan/predicted_step_s"] = float(self.prediction["step_s"])
        return out

    def save(self, run_dir: Path) -> Path:
        """run_dir/plan.json: the plan, and with placement=auto its prediction and search."""
        sections = {} if self.prediction is None else {"prediction": self.prediction, **self.record}
        return save_plan(run_dir, self.plan, **sections)


def prepare_stage(config: HybridFlowConfig) -> Stage:
    """The stage `config` runs as (phase 2 above): raises `ConfigError` naming the problems its plan shows,
    or `InputError` when placement=auto finds no plan that fits."""
    schedule = schedule_class(config.trainer.max_staleness)  # asked once: the plan and its checks are given it
    decided = decide_plan(config, schedule)
    config = decided.config  # placement=auto's sequence-parallel sizes, where it raised them
    problems = plan_problems(config, decided.plan, schedule)
    if problems:
        raise ConfigError("\n".join([decided.split_line, *problems] if decided.split_line else problems))
    config, chosen = resolve_micro_batches(config, decided.plan)  # for the plan's pools
    said = tuple(line for line in (decided.line, decided.split_line, chosen,
                                   *_precision_lines(config, decided.plan.device)) if line)
    return Stage(config, decided.plan, decided.prediction, decided.record, said)


def _precision_lines(config: HybridFlowConfig, device: str) -> list[str]:
    """What the stage computes in, and a note where this CPU emulates it (hybridflow/checks/model.py)."""
    lines = []
    if config.model.path or {config.model.dtype.value, config.rollout.dtype.value} != {"float32"}:
        # the built tiny model computes in float32 by its own config (conf/model/tiny.yaml): nothing to say
        lines.append(precision_line(config.model.dtype.value, config.rollout.dtype.value, device))
    return lines + [half_precision_note(config, device)]
