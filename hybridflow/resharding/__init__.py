"""Moving the actor's weights from the training layout to the generation layout.

- `layout`: which part of each tensor a rank holds and needs, the plan, the layout minimum.
- `sender` / `receiver`: the training and generation ends, which workers delegate to.
- `vllm_side`: our engine in vLLM's weight-transfer framework, and what vLLM's loaders read.
- `transport`: the cross-pool gloo group and flat-buffer packing.
- `sync`: `WeightSync`, the controller's one object and one call per step.
- `verify`: checksums compared across layouts.

docs/resharding.md has the picture of who sends what to whom.
"""

from hybridflow.resharding.verify import WeightSyncError

__all__ = ["WeightSyncError"]
