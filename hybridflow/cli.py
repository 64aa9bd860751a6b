"""The `hybridflow` command: a Hydra main over conf/.

`hybridflow` alone runs the embedded default (local Ray, tiny model built offline, synthetic
task, real vLLM on the CPU). Overrides select other recipes and settings:
`hybridflow recipe=grpo rollout.temperature=0.7`. Under `ray job submit`, or with
`ray.address=...`, the same command joins that cluster instead of starting one.
The config is composed and validated before Ray starts: an unknown key or a bad value exits
with status 2 and a message naming the key, the value and what is allowed. The inputs it names
(data files, model directory, reward functions) are then checked (hybridflow/preflight.py), also
before anything starts; a problem there exits with status 2 too, naming file, row and column.
"""

from __future__ import annotations

import sys
from typing import Callable

import hydra
from omegaconf import DictConfig

from hybridflow import console
from hybridflow.config import CONF_DIR, ConfigError, to_config
from hybridflow.config.schema import HybridFlowConfig
from hybridflow.config.recipes import recipe_spec
from hybridflow.tracking import make_run_dir, save_config


def recipe_function(name: str) -> Callable:
    """The run function of a built-in recipe (hybridflow/config/recipes.py) or of 'module:function'."""
    from hybridflow.registry import load_object

    return load_object(recipe_spec(name).function)


def run(config: HybridFlowConfig) -> dict:
    """Run the configured recipe in a fresh run directory (printed at start and end), once its
    inputs pass `check_inputs` (which raises InputError before anything is created)."""
    from hybridflow.preflight import check_inputs

    check_inputs(config)  # first: a refused run never pays for importing the recipe's torch and vLLM
    recipe = recipe_function(config.recipe.name)
    name = config.recipe.name.split(":")[-1]
    run_dir = make_run_dir(config.logger.output_root, config.logger.run_name, name)
    save_config(config, run_dir)
    from hybridflow.controller import deadlines
    from hybridflow.launch import release_all
    from hybridflow.runner import run_with_restarts

    deadlines.configure(dict(config.trainer.stage_timeout_s), config.trainer.default_stage_timeout_s)
    with console.session(run_dir, config.logger.verbose) as log_dir:
        where = "" if config.logger.verbose else f" (library and worker output: {log_dir})"
        console.say(f"hybridflow: run directory {run_dir}{where}")
        try:
            with console.stage(name):
                return run_with_restarts(recipe, config, run_dir)
        finally:
            console.end_progress_lines()  # an error's traceback starts on a line of its own
            release_all()
            console.say(f"hybridflow: run directory {run_dir}")


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    try:
        config = to_config(cfg)
    except ConfigError as exc:
        print(f"hybridflow: configuration error: {exc}", file=sys.stderr)
        sys.exit(2)
    from hybridflow.preflight import InputError

    try:
        run(config)
    except InputError as exc:
        print(f"hybridflow: {exc}", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    _hydra_main()


if __name__ == "__main__":
    main()
