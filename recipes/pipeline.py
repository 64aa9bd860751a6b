"""A multi-stage pipeline: stages run in order, each an existing recipe with its own config,
and the model is handed from stage to stage through a stage hook (e.g. `pma_sma`: the next
stage starts from the average of the previous stage's last N checkpoints — PMA-init). A stage's
`init_stage` makes the hook read an earlier stage than the previous one, and its `teacher_stage` makes an
earlier stage's final model its distillation teacher (teacher.path; docs/distillation.md).

Every stage lives in one run directory (`<run>/<index>-<name>/`). A finished stage leaves
`STAGE_COMPLETE` (its result as JSON); re-running the pipeline with the same run name skips
finished stages and resumes the interrupted one from its latest checkpoint. A stage keeps the
weights of as many of its newest checkpoints as the next stage's init hook reads
(`trainer.keep_last_weights`; the training state only of the last `trainer.keep_last_checkpoints`),
so a run directory holds what the merges need and no more. At the end a short
report (`report.md` and `report.png`) gives held-out accuracy after each stage and for each
merged starting model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from hybridflow.output import console
from hybridflow.run.pipeline_stages import (  # noqa: F401 - re-exported
    _retention, _stage_config, check_stages, init_source, routing_lines)
from hybridflow.config.schema import HybridFlowConfig, StageConfig
from hybridflow.output.console import say
from hybridflow.run.launch import release_all
from hybridflow.merge.hooks import run_stage_hook
from hybridflow.output.tracking import read_metrics


def run(config: HybridFlowConfig, run_dir: Path) -> dict:
    if not config.pipeline.stages:
        raise ValueError("recipe=pipeline needs pipeline.stages; see conf/recipe/pipeline.yaml")
    check_stages(config, run_dir)
    for line in routing_lines(config):
        say(line)
    model_path, results = config.model.path, []
    stage_dirs = [run_dir / f"{index:02d}-{stage.name}" for index, stage in enumerate(config.pipeline.stages)]
    for index, stage in enumerate(config.pipeline.stages):
        stage_dir = stage_dirs[index]
        previous_dir = stage_dirs[init_source(config, index)] if index else None  # what the init hook reads
        done = stage_dir / "STAGE_COMPLETE"
        if done.is_file():
            result = json.loads(done.read_text())
            say(f"pipeline: stage {stage.name} already complete, skipping")
        else:
            with console.stage(stage.name):
                result = _run_stage(config, run_dir, index, model_path, previous_dir)
            _atomic_json(done, result)
        results.append(result)
        model_path = result["final_model"]
    write_report(run_dir, config.pipeline.stages, results)
    return {"final_model": model_path, "stages": results}


def _run_stage(config: HybridFlowConfig, run_dir: Path, index: int, model_path: str | None,
               previous_dir: Path | None) -> dict:
    """Stage `index`: its starting model (the init hook over `previous_dir`, the run of the stage it reads),
    then its recipe."""
    from hybridflow.cli import recipe_function
    from hybridflow.run.runner import run_stage  # torch: not needed to compose and check the stages
    from hybridflow.run.stage import prepare_stage

    stage = config.pipeline.stages[index]
    stage_dir = run_dir / f"{index:02d}-{stage.name}"
    result = {"stage": stage.name, "recipe": stage.recipe}
    if previous_dir is not None:
        model_path = str(run_stage_hook(stage.init, previous_dir, stage_dir / "init_model"))
        result["init_model"] = model_path
        if stage.evaluate_init:
            result["init_accuracy"] = _evaluate(config, model_path, run_dir, index)
    stage_config = _stage_config(config, index, model_path, run_dir, stage_dir.name,
                                 retention=_retention(config, index))
    # the first stage's model may come from the stage's own overrides (pipeline.common_overrides), not model.path
    say(f"pipeline: stage {index} {stage.name} ({stage.recipe}) starts from "
        f"{stage_config.model.path or 'the tiny model'}")
    stage_dir.mkdir(parents=True, exist_ok=True)  # a stage that builds no model and merges none writes here first
    # its own plan (decided and checked now), restarts and deadlines
    stage_result = run_stage(recipe_function(stage.recipe), prepare_stage(stage_config), stage_dir)
    release_all()
    validations = [m for m in read_metrics(stage_dir) if "val/accuracy" in m]
    result.update(final_model=stage_result["final_model"],
                  final_accuracy=validations[-1]["val/accuracy"] if validations else None)
    return result


def _evaluate(config: HybridFlowConfig, model_path: str, run_dir: Path, index: int) -> float:
    from hybridflow.run.stage import prepare_stage
    from recipes.evaluate import run as evaluate

    stage = config.pipeline.stages[index]
    eval_dir = run_dir / f"{index:02d}-{stage.name}" / "init_eval"
    eval_dir.mkdir(parents=True, exist_ok=True)
    eval_config = _stage_config(config, index, model_path, run_dir, eval_dir.name, extra=["recipe.name=evaluate"])
    with console.stage(f"{stage.name}-init"):  # "grpo-init: held-out accuracy ..."; logs/grpo-init/
        result = evaluate(prepare_stage(eval_config), eval_dir)
    release_all()
    return result["val/accuracy"]


def _atomic_json(path: Path, value: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2))
    os.replace(tmp, path)


def write_report(run_dir: Path, stages: list[StageConfig], results: list[dict]) -> None:
    """report.md (held-out accuracy per stage and per merged start) and report.png (curves)."""
    lines = ["# Pipeline report", "", "| stage | recipe | starting model accuracy | final accuracy |", "| --- | --- | --- | --- |"]
    def show(value: float | None) -> str:
        return "" if value is None else f"{value:.3f}"

    for r in results:
        lines.append(f"| {r['stage']} | {r['recipe']} | {show(r.get('init_accuracy'))} | {show(r.get('final_accuracy'))} |")
    for before, after in zip(results, results[1:]):
        if after.get("init_accuracy") is not None and before.get("final_accuracy") is not None:
            verdict = "beat" if after["init_accuracy"] > before["final_accuracy"] else "did not beat"
            lines += ["", f"The starting model of stage {after['stage']} ({after['init_accuracy']:.3f}) {verdict} "
                          f"the last checkpoint of stage {before['stage']} ({before['final_accuracy']:.3f}) "
                          "on held-out accuracy (measured)."]
    (run_dir / "report.md").write_text("\n".join(lines) + "\n")
    say("\n".join(lines))
    _plot(run_dir, results)


def _plot(run_dir: Path, results: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    offset = 0
    for index, r in enumerate(results):
        rows = [m for m in read_metrics(run_dir / f"{index:02d}-{r['stage']}") if "val/accuracy" in m]
        steps = [offset + m["step"] for m in rows]
        ax.plot(steps, [m["val/accuracy"] for m in rows], marker="o", label=f"{r['stage']} ({r['recipe']})")
        if r.get("init_accuracy") is not None:
            ax.scatter([offset], [r["init_accuracy"]], marker="*", s=120, label=f"{r['stage']} start (merge)")
        offset = steps[-1] if steps else offset
    ax.set_xlabel("step (stages back to back)")
    ax.set_ylabel("held-out accuracy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(run_dir / "report.png", dpi=100)
    plt.close(fig)
