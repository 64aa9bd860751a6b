"""One training rank's end of the weight path: what a trainable worker's weight methods delegate to.

`WeightSource` wraps one rank's FSDP2 model (the actor's; nothing here knows the role) and answers
every call the weight sync (`sync.WeightSync` and its transports) makes on the training side: the
full shapes the plan is built from, the sender built from the controller's `SyncPlan`
(`sender.WeightSender`, which produces the buckets), one sync, the checksums each generation rank
compares, and, with weight_sync.lora=adapter, the LoRA adapter and its live checksums
(`adapter.py`). `WeightSendingMixin` gives a trainable worker the registered methods the controller
calls by name, delegating here, and keeps the rollout engine it meets in its own process.
"""

from __future__ import annotations

import torch

from hybridflow.controller import Dispatch, peer_with, register
from hybridflow.resharding.receiver import ColocatedReceiver


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


class WeightSendingMixin:
    """A trainable worker's registered weight methods, delegating to its `self.weights` (a `WeightSource`,
    built by its start), and the rollout engine of its own process it meets when the host builds both
    (`self.colocated_engine`, which a colocated sync loads into)."""

    weights: WeightSource | None = None
    colocated_engine = None

    def meet(self, peers: list) -> None:
        """Keep the rollout engine of this process, if any (the worker that loads colocated weights): each
        weight sync hands it to the colocated transport (`send_weights`)."""
        self.colocated_engine = peer_with(peers, ColocatedReceiver)

    @register(Dispatch.RANK_ZERO)
    def weight_shapes(self) -> dict[str, list[int]]:
        """Checkpoint name -> full shape of every weight the rollout receives."""
        return self.weights.shapes()

    @register(Dispatch.ONE_TO_ALL)
    def setup_weight_sender(self, plan) -> bool:
        """Build this rank's sender from the controller's `SyncPlan` (opens the transfer group if any)."""
        self.weights.connect(plan)
        return True

    @register(Dispatch.ONE_TO_ALL)
    def send_weights(self) -> dict[str, float]:
        """Collective: move the current weights to the rollout (see hybridflow.resharding.sender); a colocated
        route loads them into the engine this actor met in its process."""
        return self.weights.send(self.colocated_engine)

    @register(Dispatch.RANK_ZERO)
    def lora_adapter(self, dtype: str) -> dict | None:
        """Collective: the LoRA adapter for the rollout, from rank 0 (weight_sync.lora=adapter;
        hybridflow.resharding.adapter.adapter_payload): factors in `dtype`, config, checksums."""
        return self.weights.adapter(dtype)

    @register(Dispatch.ONE_TO_ALL)
    def lora_checksums(self, dtype: str) -> dict | None:
        """Collective: rank 0's checksums of the live LoRA weights, as the adapter must hold them
        (hybridflow.resharding.adapter.live_adapter_checksums); the others None."""
        return self.weights.adapter_checksums(dtype)

    @register(Dispatch.ONE_TO_ALL)
    def weight_checksums(self) -> list[dict[str, tuple[float, float]]]:
        """Collective: per rollout rank, checksums of the part of every tensor it needs."""
        return self.weights.checksums()
