"""Combining reward sources into one score per sample, with extras and metrics.

The total reward of a sample is sum_i weight_i * score_i over the configured functions (and
the reward model). Per sample the composer also keeps each source's score (`<name>/score`)
and the extras that dict-returning functions add (`<extra>`; `<function>/<extra>` when
several functions are configured, so that two functions' `accuracy` stay apart). Metrics
average each extra over the samples that have it.

Errors: with `on_error="raise"` the first failing sample raises its `RewardFunctionError`;
with `"fallback"` it is scored `fallback_score` for that function, flagged, counted per cause
in the metrics, and its error is logged.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from hybridflow.rewards.builtin import REWARD_FUNCTIONS
from hybridflow.config.reward import REWARD_MODEL_NAME, RewardConfig, RewardFunctionConfig
from hybridflow.rewards.functions import RewardFunction, RewardFunctionError
from hybridflow.rewards.model import RewardModelScorer, load_reward_model

log = logging.getLogger(__name__)

FALLBACK_CAUSES = RewardFunctionError.FALLBACK_KINDS  # raised, bad_value, timeout
SCORE_KEY = "sequence_rewards"  # (B,) float32: the total reward per sample
EXTRA_PREFIX = "reward_extra/"  # (B,) float32 per extra, NaN where a sample lacks it
FALLBACK_KEY = "reward_fallback"  # (B,) bool: True where any function fell back on the sample


@dataclass
class RewardResult:
    scores: list[float]  # total reward per sample
    extras: dict[str, list[float]]  # per sample, NaN where a sample lacks the extra
    metrics: dict[str, float]
    fallback: list[bool] = field(default_factory=list)  # a function fell back on the sample
    fallback_causes: dict[str, list[bool]] = field(default_factory=dict)  # cause -> per sample

    def tensors(self, extra_names: list[str] | None = None) -> dict[str, Any]:
        """The result as (B,) tensors; `extra_names` forces a column per name (NaN where absent)."""
        import torch

        size = len(self.scores)
        names = sorted(set(self.extras) | set(extra_names or []))
        out = {SCORE_KEY: torch.tensor(self.scores, dtype=torch.float32).reshape(size)}
        for name in names:
            values = self.extras.get(name, [math.nan] * size)
            out[EXTRA_PREFIX + name] = torch.tensor(values, dtype=torch.float32).reshape(size)
        out[FALLBACK_KEY] = torch.tensor(self.fallback, dtype=torch.bool).reshape(size)
        for cause in FALLBACK_CAUSES:
            out[f"{FALLBACK_KEY}/{cause}"] = torch.tensor(self.fallback_causes[cause], dtype=torch.bool).reshape(size)
        return out


def reward_metrics(batch: Any) -> dict[str, float]:
    """Metrics from reward tensors (a Batch or a dict of tensors, as `RewardResult.tensors`).

    `reward/score`: mean total reward; `reward/score_std`: its standard deviation over the samples
    (population); `reward/<extra>`: mean over the samples that have it
    (NaN entries ignored; left out when no sample has it); `reward/fallback_count`: samples a
    function fell back on; `reward/fallback/<cause>`: samples per cause.
    """
    import torch

    tensors: Mapping[str, torch.Tensor] = getattr(batch, "tensors", batch)
    scores = tensors[SCORE_KEY].float()
    metrics = {"reward/score": float(scores.mean()),  # and its spread: 0 is a batch without learning signal
               "reward/score_std": float(scores.std(correction=0)) if scores.numel() else 0.0}
    for key, values in sorted(tensors.items()):
        if key.startswith(EXTRA_PREFIX):
            present = values[~torch.isnan(values)]
            if present.numel():
                metrics["reward/" + key[len(EXTRA_PREFIX):]] = float(present.mean())
    if FALLBACK_KEY in tensors:
        metrics["reward/fallback_count"] = float(tensors[FALLBACK_KEY].sum())
    for cause in FALLBACK_CAUSES:
        if f"{FALLBACK_KEY}/{cause}" in tensors:
            metrics[f"reward/fallback/{cause}"] = float(tensors[f"{FALLBACK_KEY}/{cause}"].sum())
    return metrics


class RewardComposer:
    """Scores rows with every function and the optional reward model, weighted and summed."""

    def __init__(self, functions: list[RewardFunction], reward_model: RewardModelScorer | None = None,
                 reward_model_weight: float = 1.0, *, timeout_s: float = 30.0, max_concurrency: int = 8,
                 on_error: str = "raise", fallback_score: float = 0.0) -> None:
        if not functions and reward_model is None:
            raise ValueError("RewardComposer needs at least one reward function or a reward model")
        if on_error not in ("raise", "fallback"):
            raise ValueError(f"RewardComposer: on_error={on_error!r}; use 'raise' or 'fallback'")
        self.functions, self.reward_model, self.reward_model_weight = functions, reward_model, reward_model_weight
        self.timeout_s, self.max_concurrency = timeout_s, max_concurrency
        self.on_error, self.fallback_score = on_error, fallback_score

    def score(self, rows: list[dict[str, Any]], first_index: int = 0) -> RewardResult:
        """Rows hold `prompt`, `response` and the data columns; sample numbers start at `first_index`."""
        size = len(rows)
        result = RewardResult([0.0] * size, {}, {}, [False] * size, {c: [False] * size for c in FALLBACK_CAUSES})
        if not size:
            return result
        for fn in self.functions:
            self._add_function(fn, rows, first_index, result)
        if self.reward_model is not None:
            scores = self.reward_model.score(rows, first_index)
            result.extras[f"{REWARD_MODEL_NAME}/score"] = scores
            result.scores = [t + self.reward_model_weight * s for t, s in zip(result.scores, scores)]
        result.metrics = reward_metrics(result.tensors())
        return result

    def _add_function(self, fn: RewardFunction, rows: list[dict], first_index: int, result: RewardResult) -> None:
        size = len(rows)
        out = fn.score(rows, timeout_s=self.timeout_s, max_concurrency=self.max_concurrency,
                       stop_on_error=self.on_error == "raise", first_index=first_index)
        own: list[float] = [math.nan] * size
        namespaced = len(self.functions) > 1
        first = out.first_error()
        setup = next((e for e in out.errors if e is not None and e.kind not in FALLBACK_CAUSES), None)
        if setup is not None or (first is not None and self.on_error == "raise"):
            raise setup or first  # a setup error fails every sample alike: never scored with the fallback
        if first is not None:
            log.warning("reward function %s fell back to %s on %d of %d samples; first error: %s",
                        fn.reference, self.fallback_score, sum(e is not None for e in out.errors), size, first)
        for i in range(size):
            err = out.errors[i]
            if err is not None:
                own[i] = self.fallback_score
                result.fallback[i] = True
                result.fallback_causes[err.kind][i] = True
            else:
                own[i] = out.scores[i]
                for key, value in out.extras[i].items():
                    name = f"{fn.name}/{key}" if namespaced else key
                    result.extras.setdefault(name, [math.nan] * size)[i] = value
            result.scores[i] += fn.weight * own[i]
        result.extras[f"{fn.name}/score"] = own


def build_reward_function(spec: RewardFunctionConfig, key: str) -> RewardFunction:
    """Load the function `spec.fn` names (registered, module or file) and wrap it."""
    try:
        fn = REWARD_FUNCTIONS.get(spec.fn)
        getattr(fn, "reward_requires", lambda: None)()  # a missing optional package: ImportError naming the fix
    except Exception as exc:
        raise RewardFunctionError(f"cannot load reward function {key}={spec.fn!r}: {type(exc).__name__}: {exc}",
                                  function=spec.fn, kind="load") from exc
    return RewardFunction(fn, spec.fn, spec.metric_name, spec.weight, spec.batched, spec.kwargs, key)


def build_reward(config: RewardConfig, device: str = "cpu") -> RewardComposer:
    """The composer for `reward.*`: its functions loaded, its reward model (if any) on `device`."""
    functions = [build_reward_function(spec, key) for spec, key in zip(config.function_specs(), config.function_keys())]
    model_cfg = config.reward_model
    model = None
    if model_cfg.path is not None:
        model = load_reward_model(model_cfg.path, model_cfg.max_length, model_cfg.micro_batch_rows, device)
    return RewardComposer(functions, model, model_cfg.weight, timeout_s=config.timeout_s,
                          max_concurrency=config.max_concurrency, on_error=config.on_error,
                          fallback_score=config.fallback_score)
