"""How much of the model an optimizer step moves, as a 16-bit copy of the weights holds them.

A trained role keeps float32 master weights and computes (and the rollout engine generates) with a
copy cast to `model.dtype` / `rollout.dtype` by rounding to nearest. An Adam step moves each master
weight by about the learning rate; bfloat16 keeps 8 significant bits, so for a weight of 0.05 half a
bfloat16 ulp is 1.2e-4 and a step of lr=1e-5 leaves the copy unchanged. The copy then moves only
where a weight happens to sit near a rounding boundary: on SmolLM2-135M, one SFT step at lr 1e-5
changed 6% of the weights' bfloat16 values, 22% of their float16 values (3 more significant bits)
and all of their float32 values (docs/results/precision.md). The policy a run samples from and
trains is that copy, so a run whose updates are mostly below the copy's resolution learns at a
fraction of the master's pace while every other metric looks normal.

`MovedFraction` measures it on every step: before the step it keeps a strided sample of this rank's
master shards (about `SAMPLE_PER_RANK` values, a few MB), after it counts which sampled values
changed when cast to each watched dtype. The fractions are reported as `precision/moved_fraction/
<name>` (the float32 master itself, the actor's compute copy and the engine's weights); `stalled_note`
turns a copy's that is low against the master's into the console line that names the fix.
"""

from __future__ import annotations

import torch

from hybridflow.output import console
from hybridflow.training.fsdp import all_reduce_sum

SAMPLE_PER_RANK = 1 << 20  # values sampled from this rank's shards: a 4 MB float32 snapshot per step


def moved_mask(before: torch.Tensor, after: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """True where an element of `after` differs from `before` once both are cast to `dtype` (round to
    nearest, as FSDP2's mixed precision and the weight sync cast). `before`, `after`: master values
    of the same elements, same shape, any float dtype."""
    return before.to(dtype) != after.to(dtype)


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter (an FSDP2 DTensor's local tensor), flattened."""
    local = param.to_local() if hasattr(param, "to_local") else param
    return local.detach().reshape(-1)


class MovedFraction:
    """The share of sampled trainable weights whose value in each watched dtype an update changes.

    `watched`: {name: dtype}, e.g. {"actor": torch.bfloat16, "engine": torch.bfloat16}. Usage: `before()`
    ahead of the optimizer steps, `after()` once they ran: {name: (changed, sampled)} on this rank
    (the caller sums them over ranks)."""

    def __init__(self, params: list[torch.Tensor], watched: dict[str, torch.dtype]) -> None:
        self.params, self.watched = params, watched
        total = sum(_local(p).numel() for p in params)
        self.stride = max(1, total // SAMPLE_PER_RANK)
        self._before: list[torch.Tensor] | None = None

    def _sample(self) -> list[torch.Tensor]:
        return [_local(p)[:: self.stride].clone() for p in self.params]

    def before(self) -> None:
        self._before = self._sample()

    def after(self) -> dict[str, tuple[int, int]]:
        if self._before is None:
            raise RuntimeError("MovedFraction.after() without before(): call before() ahead of the update")
        out = {}
        now = self._sample()
        sampled = sum(b.numel() for b in self._before)
        for name, dtype in self.watched.items():  # one read from the device per dtype, not per parameter
            changed = torch.stack([moved_mask(b, a, dtype).sum() for b, a in zip(self._before, now)]).sum()
            out[name] = (int(changed), sampled)
        self._before = None
        return out


def stalled_note(fractions: dict[str, float], dtypes: dict[str, str], lr: float, threshold: float) -> str | None:
    """The console line for a step whose update changed under `threshold` of the weights that it moved
    in the float32 master (`fractions["master"]`) as the engine or the actor computes with them, or None
    (also when the master itself hardly moved: no gradient, nothing to round away). `fractions`:
    {name: moved fraction}, with "master"; `dtypes`: {name: dtype name} of the copies."""
    master = fractions.get("master", 0.0)
    if master < 0.01:
        return None
    low = {n: f for n, f in fractions.items() if n != "master" and f < threshold * master}
    if not low:
        return None
    parts = ", ".join(f"{fractions[n]:.1%} of the {n}'s {dtypes[n]} weights" for n in low)
    coarse = sorted({dtypes[n] for n in low})
    fix = ("model.dtype=float16 rollout.dtype=float16 (8x finer, loss-scaled), or float32" if "bfloat16" in coarse
           else "model.dtype=float32 rollout.dtype=float32, or a larger actor.optim.lr")
    return (f"hybridflow: this step's update changed only {parts} (of the float32 master weights: {master:.1%}); "
            f"updates of lr={lr:g} are mostly below {'/'.join(coarse)}'s resolution, so the policy learns at a "
            f"fraction of the master's pace. Fix: {fix}; precision/moved_fraction/* shows it every step "
            f"(docs/recipes.md, \"Precision\"; trainer.warn_moved_fraction={threshold:g})")


class StallNote:
    """Says `stalled_note`'s line on the console once a run, at the first step whose metrics call for it."""

    def __init__(self, threshold: float | None, dtypes: dict[str, str], lr: float) -> None:
        self.threshold, self.dtypes, self.lr = threshold, dtypes, lr
        self.said = False

    @classmethod
    def from_config(cls, config) -> StallNote:
        """`trainer.warn_moved_fraction`, the actor's and the engine's dtypes and `actor.optim.lr` of a
        HybridFlowConfig."""
        return cls(config.trainer.warn_moved_fraction,
                   {"actor": config.model.dtype.value, "engine": config.rollout.dtype.value}, config.actor.optim.lr)

    def check(self, metrics: dict[str, float]) -> None:
        if self.said or self.threshold is None:
            return
        fractions = {name: metrics[f"precision/moved_fraction/{name}"] for name in ("master", "actor", "engine")
                     if f"precision/moved_fraction/{name}" in metrics}
        note = stalled_note(fractions, self.dtypes, self.lr, self.threshold) if fractions else None
        if note:
            console.say(note)
            self.said = True


def precision_stats(moved: MovedFraction | None, loss_scale) -> dict[str, float]:
    """Collective, after a step's updates: the share of the weights they moved in each watched dtype
    (`precision/moved_fraction/<name>`, over every rank's sample; none without `moved`), and with float16
    the loss scale and the overflows retried so far (`precision/loss_scale`, `precision/overflow_retries`;
    `loss_scale`: a hybridflow.training.loss_scale.LossScale)."""
    stats = {}
    if moved is not None:
        for name, (changed, sampled) in moved.after().items():
            stats[f"precision/moved_fraction/{name}"] = all_reduce_sum(changed) / max(1.0, all_reduce_sum(sampled))
    if loss_scale.enabled:
        stats["precision/loss_scale"] = loss_scale.scale
        stats["precision/overflow_retries"] = float(loss_scale.overflows)
    return stats
