"""Run directories and metrics.

A run has one directory (printed at start and end) holding `metrics.jsonl` (one JSON object
per step with at least `step`), the resolved config, checkpoints and the final model.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from pathlib import Path
from typing import Any

from hybridflow.config.schema import plain


def reused_run_dir(output_root: str, run_name: str | None, resume: bool) -> str | None:
    """The problem with starting a new run in `output_root/run_name` when it already holds a run and
    `trainer.resume` is off (the new run would append to its metrics and mix its checkpoints); None if none."""
    if run_name is None or resume:
        return None
    run_dir = Path(output_root).expanduser().resolve() / run_name
    if not run_dir.is_dir() or not any(run_dir.iterdir()):
        return None
    rows = len(read_metrics(run_dir)) if (run_dir / "metrics.jsonl").exists() else 0
    return (f"logger.run_name={run_name!r}: {run_dir} already holds a run ({rows} metrics rows); a new run there would "
            "mix its metrics and checkpoints with the old one's. Fix: add trainer.resume=true to continue that run "
            "from its latest checkpoint (a pipeline: skip its finished stages), or pick another logger.run_name "
            "(or leave it unset for a fresh <recipe>-<time> directory)")


def make_run_dir(output_root: str, run_name: str | None, recipe: str) -> Path:
    name = run_name or f"{recipe}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(output_root).expanduser().resolve() / name
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


_jsonable = plain  # the config's plain form (hybridflow/config/schema.py), for configs and metrics alike


def save_config(config: Any, run_dir: Path) -> Path:
    path = run_dir / "config.json"
    path.write_text(json.dumps(_jsonable(config), indent=2))
    return path


class MetricsLogger:
    """Appends one JSON line per `log` call to run_dir/metrics.jsonl and shows it on the console.

    One row per step: a run that resumes (trainer.resume, a restart) logs again the steps after its
    checkpoint, which the run before may have logged already. The first `log` of a logger therefore
    drops the rows at or past its step (rewriting the file atomically), so every reader sees each
    step once, with the numbers of the run that continued.

    On the console (backend `console`), a step loop of `total_steps` is one live progress line
    with the watched numbers, plus a line per validation and a summary at `close`
    (hybridflow.output.console); without `total_steps` each `log` is one line.
    Each JSON line also carries `time/elapsed_s`: wall-clock seconds since this logger was made (the
    step loop of this process, validation included; a resumed run counts from its restart)."""

    def __init__(self, run_dir: Path, backends, total_steps: int | None = None,
                 predicted: dict[str, float] | None = None) -> None:
        """`backends`: the run's `config.logger` (its project, tags, entity and experiment reach the
        tracking backends), or only a list of backend names. `predicted`: metrics logged beside every
        step's own (placement=auto's predicted seconds, `hybridflow.planning.auto.predicted_metrics`)."""
        logger = None if isinstance(backends, (list, tuple)) else backends
        backends = list(backends if logger is None else logger.backends)
        self.started = time.monotonic()
        self.run_dir = run_dir
        self.predicted = dict(predicted or {})
        self.path = run_dir / "metrics.jsonl"
        restarts = run_dir / "restarts.jsonl"  # written by hybridflow.run.runner.run_with_restarts
        self.restarts = len(restarts.read_text().splitlines()) if restarts.exists() else 0
        self.console = "console" in backends
        self.progress = None
        if self.console and total_steps is not None:
            from hybridflow.output.console import Progress, stage_name

            self.progress = Progress(stage_name(run_dir.name), total_steps, initial_step=last_logged_step(run_dir))
        self.jsonl = "jsonl" in backends
        self.first_log = True
        self.prompts_logged = False
        missing = missing_backends(backends)
        if missing:
            raise ImportError(missing[0])
        where = tracking_names(run_dir, logger)
        self.tensorboard = _tensorboard(run_dir, where) if "tensorboard" in backends else None
        self.wandb = _wandb(run_dir, where) if "wandb" in backends else None
        self.mlflow = _mlflow(run_dir, where) if "mlflow" in backends else None

    def log_prompts(self, step: int, prompt_index: list[int]) -> None:
        """One line of run_dir/trained_prompts.jsonl: the training rows (indices into the training data,
        one per group, in the batch's order) that `step` trained on. Like metrics.jsonl, the first line a
        logger writes drops the lines at or past its step, so a resumed run's record holds each step once."""
        if not self.jsonl:
            return
        path = self.run_dir / "trained_prompts.jsonl"
        if not self.prompts_logged:
            drop_rows_from(path, step)
            self.prompts_logged = True
        with open(path, "a") as f:
            f.write(json.dumps({"step": step, "prompt_index": prompt_index}) + "\n")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        bad = {k: v for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)}
        metrics = {**metrics, **self.predicted, "time/elapsed_s": time.monotonic() - self.started}
        if self.restarts:
            metrics["trainer/restarts"] = self.restarts
        record = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        if self.jsonl:
            if self.first_log:
                drop_rows_from(self.path, step)
            self.first_log = False
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        numeric = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        if self.tensorboard is not None:
            for k, v in numeric.items():
                self.tensorboard.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(numeric, step=step)
        if self.mlflow is not None:
            self.mlflow.log_metrics({k.replace("/", "_"): v for k, v in numeric.items()}, step=step)
        if self.progress is not None:
            self.progress.update(step, metrics)
        elif self.console:
            self._line(step, metrics)
        if bad:
            from hybridflow.output.console import say

            say(f"[step {step}] warning: non-finite metrics {sorted(bad)}")

    def _line(self, step: int, metrics: dict) -> None:
        from hybridflow.output.console import say, stage_name

        if "val/accuracy" in metrics:  # an evaluation: the number, not every metric
            say(f"{stage_name(self.run_dir.name)}: held-out accuracy {metrics['val/accuracy']:.3f}")
            return
        shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
        say(f"[step {step}] {shown}")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
            self.progress = None
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.mlflow is not None:
            self.mlflow.end_run()


# backend -> (the module it imports, the pyproject extra that installs it)
BACKEND_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
                    "mlflow": ("mlflow", "mlflow")}


def missing_backends(backends: list[str]) -> list[str]:
    """One message per backend whose package is not installed, with the command that installs it
    (found without importing it: the check runs before anything starts and takes milliseconds)."""
    import importlib.util

    out = []
    for backend in backends:
        module, extra = BACKEND_PACKAGES.get(backend, (None, None))
        if module is not None and importlib.util.find_spec(module) is None:
            out.append(f"logger.backends has {backend!r}, but the {module} package is not installed; fix: "
                       f"pip install -e '.[{extra}]' (or pip install {module}), or drop {backend!r} from logger.backends")
    return out


def tracking_names(run_dir: Path, logger=None) -> dict:
    """How the run is filed in W&B / MLflow / TensorBoard: `logger.project` (W&B project, MLflow
    experiment unless `logger.experiment`), `logger.entity` (W&B), `logger.tags`; the run is named
    after its directory, a pipeline stage as `<pipeline run>/<stage>` and grouped by the pipeline."""
    stage = (run_dir.parent / "config.json").is_file()  # inside a pipeline's run directory
    name = f"{run_dir.parent.name}/{run_dir.name}" if stage else run_dir.name
    return {"project": getattr(logger, "project", "hybridflow"), "entity": getattr(logger, "entity", None),
            "experiment": getattr(logger, "experiment", None) or getattr(logger, "project", "hybridflow"),
            "tags": list(getattr(logger, "tags", []) or []), "name": name,
            "group": run_dir.parent.name if stage else None}


def _tensorboard(run_dir: Path, where: dict):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(run_dir / "tensorboard"))
    writer.add_text("run", f"project: {where['project']}; run: {where['name']}; tags: {', '.join(where['tags'])}")
    return writer


# The tracking backends' run ids, kept in the run directory: a run that continues in it (trainer.resume,
# an automatic restart, a pipeline stage run again) continues the same W&B / MLflow run, so its
# curves do not break at every restart. A new run directory starts new runs.
TRACKING_IDS = "tracking_ids.json"


def _saved_ids(run_dir: Path) -> dict:
    path = run_dir / TRACKING_IDS
    return json.loads(path.read_text()) if path.is_file() else {}


def _save_id(run_dir: Path, backend: str, run_id: str) -> None:
    from hybridflow.checkpoint.files import atomic_write_text

    atomic_write_text(run_dir / TRACKING_IDS, json.dumps({**_saved_ids(run_dir), backend: run_id}, indent=1))


def _wandb(run_dir: Path, where: dict):
    """W&B's run for this run directory: the saved id resumed (`resume="allow"`), else a new one. W&B
    keeps the first value of a step it has seen: steps a resumed run logs again (after its checkpoint)
    keep the earlier run's numbers there; metrics.jsonl holds the continuing run's."""
    import wandb

    run_id = _saved_ids(run_dir).get("wandb") or uuid.uuid4().hex[:8]  # W&B's own ids: 8 of [a-z0-9]
    run = wandb.init(dir=str(run_dir), project=where["project"], entity=where["entity"], name=where["name"],
                     group=where["group"], tags=where["tags"] or None, id=run_id, resume="allow")
    _save_id(run_dir, "wandb", run.id)
    return run


def _mlflow(run_dir: Path, where: dict):
    """MLflow's run for this run directory: the saved run continued, else a new one."""
    import mlflow

    mlflow.set_experiment(where["experiment"])
    saved = _saved_ids(run_dir).get("mlflow")
    if saved:
        mlflow.start_run(run_id=saved)
    else:
        run = mlflow.start_run(run_name=where["name"],
                               tags={"project": where["project"], **{t: "true" for t in where["tags"]}})
        _save_id(run_dir, "mlflow", run.info.run_id)
    return mlflow


def drop_rows_from(path: Path, step: int) -> int:
    """Remove the rows of metrics file `path` whose step is `step` or later (atomically: a new file
    renamed over the old); returns how many were removed."""
    if not path.exists():
        return 0
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in lines if int(json.loads(line)["step"]) < step]
    if len(kept) == len(lines):
        return 0
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(line + "\n" for line in kept))
    os.replace(partial, path)
    return len(lines) - len(kept)


def last_logged_step(run_dir: Path) -> int:
    """The step of the last line of run_dir/metrics.jsonl (0 when there is none)."""
    path = Path(run_dir) / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return int(json.loads(lines[-1])["step"]) if lines else 0


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
