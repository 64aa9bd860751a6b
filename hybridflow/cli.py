"""The `hybridflow` command: a Hydra main over conf/.

`hybridflow` alone runs the embedded default (local Ray, tiny model built offline, synthetic
task, real vLLM on the CPU). Overrides select other recipes and settings:
`hybridflow recipe=grpo rollout.temperature=0.7`. Under `ray job submit`, or with
`ray.address=...`, the same command joins that cluster instead of starting one.
The config is composed and validated before Ray starts: an unknown key or a bad value exits
with status 2 and a message naming the key, the value and what is allowed. The inputs it names
(data files, model directory, reward functions) are then checked (hybridflow/checks/preflight.py), also
before anything starts; a problem there exits with status 2 too, naming file, row and column.

On a pipeline (the default), what the command line sets reaches every stage that reads it, and
`stages.<stage>.<key>=value` reaches one stage only; a key no stage reads is refused
(hybridflow/run/pipeline_stages.py has the precedence). The first console lines say which stage got what.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import hydra
from omegaconf import DictConfig

from hybridflow.output import console
from hybridflow.config import CONF_DIR, ConfigError, to_config
from hybridflow.config.schema import HybridFlowConfig
from hybridflow.config.recipes import recipe_spec
from hybridflow.run.pipeline_stages import with_command
from hybridflow.output.tracking import make_run_dir, save_config


def recipe_function(name: str) -> Callable:
    """The run function of a built-in recipe (hybridflow/config/recipes.py) or of 'module:function'."""
    from hybridflow.registry import load_object

    return load_object(recipe_spec(name).function)


def run(config: HybridFlowConfig) -> dict:
    """Run the configured recipe in a fresh run directory (printed at start and end), once its stage is
    prepared (its plan decided and checked, `hybridflow.run.stage.prepare_stage`: a pipeline prepares each
    stage as it starts) and its inputs pass `check_inputs` (which raises InputError before anything is
    created)."""
    from hybridflow.checks.preflight import check_inputs
    from hybridflow.run.stage import prepare_stage

    from hybridflow.output.tracking import reused_run_dir

    reused = reused_run_dir(config.logger.output_root, config.logger.run_name, config.trainer.resume)
    if reused:
        from hybridflow.checks.preflight import InputError

        raise InputError(reused)
    check_backends(config)
    pipeline = recipe_spec(config.recipe.name).pipeline
    stage = None if pipeline else prepare_stage(config)
    check_inputs(config, None if stage is None else stage.plan)  # before the recipe's torch and vLLM are imported
    recipe = recipe_function(config.recipe.name)
    name = config.recipe.name.split(":")[-1]
    run_dir = make_run_dir(config.logger.output_root, config.logger.run_name, name)
    save_config(config, run_dir)  # a stage saves its own, resolved, as it starts (hybridflow.run.runner.run_stage)
    from hybridflow.run.launch import release_all
    from hybridflow.run.runner import run_stage

    with console.session(run_dir, config.logger.verbose) as log_dir:
        where = "" if config.logger.verbose else f" (library and worker output: {log_dir})"
        console.say(f"hybridflow: run directory {run_dir}{where}")
        try:
            with console.stage(name):
                # a pipeline runs each stage through run_stage itself, with that stage's deadlines and restarts
                return recipe(config, run_dir) if pipeline else run_stage(recipe, stage, run_dir)
        finally:
            console.end_progress_lines()  # an error's traceback starts on a line of its own
            release_all()
            console.say(f"hybridflow: run directory {run_dir}")


_STAGE_SCOPED: list[str] = []  # main() takes them out of sys.argv: Hydra cannot compose keys of no schema


def check_backends(config: HybridFlowConfig) -> None:
    """Raise InputError when a logging backend of the run (of any stage of a pipeline) is not installed."""
    from hybridflow.checks.preflight import InputError
    from hybridflow.output.tracking import missing_backends

    backends = set(config.logger.backends)
    if recipe_spec(config.recipe.name).pipeline:
        from hybridflow.run.pipeline_stages import check_stages

        stages = check_stages(config, Path(config.logger.output_root) / (config.logger.run_name or "pipeline"))
        backends |= {b for stage in stages for b in stage.logger.backends}
    problems = missing_backends(sorted(backends))
    if problems:
        raise InputError("\n".join(problems))


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    try:
        config, _ = with_command(to_config(cfg), [*HydraConfig.get().overrides.task, *_STAGE_SCOPED])
    except ConfigError as exc:
        print(f"hybridflow: configuration error: {exc}", file=sys.stderr)
        sys.exit(2)
    from hybridflow.controller.placement import PlacementError
    from hybridflow.controller.storage import StorageError
    from hybridflow.checks.preflight import InputError

    try:
        run(config)
    except ConfigError as exc:  # what the stage's plan shows (hybridflow.run.stage.prepare_stage)
        print(f"hybridflow: configuration error: {exc}", file=sys.stderr)
        sys.exit(2)
    except (InputError, PlacementError, StorageError) as exc:  # the cluster cannot hold or read the run
        print(f"hybridflow: {exc}", file=sys.stderr)
        sys.exit(2)


def run_command() -> int:
    """What `hybridflow` does with sys.argv, as its exit status (0; 2 for a refusal; 1 for an error
    Hydra reported), without ending the process: `main` ends it, a test runs several in one process."""
    from hybridflow.run.pipeline_stages import compose_command, split_stage_scoped

    try:
        if sys.argv[1:2] == ["plan"]:  # `hybridflow plan ...`: the placement search (hybridflow/planning/cli.py)
            from hybridflow.planning.cli import main as plan_main

            return plan_main(sys.argv[2:], compose_command)
        sys.argv[1:], _STAGE_SCOPED[:] = split_stage_scoped(sys.argv[1:])
        _hydra_main()
    except SystemExit as exc:  # a refusal (2), Hydra's report of an error (1), --help (0)
        if exc.code is not None and not isinstance(exc.code, int):
            raise
        return exc.code or 0
    return 0


def main() -> None:
    _exit(run_command())


def _exit(code: int) -> None:
    """End the command as Python's exit would, less its teardown of the interpreter: with torch,
    transformers and Ray imported, freeing every module's objects one by one took 2.5 s of CPU
    after the run had finished (a 2-core EPYC), every run. What an exit must do still happens:
    the atexit handlers (Ray's shutdown, logging's flush, a tracker's finish) and the flush of
    stdout and stderr. Where a thread of the run's own is still working, the exit waits for it
    as Python's does."""
    import atexit
    import os
    import threading

    if any(t is not threading.main_thread() and not t.daemon and t.is_alive() for t in threading.enumerate()):
        sys.exit(code)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
