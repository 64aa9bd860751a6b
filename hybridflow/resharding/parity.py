"""Engine parity: the sampler and the actor must compute the same model.

On the first batch of a run, before any update, the rollout engine holds exactly the actor's
weights (the sync at start-up put them there and the probe checked them). The mean absolute
difference of the sampler's and the actor's log-probs of the sampled tokens
(`rollout/log_prob_diff`) then measures only how differently the two engines compute: ~1e-7 in
float32 for an architecture both implement alike; when either computes in bfloat16 the rounding
of each layer adds up with depth: 1.3e-3 on a 4-layer tiny model, 0.023-0.032 on SmolLM2-135M's 30
layers (the greedy probe's tokens; up to 0.13-0.21 at its worst token). A gap far above that means they compute different models (dropout left on in the actor: 0.084 for
GPT-2; an architecture one engine implements differently), and every PPO ratio of the run
would carry it. `check_engine_parity` makes that an error; `trainer.engine_parity_tolerance`
raises the bar for whoever accepts a known gap.

The per-step probe (`hybridflow.resharding.verify`) checks the weights after every sync; this
check is the one that sees the training path itself (padding, batch, the update's forward mode).
"""

from __future__ import annotations

from pathlib import Path

FLOAT32_TOLERANCE = 1e-3
# bfloat16 / float16 on a side: a mean gap per token of up to this much per decoder layer, and never
# below the floor, for each such side (measured means: 1.3e-3 at 4 layers; at 30, 0.021-0.028 with one
# 16-bit side and 0.027-0.062 with both; a wrong weight or dropout left on gives 0.08 and more in
# float32, where the tolerance is 1e-3 — in 16 bits the exact question is the checksums')
HALF_TOLERANCE_PER_LAYER = 2e-3
HALF_TOLERANCE_FLOOR = 1e-2
GAP_KEY = "rollout/log_prob_diff"


class EngineParityError(RuntimeError):
    """The sampler and the actor compute different models."""


def precision_tolerance(dtypes: tuple[str, ...], layers: int) -> float:
    """The largest mean |log-prob difference| per token between two engines that hold the same weights
    and compute the same model in `dtypes` (the actor's and the rollout's) through `layers` decoder
    layers: 1e-3 when both are float32, else max(1e-2, 2e-3 per layer) for each side that computes
    in 16 bits (0.06 at 30 layers with one, 0.12 with both: each engine's rounding adds its own)."""
    half_sides = sum(d != "float32" for d in dtypes)
    if half_sides == 0:
        return FLOAT32_TOLERANCE
    return half_sides * max(HALF_TOLERANCE_FLOOR, HALF_TOLERANCE_PER_LAYER * layers)


def parity_tolerance(configured: float | None, dtypes: tuple[str, ...], layers: int) -> float:
    """`configured` (trainer.engine_parity_tolerance) or the default for the engines' dtypes and depth."""
    return configured if configured is not None else precision_tolerance(dtypes, layers)


def check_engine_parity(gap: float, *, tolerance: float, architecture: str, dtypes: tuple[str, ...],
                        layers: int) -> None:
    """Raise `EngineParityError` when the first batch's sampler-vs-actor gap is above `tolerance`
    (or not a number)."""
    if gap <= tolerance:
        return
    raise EngineParityError(
        f"engine parity: on the first batch, before any update, the sampler's log-probs differ from the actor's "
        f"by {gap:.3g} on average ({GAP_KEY}; tolerance {tolerance:g} for model.dtype/rollout.dtype="
        f"{'/'.join(dtypes)} at {layers} layers), although both hold the same weights: the rollout engine and the actor compute "
        f"different models of {architecture}. Causes seen: dropout kept in the actor (model.keep_dropout=true), "
        "an architecture the two engines implement differently. To train on this gap knowingly, set "
        f"trainer.engine_parity_tolerance above {gap:.3g}")


def model_architecture(model_dir: str | Path) -> str:
    """The architecture named in a model directory's config.json (for messages)."""
    from hybridflow.config.model_facts import ModelFacts

    facts = ModelFacts.from_dir(model_dir)
    return facts.architecture if facts is not None else f"the model in {model_dir}"


class FirstBatchParity:
    """Checks the gap the first time a step of this run reports it (later steps follow updates)."""

    def __init__(self, tolerance: float | None, dtypes: tuple[str, ...], model_dir: str | Path, layers: int) -> None:
        self.tolerance, self.dtypes, self.layers = parity_tolerance(tolerance, dtypes, layers), dtypes, layers
        self.architecture = model_architecture(model_dir)
        self.checked = False

    @classmethod
    def from_config(cls, config, model_dir: str | Path) -> "FirstBatchParity":
        from hybridflow.config.schema import model_layers

        return cls(config.trainer.engine_parity_tolerance, (config.model.dtype.value, config.rollout.dtype.value),
                   model_dir, model_layers(config.model))

    def check(self, metrics: dict[str, float]) -> None:
        if self.checked or GAP_KEY not in metrics:
            return
        self.checked = True
        check_engine_parity(metrics[GAP_KEY], tolerance=self.tolerance, architecture=self.architecture,
                            dtypes=self.dtypes, layers=self.layers)
