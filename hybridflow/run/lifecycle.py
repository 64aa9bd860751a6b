"""One lifecycle for recipes: the start every recipe shares, built once, and its end.

A recipe is `run(stage, run_dir)`, its `stage` (hybridflow.run.stage.Stage) the resolved config and the
plan decided before it started. It calls `start_run` for what every recipe needs before its first
step — the model directory, the tokenizer, its data (read and checked before Ray starts), Ray, and
its role groups on the pools of the stage's plan, each started by the same one call, `start` — and, if it trains, `Run.training` for the rest: the
checkpointer and the state it resumes from, the prompt loader (at the resumed position), the metrics
logger, the weight sync (set up, when a rollout runs) and the step hooks. The recipe keeps only its
own step loop, and ends with `Run.finish` (the final export and the logger's close). This is
torchtune's recipe lifecycle (setup, train, save, cleanup) written once here rather than in each
recipe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from hybridflow.config.schema import HybridFlowConfig
from hybridflow.controller import RoleSpec, WorkerGroup
from hybridflow.planning.plan import Plan
from hybridflow.run.stage import Stage


@dataclass
class Training:
    """What a training recipe's step loop uses besides the groups."""

    checkpointer: Any  # hybridflow.run.runner.Checkpointer
    loader: Any  # hybridflow.data.loader.PromptLoader, at the resumed position
    logger: Any  # hybridflow.output.tracking.MetricsLogger
    hooks: Any  # hybridflow.training.hooks.StepHooks
    weight_sync: Any = None  # hybridflow.resharding.sync.WeightSync, set up (None: no rollout)
    state: dict = field(default_factory=dict)  # what the resumed checkpoint saved ({}: a fresh run)

    @property
    def step(self) -> int:
        """The last step done: the resumed checkpoint's, or 0."""
        return int(self.state.get("step", 0))


@dataclass
class Run:
    stage: Stage
    run_dir: Path
    model_dir: Path
    tokenizer: Any
    data: Any  # what `start_run`'s `data` built (the datasets by default)
    groups: dict[str, WorkerGroup]
    started: dict[str, list] = field(default_factory=dict)  # per role, what each rank's `start` returned
    ray_address: str = ""

    @property
    def config(self) -> HybridFlowConfig:
        return self.stage.config

    @property
    def plan(self) -> Plan:
        """Where the groups run: the stage's pools, device, rollout TP and weight transport."""
        return self.stage.plan

    def training(self, trainable: Sequence[str], rows: Sequence, rows_per_step: int,
                 drawn_ahead: int = 0) -> Training:
        """Checkpointer (of the `trainable` roles; resumed when trainer.resume says so), loader over
        `rows` (`rows_per_step` per draw; `drawn_ahead`: draws of batches in flight, which step
        hooks that put data back must remember), logger, weight sync and step hooks."""
        from hybridflow.data.loader import PromptLoader
        from hybridflow.run.launch import build_weight_sync
        from hybridflow.run.runner import Checkpointer
        from hybridflow.output.tracking import MetricsLogger
        from hybridflow.training.hooks import StepHooks, batches_to_remember

        config, t = self.config, self.config.trainer
        checkpointer = Checkpointer(config, self.run_dir, self.model_dir, {r: self.groups[r] for r in trainable})
        loader = PromptLoader(rows, rows_per_step, seed=config.seed,
                              remember_batches=batches_to_remember(t.training_hooks, t.save_every_steps, drawn_ahead))
        state = checkpointer.resume() or {}
        if state:
            loader.load_state_dict(state["loader"])
        weight_sync = None
        if "rollout" in self.groups and "actor" in self.groups:
            weight_sync = build_weight_sync(config, self.plan, self.groups["actor"], self.groups["rollout"])
            weight_sync.setup()
        hooks = StepHooks.build(t.training_hooks, self.run_dir, loader)
        logger = MetricsLogger(self.run_dir, config.logger, total_steps=t.total_steps,
                               predicted=self.stage.predicted_metrics())  # placement=auto's, beside each step's
        return Training(checkpointer, loader, logger, hooks, weight_sync, state)

    def finish(self, training: Training, step: int) -> dict:
        """The end of a training run: the final model exported (trainer.export_hf), the logger closed."""
        final_model = training.checkpointer.export_final(self.run_dir) if self.config.trainer.export_hf else None
        training.logger.close()
        from hybridflow.planning.auto import compare_measured

        compared = compare_measured(self.run_dir)  # placement=auto: the plan's prediction against the steps
        if compared:
            from hybridflow.output import console

            console.say(compared)
        return {"final_model": final_model, "steps": step}


def start_run(stage: Stage, run_dir: Path,
              roles: Callable[[Path, Any], dict[str, RoleSpec]],
              data: Callable[[HybridFlowConfig, Path, Any], Any] | None = None) -> Run:
    """The model and tokenizer, `data(config, run_dir, tokenizer)` (default: the task's datasets,
    `hybridflow.run.launch.prepare_data`) before Ray starts, then Ray and the groups of
    `roles(model_dir, tokenizer)`, all started (a rollout's engine included) before it returns."""
    from hybridflow.data.tokenizer import load_tokenizer
    from hybridflow.run.launch import prepare_data, prepare_model, spawn_roles, start_ray, vllm_env

    config, plan = stage.config, stage.plan
    model_dir = prepare_model(config, run_dir)
    tokenizer = load_tokenizer(model_dir, config.model.trust_remote_code)
    built = (data or prepare_data)(config, run_dir, tokenizer)
    address = start_ray(config, plan)
    specs = roles(model_dir, tokenizer)
    groups = spawn_roles(config, plan, specs, env_vars=vllm_env(config) if "rollout" in specs else None)
    futures = {role: group.start.remote() for role, group in groups.items()}  # issued together
    started = {role: future.get() for role, future in futures.items()}
    return Run(stage, run_dir, model_dir, tokenizer, built, groups, started, address)
