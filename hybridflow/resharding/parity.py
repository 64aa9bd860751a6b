"""Engine parity: the sampler and the actor must compute the same model.

On the first batch of a run, before any update, the rollout engine holds exactly the actor's
weights (the sync at start-up put them there and the probe checked them). The mean absolute
difference of the sampler's and the actor's log-probs of the sampled tokens
(`rollout/log_prob_diff`) then measures only how differently the two engines compute: ~1e-7 in
float32 for an architecture both implement alike, ~1e-3 when either computes in bfloat16. A gap
far above that means they compute different models (dropout left on in the actor: 0.084 for
GPT-2; an architecture one engine implements differently), and every PPO ratio of the run
would carry it. `check_engine_parity` makes that an error; `trainer.engine_parity_tolerance`
raises the bar for whoever accepts a known gap.

The per-step probe (`hybridflow.resharding.verify`) checks the weights after every sync; this
check is the one that sees the training path itself (padding, batch, the update's forward mode).
"""

from __future__ import annotations

import json
from pathlib import Path

FLOAT32_TOLERANCE = 1e-3
HALF_TOLERANCE = 5e-2  # bfloat16 / float16 on either side
GAP_KEY = "rollout/log_prob_diff"


class EngineParityError(RuntimeError):
    """The sampler and the actor compute different models."""


def parity_tolerance(configured: float | None, dtypes: tuple[str, ...]) -> float:
    """`configured` (trainer.engine_parity_tolerance) or the default for the engines' dtypes."""
    if configured is not None:
        return configured
    return FLOAT32_TOLERANCE if all(d == "float32" for d in dtypes) else HALF_TOLERANCE


def check_engine_parity(gap: float, *, tolerance: float, architecture: str, dtypes: tuple[str, ...]) -> None:
    """Raise `EngineParityError` when the first batch's sampler-vs-actor gap is above `tolerance`
    (or not a number)."""
    if gap <= tolerance:
        return
    raise EngineParityError(
        f"engine parity: on the first batch, before any update, the sampler's log-probs differ from the actor's "
        f"by {gap:.3g} on average ({GAP_KEY}; tolerance {tolerance:g} for model.dtype/rollout.dtype="
        f"{'/'.join(dtypes)}), although both hold the same weights: the rollout engine and the actor compute "
        f"different models of {architecture}. Causes seen: dropout kept in the actor (model.keep_dropout=true), "
        "an architecture the two engines implement differently. To train on this gap knowingly, set "
        f"trainer.engine_parity_tolerance above {gap:.3g}")


def model_architecture(model_dir: str | Path) -> str:
    """The architecture named in a model directory's config.json (for messages)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return f"the model in {model_dir}"
    names = config.get("architectures") or [config.get("model_type", "an unknown architecture")]
    return str(names[0])


class FirstBatchParity:
    """Checks the gap the first time a step of this run reports it (later steps follow updates)."""

    def __init__(self, tolerance: float | None, dtypes: tuple[str, ...], model_dir: str | Path) -> None:
        self.tolerance, self.dtypes = parity_tolerance(tolerance, dtypes), dtypes
        self.architecture = model_architecture(model_dir)
        self.checked = False

    @classmethod
    def from_config(cls, config, model_dir: str | Path) -> "FirstBatchParity":
        return cls(config.trainer.engine_parity_tolerance, (config.model.dtype.value, config.rollout.dtype.value),
                   model_dir)

    def check(self, metrics: dict[str, float]) -> None:
        if self.checked or GAP_KEY not in metrics:
            return
        self.checked = True
        check_engine_parity(metrics[GAP_KEY], tolerance=self.tolerance, architecture=self.architecture,
                            dtypes=self.dtypes)
