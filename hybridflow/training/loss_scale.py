"""Dynamic loss scaling for float16 compute over float32 master weights.

float16 keeps 3 more significant bits than bfloat16 (so an update moves 8x more of its copy of the
weights: hybridflow/training/resolution.py) but 5 exponent bits, not 8: gradients below 6e-8 flush
to zero in the backward and values above 65,504 overflow. The backward therefore runs on the loss
times `scale`; the float32 gradients are divided by it before clipping. A non-finite gradient norm
(the norm is reduced over every rank, so all ranks agree) means the scale overflowed: the scale is
halved and the mini-batch's backward is run again, so no update is skipped or lost (PyTorch's
GradScaler skips the step instead, and decides per rank: under FSDP2 a rank's shard can overflow
where another's does not, which is why this is written here and not taken from torch.amp). After
`growth_interval` finite steps in a row the scale doubles again.

bfloat16 and float32 have float32's exponent range: no scaling (`enabled` False, scale 1).
"""

from __future__ import annotations

import math

import torch

from hybridflow.training.fsdp import clip_gradients

INITIAL_SCALE = 2.0 ** 16  # torch.amp.GradScaler's and Megatron's start; backs off within a few retries
GROWTH_INTERVAL = 200  # finite steps before the scale doubles (GradScaler: 2000; RL runs are shorter)
MIN_SCALE = 1.0


class LossScale:
    """The scale a float16 backward multiplies its loss by, and the decision after each backward."""

    def __init__(self, compute_dtype: str, initial: float = INITIAL_SCALE, growth_interval: int = GROWTH_INTERVAL
                 ) -> None:
        self.enabled = compute_dtype == "float16"
        self.scale = initial if self.enabled else 1.0
        self.growth_interval = growth_interval
        self.good_steps = 0
        self.overflows = 0  # backwards that overflowed and ran again, over the run

    def unscale_(self, grads: list[torch.Tensor]) -> None:
        """Divide the gradients by the scale, in place."""
        if self.enabled and grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def accept(self, grad_norm: float) -> bool:
        """After a backward and `unscale_`: True to step the optimizer with these gradients; False when
        a float16 backward overflowed (the scale is halved; run the backward again). A non-finite norm
        without scaling, or at the smallest scale, is the caller's to refuse (returns True)."""
        if math.isfinite(grad_norm) or not self.enabled or self.scale <= MIN_SCALE:
            if math.isfinite(grad_norm) and self.enabled:
                self.good_steps += 1
                if self.good_steps >= self.growth_interval:
                    self.scale, self.good_steps = self.scale * 2, 0
            return True
        self.scale, self.good_steps = max(MIN_SCALE, self.scale / 2), 0
        self.overflows += 1
        return False

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "overflows": self.overflows}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps, self.overflows = state["scale"], state["good_steps"], state["overflows"]


def clipped_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scale: LossScale, max_grad_norm: float,
                 refusal: str) -> float | None:
    """After a mini-batch's backwards: unscale and clip the gradients, step the optimizer; returns the
    norm before clipping. None when a float16 backward overflowed (run it again: `scale` is halved);
    a non-finite norm otherwise raises FloatingPointError with `refusal` ("gradient norm is inf at
    <refusal>")."""
    scale.unscale_([p.grad for p in model.parameters() if p.grad is not None])
    grad_norm = clip_gradients(model, max_grad_norm)
    if not scale.accept(grad_norm):
        return None
    if not math.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        if scale.enabled:  # still not finite at the smallest scale: the forward itself left float16's range
            raise FloatingPointError(
                f"gradient norm is {grad_norm} at {refusal}, or: float16 overflowed even at loss scale {scale.scale:g} "
                f"after {scale.overflows} halvings, so the model's own activations or logits pass float16's range "
                f"(65,504); compute in bfloat16 or float32 instead (model.dtype, rollout.dtype)")
        raise FloatingPointError(f"gradient norm is {grad_norm} at {refusal}")
    optimizer.step()
    return grad_norm
