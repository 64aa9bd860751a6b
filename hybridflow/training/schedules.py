"""Learning-rate schedules as pure functions: the multiplier of the base lr at an optimizer step.

`lr_factor` is what `build_optimizer` hands to `LambdaLR`; it is a plain function of the step
so that a schedule can be checked by hand (tests/unit/test_schedules.py) and plotted.

Warmup-stable-decay (WSD; MiniCPM, "Scaling Laws and Compute-Optimal Training Beyond Fixed
Training Durations"): linear warmup, a long constant phase, then a short linear decay to
`min_lr_ratio` over the last `decay_steps` steps of the schedule. The stable phase is the
setting in which "Model Merging in Pre-training" (arXiv 2505.12082) measures PMA: its
checkpoints are merged, and the decay phase is what a merge is compared against.
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "cosine", "wsd")


def lr_factor(step: int, *, schedule: str, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0,
              decay_steps: int = 0) -> float:
    """The lr multiplier in [min_lr_ratio, 1] after `step` optimizer steps (0 before the first).

    warmup (all schedules): (step + 1) / warmup_steps for step < warmup_steps, so the first
        update already has a non-zero lr.
    constant: 1 after warmup.
    cosine: min + (1 - min) * (1 + cos(pi * p)) / 2, p = (step - warmup) / (total - warmup), capped at 1.
    wsd: 1 until total_steps - decay_steps, then linear to min_lr_ratio at total_steps:
        min + (1 - min) * (total - step) / decay_steps, and min_lr_ratio from there on.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"lr schedule {schedule!r}: one of {list(SCHEDULES)}")
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    decay_start = total_steps - decay_steps
    if step < decay_start:
        return 1.0
    remaining = max(0, total_steps - step)  # steps left until the schedule's end
    return min_lr_ratio + (1 - min_lr_ratio) * remaining / max(1, decay_steps)
