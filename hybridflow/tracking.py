"""Run directories and metrics.

A run has one directory (printed at start and end) holding `metrics.jsonl` (one JSON object
per step with at least `step`), the resolved config, checkpoints and the final model.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any


def make_run_dir(output_root: str, run_name: str | None, recipe: str) -> Path:
    name = run_name or f"{recipe}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(output_root).expanduser().resolve() / name
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def _jsonable(value: Any) -> Any:
    if is_dataclass(value):
        return _jsonable(asdict(value))
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def save_config(config: Any, run_dir: Path) -> Path:
    path = run_dir / "config.json"
    path.write_text(json.dumps(_jsonable(config), indent=2))
    return path


class MetricsLogger:
    """Appends one JSON line per `log` call to run_dir/metrics.jsonl and shows it on the console.

    On the console (backend `console`), a step loop of `total_steps` is one live progress line
    with the watched numbers, plus a line per validation and a summary at `close`
    (hybridflow.console); without `total_steps` each `log` is one line.
    Each JSON line also carries `time/elapsed_s`: wall-clock seconds since this logger was made (the
    step loop of this process, validation included; a resumed run counts from its restart)."""

    def __init__(self, run_dir: Path, backends: list[str], total_steps: int | None = None) -> None:
        self.started = time.monotonic()
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        restarts = run_dir / "restarts.jsonl"  # written by hybridflow.runner.run_with_restarts
        self.restarts = len(restarts.read_text().splitlines()) if restarts.exists() else 0
        self.console = "console" in backends
        self.progress = None
        if self.console and total_steps is not None:
            from hybridflow.console import Progress, stage_name

            self.progress = Progress(stage_name(run_dir.name), total_steps, initial_step=last_logged_step(run_dir))
        self.jsonl = "jsonl" in backends
        self.tensorboard = None
        if "tensorboard" in backends:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ImportError("logger.backends has 'tensorboard': pip install tensorboard") from exc
            self.tensorboard = SummaryWriter(str(run_dir / "tensorboard"))
        self.wandb = self.mlflow = None
        if "wandb" in backends:
            try:
                import wandb
            except ImportError as exc:
                raise ImportError("logger.backends has 'wandb': pip install wandb") from exc
            self.wandb = wandb.init(dir=str(run_dir), name=run_dir.name)
        if "mlflow" in backends:
            try:
                import mlflow
            except ImportError as exc:
                raise ImportError("logger.backends has 'mlflow': pip install mlflow") from exc
            mlflow.start_run(run_name=run_dir.name)
            self.mlflow = mlflow

    def log(self, step: int, metrics: dict[str, float]) -> None:
        bad = {k: v for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)}
        metrics = {**metrics, "time/elapsed_s": time.monotonic() - self.started}
        if self.restarts:
            metrics["trainer/restarts"] = self.restarts
        record = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        if self.jsonl:
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
            from hybridflow.console import say

            say(f"[step {step}] warning: non-finite metrics {sorted(bad)}")

    def _line(self, step: int, metrics: dict) -> None:
        from hybridflow.console import say, stage_name

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


def last_logged_step(run_dir: Path) -> int:
    """The step of the last line of run_dir/metrics.jsonl (0 when there is none)."""
    path = Path(run_dir) / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return int(json.loads(lines[-1])["step"]) if lines else 0


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
