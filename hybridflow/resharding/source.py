"""One training rank's end of the weight path: what a trainable worker's weight methods delegate to.

`WeightSource` wraps one rank's FSDP2 model (the actor's; nothing here knows the role) and answers
every call the weight sync (`sync.WeightSync` and its transports) makes on the training side: the
full shapes the plan is built from, the sender built from the controller's `SyncPlan`
(`sender.WeightSender`, which produces the buckets), one sync, the checksums each generation rank
compares, and, with weight_sync.lora=adapter, the LoRA adapter and its live checksums
(`adapter.py`). The worker keeps its registered methods, so the controller calls them by name.
"""

from __future__ import annotations

import torch


class WeightSource:
    def __init__(self, model: torch.nn.Module, rank: int, world_size: int) -> None:
        self.model, self.rank, self.world_size = model, rank, world_size
        self.sender = None  # built by connect

    def shapes(self) -> dict[str, list[int]]:
        """Checkpoint name -> full shape of every weight the rollout receives."""
        from hybridflow.resharding.weights import checkpoint_shapes

        return checkpoint_shapes(self.model)

    def connect(self, plan) -> None:
        """Build this rank's sender from the controller's `SyncPlan` (opens the transfer group if any)."""
        from hybridflow.resharding.sender import WeightSender

        self.sender = WeightSender(self.model, plan, self.rank, self.world_size)
        self.sender.connect()

    def send(self, engine=None) -> dict[str, float]:
        """Collective: move the current weights to the rollout (see hybridflow.resharding.sender);
        `engine`: the rollout engine of this process, a colocated route's end (None: there is none)."""
        return self.sender.send(engine)

    def checksums(self) -> list[dict[str, tuple[float, float]]]:
        """Collective: per rollout rank, checksums of the part of every tensor it needs."""
        return self.sender.checksums()

    def adapter(self, dtype: str) -> dict | None:
        """Collective: the LoRA adapter for the rollout, from rank 0 (adapter.adapter_payload): factors
        in `dtype`, config, checksums."""
        from hybridflow.resharding import faults
        from hybridflow.resharding.adapter import adapter_payload

        return faults.before_sending_adapter(adapter_payload(self.model, self.rank, dtype))

    def adapter_checksums(self, dtype: str) -> dict | None:
        """Collective: rank 0's checksums of the live LoRA weights, as the adapter must hold them
        (adapter.live_adapter_checksums); the others None."""
        from hybridflow.resharding.adapter import live_adapter_checksums

        return live_adapter_checksums(self.model, self.rank, dtype)
