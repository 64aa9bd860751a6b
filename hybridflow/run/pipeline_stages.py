"""Which of the command line's overrides reach which stage of a pipeline.

A stage's config is composed from, in order (a later one wins; docs/pipeline.md, "Overrides"):
  1. conf/ with the stage's recipe (`recipe=<stage.recipe>`),
  2. `pipeline.common_overrides`,
  3. the stage's own `pipeline.stages[i].overrides`,
  4. what the user typed as a top-level key (`reward.fn=f.py:score`), given to every stage whose
     recipe reads that key (`RecipeSpec.reads_key`),
  5. what the user typed for this stage only: `stages.<stage name>.<key>=<value>`,
  6. what the pipeline itself sets: the stage's run directory, `trainer.resume=true` (a stage
     resumes its own checkpoints), and its starting model (`model.path`: the user's for the first
     stage, the init hook's output for the others).
A typed key that no stage reads, a stage-scoped key that its stage does not read, or a stage name
that is not in `pipeline.stages` is refused before anything starts, naming it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from hybridflow.config.recipes import RECIPE_SPECS, recipe_spec

if TYPE_CHECKING:
    from hybridflow.config.schema import HybridFlowConfig

# Keys the pipeline itself reads or sets for every stage: never handed on as typed.
PIPELINE_KEYS = ("hydra", "recipe.name", "pipeline", "logger.output_root", "logger.run_name", "trainer.resume",
                 "model.path")
STAGE_SCOPED = re.compile(r"^stages\.(?P<stage>[^.=]+)\.(?P<override>.+)$")


def override_key(override: str) -> str:
    """The dotted key an override sets: '+a.b=1' -> 'a.b', 'model=local_hf' -> 'model', '~a.b' -> 'a.b'."""
    return override.split("=", 1)[0].lstrip("+~").split("@")[0]


def pipeline_owned(key: str) -> bool:
    return key == "recipe" or any(key == k or key.startswith(k + ".") for k in PIPELINE_KEYS)


def split_stage_scoped(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(what Hydra composes, the `stages.<name>.<key>=value` overrides it cannot)."""
    scoped = [o for o in overrides if STAGE_SCOPED.match(o)]
    return [o for o in overrides if o not in scoped], scoped


def route(config) -> dict[str, list[str]]:
    """Stage name -> the user's overrides (`config.pipeline.command_overrides`) it gets, in the
    order they apply. Raises ConfigError naming every override that would reach no stage."""
    from hybridflow.config import ConfigError

    stages = config.pipeline.stages
    routed: dict[str, list[str]] = {s.name: [] for s in stages}
    problems: list[str] = []
    typed = [o for o in config.pipeline.command_overrides if not STAGE_SCOPED.match(o)]
    for override in typed:
        key = override_key(override)
        if pipeline_owned(key):
            continue
        readers = [s.name for s in stages if recipe_spec(s.recipe).reads_key(key)]
        for name in readers:
            routed[name].append(override)
        if not readers:
            others = [n for n in RECIPE_SPECS.names() if RECIPE_SPECS.get(n).reads_key(key)]
            problems.append(f"{override!r}: no stage of this pipeline reads {key} ("
                            + ", ".join(f"{s.name}: recipe={s.recipe}" for s in stages) + "); remove it"
                            + (f", or run a recipe that reads it ({', '.join('recipe=' + n for n in others)})"
                               if others else ""))
    for override in config.pipeline.command_overrides:
        match = STAGE_SCOPED.match(override)
        if match is None:
            continue
        name, inner = match["stage"], match["override"]
        stage = next((s for s in stages if s.name == name), None)
        key = override_key(inner)
        if stage is None:
            problems.append(f"{override!r}: this pipeline has no stage {name!r}; its stages are {list(routed)}")
        elif pipeline_owned(key):
            problems.append(f"{override!r}: the pipeline sets {key} for each stage itself; give it without "
                            f"'stages.{name}.' (model.path: the first stage's starting model)")
        elif not recipe_spec(stage.recipe).reads_key(key):
            problems.append(f"{override!r}: stage {name} (recipe={stage.recipe}) does not read {key}; remove it")
        else:
            routed[name].append(inner)
    if problems:
        raise ConfigError("override(s) that would change nothing:\n" + "\n".join(f"  - {p}" for p in problems))
    return routed


def routing_lines(config) -> list[str]:
    """One console line per stage: the user's overrides it got."""
    routed = route(config)
    if not any(routed.values()):
        return []
    return [f"pipeline: stage {name} gets {' '.join(overrides) if overrides else 'none of the overrides'}"
            for name, overrides in routed.items()]


def stage_overrides(config, index: int, model_path: str | None, run_dir: Path, run_name: str,
                    retention: list[str] = (), extra: list[str] = ()) -> list[str]:
    """Every override stage `index` is composed with, in the order of the module docstring."""
    stage = config.pipeline.stages[index]
    overrides = [f"recipe={stage.recipe}", *config.pipeline.common_overrides, *retention, *stage.overrides,
                 *route(config)[stage.name], f"logger.output_root={run_dir}", f"logger.run_name={run_name}",
                 "trainer.resume=true", *extra]
    if model_path is not None:
        overrides.append(f"model.path={model_path}")
    if stage.teacher_stage is not None:
        overrides.append(f"teacher.path={teacher_path(config, index, run_dir)}")
    return overrides


def teacher_path(config, index: int, run_dir: Path) -> Path:
    """Where stage `index`'s teacher is: the final model of the earlier stage its `teacher_stage` names
    (`<run>/<index>-<name>/final_model`, which that stage's run exports)."""
    names = [s.name for s in config.pipeline.stages]
    earlier = names.index(config.pipeline.stages[index].teacher_stage)
    return run_dir / f"{earlier:02d}-{names[earlier]}" / "final_model"


def check_stages(config: HybridFlowConfig, run_dir: Path) -> list[HybridFlowConfig]:
    """Compose every stage's config before the first stage runs, so a bad override in a late
    stage fails now, naming the stage, not after the stages before it have trained. Returns them."""
    from hybridflow.config import ConfigError

    route(config)  # the command line's overrides each reach a stage, or the run stops here naming them
    composed = []
    for index, stage in enumerate(config.pipeline.stages):
        model_path = config.model.path if index == 0 else str(run_dir / f"{index:02d}-{stage.name}" / "init_model")
        try:
            stage_config = _stage_config(config, index, model_path, run_dir, f"{index:02d}-{stage.name}",
                                         retention=_retention(config, index))
        except Exception as error:  # Hydra's composition errors and the schema's rule errors alike
            raise ConfigError(f"pipeline.stages[{index}] ({stage.name}, recipe={stage.recipe}) has an invalid "
                              f"config: {error}. Fix the stage's overrides, pipeline.common_overrides or the "
                              "command line's overrides") from error
        _check_retention(config, index, stage_config)
        _check_hands_on_a_model(config, index, stage_config)
        _check_plan(index, stage, stage_config)
        composed.append(stage_config)
    return composed


def _check_plan(index: int, stage, stage_config: HybridFlowConfig) -> None:
    """The stage's own plan, checked now (`hybridflow.checks.rules.plan_problems`); a stage with placement=auto is
    planned, and its plan checked, when it starts (the search reads the cluster as it is then)."""
    if stage_config.placement.planner.auto:
        return
    from hybridflow.checks.rules import plan_problems
    from hybridflow.config import ConfigError
    from hybridflow.planning.auto import decide_plan

    problems = plan_problems(stage_config, decide_plan(stage_config).plan)
    if problems:
        raise ConfigError(f"pipeline.stages[{index}] ({stage.name}, recipe={stage.recipe}) has an invalid config: "
                          + "; ".join(problems))


def _retention(config: HybridFlowConfig, index: int) -> list[str]:
    """`trainer.keep_last_weights` for stage `index`: the checkpoints the next stage's init hook
    reads (null when the hook does not say, or for the last stage: a user may merge them later)."""
    needed = _window(config, index)
    return [f"trainer.keep_last_weights={'null' if needed is None else needed}"]


def _window(config: HybridFlowConfig, index: int) -> int | None:
    """How many of stage `index`'s newest checkpoints the init hooks that read its run read (None: every one,
    when a hook does not say, or no later stage reads it: a user may merge them later)."""
    from hybridflow.merge.hooks import checkpoints_needed  # torch and DCP: only a pipeline's driver needs them

    readers = [s for j, s in enumerate(config.pipeline.stages) if j > index and init_source(config, j) == index]
    if not readers:
        return None
    needed = [checkpoints_needed(s.init) for s in readers]
    return None if None in needed else max(needed)


def init_source(config, index: int) -> int:
    """The stage whose run stage `index`'s init hook reads: its `init_stage`, or the one before it."""
    stage = config.pipeline.stages[index]
    if stage.init_stage is None:
        return index - 1
    return [s.name for s in config.pipeline.stages].index(stage.init_stage)


def _check_retention(config: HybridFlowConfig, index: int, stage_config: HybridFlowConfig) -> None:
    """A stage's own overrides may keep more snapshots than the next hook reads, never fewer."""
    from hybridflow.config import ConfigError

    stages, needed = config.pipeline.stages, _window(config, index)
    trainer = stage_config.trainer
    if needed is None or trainer.keep_last_weights is None or trainer.keep_last_checkpoints is None:
        return  # the hook reads any number, or every checkpoint keeps its weights
    kept = max(trainer.keep_last_weights, trainer.keep_last_checkpoints)
    if kept < needed:
        raise ConfigError(f"pipeline.stages[{index}] ({stages[index].name}) keeps the weights of its last "
                          f"{kept} checkpoints (trainer.keep_last_weights={trainer.keep_last_weights}) but the "
                          f"next stage's init hook {stages[index + 1].init.name!r} reads {needed}; remove that "
                          f"override or set trainer.keep_last_weights={needed}")


def _check_hands_on_a_model(config: HybridFlowConfig, index: int, stage_config: HybridFlowConfig) -> None:
    """A stage followed by another hands it a whole model (its final_model/ or merged checkpoints),
    which an adapter-only export (actor.lora.save_adapter_only) does not write."""
    from hybridflow.config import ConfigError

    stages, lora = config.pipeline.stages, stage_config.actor.lora
    if index + 1 < len(stages) and lora.rank and lora.save_adapter_only:
        raise ConfigError(f"pipeline.stages[{index}] ({stages[index].name}) sets actor.lora.save_adapter_only=true, "
                          f"but stage {stages[index + 1].name} starts from its whole model; leave it off in every "
                          "stage but the last (the last stage's adapter folds later with hybridflow-merge)")


def _stage_config(config: HybridFlowConfig, index: int, model_path: str | None, run_dir: Path,
                  name: str, extra: list[str] = (), retention: list[str] = ()) -> HybridFlowConfig:
    """Stage `index`'s config: its recipe, the pipeline's and its own overrides, then the command line's
    (hybridflow/run/pipeline_stages.py gives the order)."""
    from hybridflow.config import compose

    return compose(stage_overrides(config, index, model_path, run_dir, name, retention=retention, extra=extra))


def with_command(config: HybridFlowConfig, overrides: list[str]) -> tuple[HybridFlowConfig, dict]:
    """`config` (composed from `overrides` less the stage-scoped ones) told what the command line said,
    and the config of each stage by name ({} for a recipe without stages): a pipeline gets the overrides
    as `pipeline.command_overrides`, and every stage's config is composed and checked now, so that an
    override that reaches no stage, or breaks one, fails before anything starts."""
    from hybridflow.config import ConfigError

    _, scoped = split_stage_scoped(overrides)
    if not recipe_spec(config.recipe.name).pipeline:
        if scoped:
            raise ConfigError(f"{scoped[0]!r}: stages.<stage>.<key>=value sets a key for one stage of a pipeline; "
                              f"recipe={config.recipe.name} has no stages: give it as {scoped[0].split('.', 2)[2]}")
        return config, {}
    config.pipeline.command_overrides = [*config.pipeline.command_overrides, *overrides]
    composed = check_stages(config, Path(config.logger.output_root) / (config.logger.run_name or "pipeline"))
    return config, {stage.name: c for stage, c in zip(config.pipeline.stages, composed)}


def compose_command(args: list[str], with_stages: bool = False):
    """The config `hybridflow *args` runs, composed and checked as the command does before anything
    starts; with `with_stages`, also each stage's config by name."""
    from hybridflow.config import compose

    plain, _ = split_stage_scoped(args)
    config, stages = with_command(compose(plain), list(args))
    if not recipe_spec(config.recipe.name).pipeline and not config.placement.planner.auto:
        from hybridflow.run.stage import prepare_stage

        prepare_stage(config)  # its plan's checks (placement=auto's search reads the cluster: left to the run)
    return (config, stages) if with_stages else config
