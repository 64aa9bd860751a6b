"""Merge hooks: small registered components that plug checkpoint merging into a pipeline.

Two registries, one signature each (docs/merge.md, "Hooks"):

    STAGE_HOOKS      between two stages: the model directory the next stage starts from
        hook(*, previous_run_dir: Path, output_dir: Path, **params) -> Path
    TRAINING_HOOKS   inside a training loop: new weights for the reference model, or None
        hook(*, step: int, actor_state: dict[str, Tensor], reference_state: dict[str, Tensor],
             **params) -> dict[str, Tensor] | None

A pipeline config names a hook and its params with `HookConfig`; `run_stage_hook` and
`run_training_hook` look the name up (an unknown one lists the registered ones), check the
params against the hook's keyword arguments (unknown and missing ones are errors naming what
the hook takes) and check what the hook returns. Users add hooks with
`@STAGE_HOOKS.register("name")` or name them `package.module:function` / `file.py:function`.

PMA-init ("Model Merging in Pre-training"): the next stage starts from an average of the
previous stage's last N complete checkpoints (`pma_sma`, `pma_ema`, `pma_wma`), written as a
Hugging Face directory by `merge_checkpoints` (with its validation, atomic output and provenance).

A stage hook states how many of the previous stage's newest checkpoints it reads with
`@reads_checkpoints(lambda params: ...)`; `checkpoints_needed` tells the pipeline, which keeps
that many weights-only snapshots in the previous stage (`trainer.keep_last_weights`). A hook
that states nothing (a user's `module:function`) gets every snapshot.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Union

import torch

from hybridflow.config.hooks import HookConfig  # noqa: F401 - the schema, importable without torch
from hybridflow.merge.api import merge_checkpoints, merge_state_dicts
from hybridflow.merge.checkpoints import StateDictCheckpoint, last_checkpoints
from hybridflow.merge.errors import MergeError
from hybridflow.merge.validate import check_inputs
from hybridflow.registry import Registry

StateDict = Dict[str, torch.Tensor]

STAGE_HOOKS: Registry[Callable[..., Path]] = Registry(
    "stage hook", "hook(*, previous_run_dir: Path, output_dir: Path, **params) -> Path")
TRAINING_HOOKS: Registry[Callable[..., Optional[StateDict]]] = Registry(
    "training hook",
    "hook(*, step: int, actor_state: dict[str, Tensor], reference_state: dict[str, Tensor], **params) "
    "-> dict[str, Tensor] | None")
STAGE_ARGS = ("previous_run_dir", "output_dir")
TRAINING_ARGS = ("step", "actor_state", "reference_state")
FINAL_MODEL = "final_model"  # RUN_DIR/final_model: the model a recipe exports at its end


# ------------------------------------------------------------------------------ running


def run_stage_hook(config: HookConfig, previous_run_dir: Union[str, Path], output_dir: Union[str, Path]) -> Path:
    """Run the stage hook `config` names; returns the model directory the next stage starts from."""
    hook = STAGE_HOOKS.get(config.name)
    params = _plain(config.params)
    check_hook_params(STAGE_HOOKS, config.name, hook, params, STAGE_ARGS)
    result = hook(previous_run_dir=Path(previous_run_dir).expanduser(), output_dir=Path(output_dir).expanduser(),
                  **params)
    if not isinstance(result, (str, Path)) or not (Path(result) / "config.json").is_file():
        raise MergeError(f"stage hook {config.name!r} returned {result!r}, which is not a model directory with a "
                         "config.json; a stage hook must return the directory the next stage starts from")
    return Path(result)


def run_training_hook(config: HookConfig, *, step: int, actor_state: StateDict,
                      reference_state: StateDict) -> Optional[StateDict]:
    """Run the training hook `config` names; returns new reference weights or None (keep them)."""
    hook = TRAINING_HOOKS.get(config.name)
    params = _plain(config.params)
    check_hook_params(TRAINING_HOOKS, config.name, hook, params, TRAINING_ARGS)
    result = hook(step=step, actor_state=actor_state, reference_state=reference_state, **params)
    if result is None:
        return None
    if not isinstance(result, dict):
        raise MergeError(f"training hook {config.name!r} returned a {type(result).__name__}; it must return a "
                         "state dict of new reference weights or None")
    check_inputs([StateDictCheckpoint(result, f"training hook {config.name!r} result"),
                  StateDictCheckpoint(reference_state, "the reference state")], None)
    return result


def check_hook_params(registry: Registry, name: str, hook: Callable, params: dict, given: tuple[str, ...]) -> None:
    """Raise MergeError when `params` has a key the hook does not take, lacks a required one,
    or sets an argument the runner passes itself (`given`), or the hook does not accept those."""
    signature = inspect.signature(hook)
    takes = {n: p for n, p in signature.parameters.items()
             if n not in given and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    open_ended = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    problems = []
    if lacking := ([] if open_ended else [g for g in given if g not in signature.parameters]):
        problems.append(f"it does not accept {lacking}; a {registry.kind} must have the signature {registry.signature}")
    if reserved := sorted(set(params) & set(given)):
        problems.append(f"params {reserved} are passed by the runner, remove them from params")
    if unknown := ([] if open_ended else sorted(set(params) - set(takes) - set(given))):
        problems.append(f"unknown params {unknown}")
    if missing := sorted(n for n, p in takes.items() if p.default is p.empty and n not in params):
        problems.append(f"missing params {missing}")
    if problems:
        described = ", ".join(f"{n} (required)" if p.default is p.empty else f"{n} (default {p.default!r})"
                              for n, p in takes.items()) or "no params"
        raise MergeError(f"{registry.kind} {name!r}: {'; '.join(problems)}; it takes {described}")


def _plain(params: Any) -> dict:
    """Params as a plain dict (Hydra gives a DictConfig)."""
    try:
        from omegaconf import OmegaConf
    except ImportError:  # hooks also run without Hydra
        OmegaConf = None
    if OmegaConf is not None and OmegaConf.is_config(params):
        params = OmegaConf.to_container(params, resolve=True)
    if not isinstance(params, dict):
        raise MergeError(f"hook params must be a mapping of name to value, got {type(params).__name__}")
    return dict(params)


# ---------------------------------------------------------------------------- stage hooks


def reads_checkpoints(window: Callable[[dict], int]) -> Callable[[Callable], Callable]:
    """Decorator for a stage hook: `window(params)` is how many of the previous stage's newest
    checkpoints (their hf/ weights) the hook reads; 0 when it reads none."""

    def mark(hook: Callable) -> Callable:
        hook.checkpoint_window = window
        return hook

    return mark


def checkpoints_needed(config: HookConfig) -> Optional[int]:
    """How many newest checkpoints of the previous stage the stage hook `config` reads, or None
    when the hook does not say (then the previous stage keeps the weights of every checkpoint)."""
    hook = STAGE_HOOKS.get(config.name)
    window = getattr(hook, "checkpoint_window", None)
    if window is None:
        return None
    params = _plain(config.params)
    check_hook_params(STAGE_HOOKS, config.name, hook, params, STAGE_ARGS)
    return window(params)


def _last_param(params: dict) -> int:
    return _positive_int("last", params["last"])


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MergeError(f"{name}={value!r}: must be a whole number of at least 1, e.g. {name}: 5")
    return value


def _pma(previous_run_dir: Path, output_dir: Path, method: str, last: int, **options) -> Path:
    inputs = last_checkpoints(previous_run_dir, _positive_int("last", last))
    return merge_checkpoints(inputs, output_dir, method, **options)


@STAGE_HOOKS.register("pma_sma")
@reads_checkpoints(_last_param)
def pma_sma(*, previous_run_dir: Path, output_dir: Path, last: int, dtype: Optional[str] = None,
            overwrite: bool = False) -> Path:
    """PMA-init: the SMA of the previous stage's last `last` complete checkpoints, written to `output_dir`."""
    return _pma(previous_run_dir, output_dir, "sma", last, dtype=dtype, overwrite=overwrite)


@STAGE_HOOKS.register("pma_ema")
@reads_checkpoints(_last_param)
def pma_ema(*, previous_run_dir: Path, output_dir: Path, last: int, alpha: float, dtype: Optional[str] = None,
            overwrite: bool = False) -> Path:
    """PMA-init with EMA (recursion from the oldest; `alpha` is the newest's weight)."""
    return _pma(previous_run_dir, output_dir, "ema", last, alpha=_check_alpha(alpha), dtype=dtype,
                overwrite=overwrite)


@STAGE_HOOKS.register("pma_wma")
@reads_checkpoints(_last_param)
def pma_wma(*, previous_run_dir: Path, output_dir: Path, last: int, dtype: Optional[str] = None,
            overwrite: bool = False) -> Path:
    """PMA-init with WMA (weights 1, 2, ..., N: the newest heaviest)."""
    return _pma(previous_run_dir, output_dir, "wma", last, dtype=dtype, overwrite=overwrite)


@STAGE_HOOKS.register("last_checkpoint")
@reads_checkpoints(lambda params: 1)
def last_checkpoint(*, previous_run_dir: Path, output_dir: Path) -> Path:
    """The newest complete checkpoint's hf/ directory, as is (nothing is written)."""
    newest = last_checkpoints(previous_run_dir, 1)[0]
    if newest.name != "hf":
        raise MergeError(f"the newest complete checkpoint {newest.parent} has no hf/ export, only {newest.name}/; "
                         "use the stage hook pma_sma with last: 1, which writes it as a Hugging Face model")
    return newest


@STAGE_HOOKS.register("final_model")
@reads_checkpoints(lambda params: 0)
def final_model(*, previous_run_dir: Path, output_dir: Path) -> Path:
    """RUN_DIR/final_model: the model the previous stage's recipe exported at its end."""
    path = previous_run_dir / FINAL_MODEL
    if not (path / "config.json").is_file():
        state = "has no config.json" if path.is_dir() else "does not exist"
        raise MergeError(f"{path} {state}: the previous stage did not finish or did not export its final model "
                         "(trainer.export_hf); use the stage hook last_checkpoint or pma_sma instead")
    return path


@STAGE_HOOKS.register("pipeline_start")
@reads_checkpoints(lambda params: 0)
def pipeline_start(*, previous_run_dir: Path, output_dir: Path) -> Path:
    """The model the pipeline's first stage started from (its model.path, or the tiny model it built into
    base_model/): a fresh student for a stage that distils an earlier stage's model (teacher_stage)."""
    first = min(p for p in Path(previous_run_dir).parent.iterdir() if p.is_dir() and p.name[:2].isdigit())
    saved = first / "config.json"
    path = json.loads(saved.read_text())["model"]["path"] if saved.is_file() else None
    start = Path(path).expanduser() if path else first / "base_model"
    if not (start / "config.json").is_file():
        raise MergeError(f"{start}: the pipeline's first stage ({first.name}) started from no model directory there; "
                         "its run directory is incomplete: rerun the pipeline under a new logger.run_name")
    return start


# ------------------------------------------------------------------------- training hooks


def _check_alpha(alpha: Any) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 < alpha <= 1.0:
        raise MergeError(f"alpha={alpha!r}: must be a number in (0, 1], the weight of the newer weights, e.g. 0.1")
    return float(alpha)


def _due(step: int, every_steps: int) -> bool:
    """Fires at steps every_steps, 2 * every_steps, ...; never at step 0 (actor == reference)."""
    return step > 0 and step % _positive_int("every_steps", every_steps) == 0


@TRAINING_HOOKS.register("reference_ema")
def reference_ema(*, step: int, actor_state: StateDict, reference_state: StateDict, every_steps: int,
                  alpha: float) -> Optional[StateDict]:
    """Every `every_steps` steps: reference <- alpha * actor + (1 - alpha) * reference (fp32 arithmetic;
    integer tensors and buffers are taken from the actor)."""
    alpha = _check_alpha(alpha)  # checked at every call, not only when due: a typo fails at the first step
    if not _due(step, every_steps):
        return None
    return merge_state_dicts([reference_state, actor_state], "ema", alpha=alpha)


@TRAINING_HOOKS.register("reference_reset")
def reference_reset(*, step: int, actor_state: StateDict, reference_state: StateDict,
                    every_steps: int) -> Optional[StateDict]:
    """Every `every_steps` steps: reference <- a copy of the actor (checked to be the same model)."""
    if not _due(step, every_steps):
        return None
    check_inputs([StateDictCheckpoint(reference_state, "reference_state"),
                  StateDictCheckpoint(actor_state, "actor_state")], None)
    return merge_state_dicts([actor_state], "sma")  # the SMA of one: an exact copy, tied keys kept tied
