"""What a run prints to the console, and where everything else goes.

The console gets a screenful: the run directory, one live progress line per stage (step, ETA
and the few numbers a user watches), validation results and stage summaries as plain lines,
and errors whole. Everything the libraries write goes to `<run_dir>/logs/`:

- `logs/driver.log`: the driver's Python logging (Ray, transformers, torch, hybridflow) and
  Python warnings;
- `logs/<stage>/<pool>-rank<r>.log`: each worker process's stdout and stderr (vLLM, Ray,
  transformers, torch, a reward function's prints), redirected inside the process by
  `hybridflow.controller` (Ray's own forwarding to the driver is off, `log_to_driver=False`).

With `logger.verbose=true` nothing is redirected: the console gets all of it, as Ray, vLLM and
transformers print it. The console state is per driver process: the `hybridflow` command opens
a `session` for its run; code outside one (tests, a notebook) keeps the libraries' own behaviour.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

_DEFAULTS = {"log_dir": None, "verbose": True, "stage": None}
_state: dict = {**_DEFAULTS, "open": []}

# The numbers a user watches on a progress line: metric key -> short label, in display order.
WATCHED = {
    "actor/loss": "loss",
    "reward/score": "reward",
    "reward/accuracy": "acc",
    "kl/token_mean": "kl",
    "kl_loss": "kl_loss",
    "perf/tokens_per_s": "tok/s",
    "val/accuracy": "val",
}


@contextmanager
def session(run_dir: Path, verbose: bool) -> Iterator[Path]:
    """For one run of the `hybridflow` command: the driver's logging goes to run_dir/logs/driver.log
    (and to stderr when verbose), worker processes write under run_dir/logs/ (unless verbose).
    Yields the logs directory; afterwards the process's logging is as it was (a test may call
    `hybridflow.cli.run` in-process). Hydra's stdout handler is set aside: its records go to the file."""
    log_dir = Path(run_dir) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    file_handler = logging.FileHandler(log_dir / "driver.log")
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.handlers = [file_handler] + ([logging.StreamHandler(sys.stderr)] if verbose else [])
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)  # warnings.warn(...) from any library: logger 'py.warnings'
    _route_transformers(quiet=not verbose)
    _state.update(log_dir=log_dir, verbose=verbose)
    try:
        yield log_dir
    finally:
        _state.update(_DEFAULTS)
        _route_transformers(quiet=False)
        logging.captureWarnings(False)
        root.handlers, root.level = saved
        file_handler.close()


def _route_transformers(quiet: bool) -> None:
    """transformers has its own console handler and progress bars ("Writing model shards" of
    save_pretrained in the driver): when quiet, its records reach the root's file instead."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    if quiet:
        hf_logging.disable_default_handler()
        hf_logging.disable_progress_bar()
        hf_logging.enable_propagation()
    else:
        hf_logging.enable_default_handler()
        hf_logging.enable_progress_bar()
        hf_logging.disable_propagation()


def quiet() -> bool:
    """True when library output goes to the logs directory instead of the console."""
    return not _state["verbose"]


def worker_log_dir() -> Path | None:
    """Where worker processes of the current stage write their stdout/stderr (None: not redirected)."""
    if _state["verbose"] or _state["log_dir"] is None:
        return None
    stage = _state["stage"]
    return _state["log_dir"] / stage if stage else _state["log_dir"]


@contextmanager
def stage(name: str) -> Iterator[None]:
    """Label a stage of a pipeline: its progress line and its workers' log folder carry the name."""
    previous = _state["stage"]
    _state["stage"] = name
    try:
        yield
    finally:
        _state["stage"] = previous


def stage_name(default: str) -> str:
    return _state["stage"] or default


def say(text: str) -> None:
    """A plain line on the console, above any live progress line."""
    from tqdm import tqdm

    tqdm.write(text, file=sys.stdout)
    sys.stdout.flush()


def end_progress_lines() -> None:
    """End every live progress line where it stands (a run that raised: no summary)."""
    while _state["open"]:
        _state["open"].pop().bar.close()


def _fmt(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    if value != 0 and (abs(value) >= 1e4 or abs(value) < 1e-3):
        return f"{value:.3g}"
    return f"{value:.4g}" if abs(value) >= 100 else f"{value:.3f}"


def watched(metrics: dict) -> dict[str, str]:
    """The watched numbers present in `metrics`, as label -> text (the loss only where there is
    no reward to watch: supervised steps)."""
    shown = {label: _fmt(float(metrics[key])) for key, label in WATCHED.items()
             if isinstance(metrics.get(key), (int, float))}
    if "reward" in shown:
        shown.pop("loss", None)
    return shown


class Progress:
    """One live line for a stage's step loop: `<stage> 120/800 [02:10<12:20, ...] loss=0.42 val=0.31`.

    On a terminal the line redraws in place; in a file or a pipe it is rewritten with carriage
    returns at most once a second and ends with one newline, so it counts as one line."""

    def __init__(self, name: str, total_steps: int, initial_step: int = 0) -> None:
        from tqdm import tqdm

        self.name, self.total_steps, self.initial_step = name, total_steps, initial_step
        self.started = time.monotonic()
        self.last: dict[str, str] = {}
        self.validation: str | None = None
        _state["open"].append(self)
        self.bar = tqdm(total=total_steps, initial=initial_step, desc=name, unit="step", file=sys.stdout,
                        dynamic_ncols=True, mininterval=1.0, smoothing=0.1,
                        bar_format="{desc} {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}]{postfix}")

    def update(self, step: int, metrics: dict) -> None:
        numbers = watched(metrics)
        if "val" in numbers:
            self.validation = numbers["val"]
            say(f"{self.name} step {step}/{self.total_steps}: held-out accuracy {numbers['val']}"
                + (f" ({_fmt(metrics['val/reward_mean'])} mean reward)" if "val/reward_mean" in metrics
                   and metrics["val/reward_mean"] != metrics["val/accuracy"] else ""))
        self.last.update(numbers)
        self.bar.set_postfix_str(" ".join(f"{k}={v}" for k, v in self.last.items()), refresh=False)
        self.bar.update(step - self.bar.n)

    def close(self) -> None:
        if self in _state["open"]:
            _state["open"].remove(self)
        self.bar.close()
        steps = self.bar.n - self.initial_step
        minutes, seconds = divmod(int(time.monotonic() - self.started), 60)
        shown = " ".join(f"{k}={v}" for k, v in self.last.items() if k != "val")
        final = f", held-out accuracy {self.validation}" if self.validation else ""
        say(f"{self.name}: {steps} steps in {minutes}m{seconds:02d}s{final}" + (f" (last step: {shown})" if shown else ""))
