"""Moving the actor's weights from the training layout to the generation layout.

- `layout`: which part of each tensor a rank holds and needs, the plan, the layout minimum.
- `source`, `sender` / `receiver`: the training and generation ends, which workers delegate to: the
  source is a training rank's end (shapes, sender, adapter, checksums), its sender produces the
  buckets, the receiver loads them into the engine (vLLM's lives with the vLLM engine:
  workers/rollout/vllm/).
- `transports/`: how the bytes move, one module per transport with both ends (`colocated`,
  `broadcast`), the registry `build_transport` chooses from, and flat-buffer packing (`flat`).
- `sync`: `WeightSync`, the controller's one object and one call per step.
- `verify`: checksums compared across layouts.

docs/resharding.md has the picture of who sends what to whom.
"""

from hybridflow.resharding.verify import WeightSyncError

__all__ = ["WeightSyncError"]
