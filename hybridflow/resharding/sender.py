"""The training side of a weight sync: what the actor delegates `send_weights` to.

`WeightSender` produces the buckets, in parameter order, from the plan
(`hybridflow.resharding.layout`): this rank's FSDP2 shard of each tensor (`shard_buckets`, with
the pieces each generation rank needs of it planned once), or whole tensors, gathered on every
rank (`whole_buckets`: a LoRA model is folded first, and a transport that sends from one rank
needs them). How they travel is the plan's transport's business (transports/): `send` opens
nothing and moves nothing itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridflow.resharding.layout import Box, fsdp_box, plan_pieces
from hybridflow.resharding.verify import WeightSyncError
from hybridflow.resharding.weights import checkpoint_shapes, full_weights, is_peft, local_shard


@dataclass(frozen=True)
class SyncPlan:
    """What the controller tells every training rank about the sync (built from config and placement)."""

    transport: Any  # a hybridflow.resharding.transports.Transport
    dtype: str  # the rollout's weight dtype: tensors are cast before they travel
    bucket_bytes: int
    timeout_s: float
    needs: list = field(default_factory=list)  # per generation rank: {checkpoint name: box ranges}
    master_addr: str = ""  # broadcast: the transfer groups' rendezvous (training rank 0's host)
    master_port: int = 0
    buckets: list = field(default_factory=list)  # checkpoint names per bucket, in parameter order
    shapes: dict = field(default_factory=dict)  # checkpoint name -> full shape


class WeightSender:
    def __init__(self, model: torch.nn.Module, plan: SyncPlan, rank: int, world_size: int) -> None:
        self.model, self.plan, self.rank, self.world = model, plan, rank, world_size
        self.dtype = getattr(torch, plan.dtype)
        self.shapes = checkpoint_shapes(model)
        self.needs = [{n: Box.of(ranges) for n, ranges in need.items()} for need in plan.needs]
        self.held = [{n: fsdp_box(s, world_size, r) for n, s in self.shapes.items()} for r in range(world_size)]
        self.gathers = is_peft(model) or plan.transport.gathers_whole  # whole tensors are built on every rank
        self.buckets = plan.buckets
        self.link = None  # what the transport's `connect` opened for this rank
        self._check_plan()
        self.pieces = [] if self.gathers else [plan_pieces(names, self.held, self.needs) for names in self.buckets]

    def _check_plan(self) -> None:
        missing = [n for n in self.shapes if any(n not in need for need in self.needs)]
        if missing:
            raise WeightSyncError(f"the rollout engine did not say which part of {missing[:3]} it needs: "
                                  "the actor's and the rollout's models differ (check model.path)")
        self.plan.transport.check_plan(self)

    def connect(self) -> None:
        """Open this rank's end of the transport's route, if it has one."""
        self.link = self.plan.transport.connect(self)

    def shard_buckets(self):
        """Per bucket: (index, names, {name: this rank's FSDP2 shard in the sync dtype})."""
        _reshard(self.model)
        params = dict(self.model.named_parameters())  # not peft: parameter names are checkpoint names
        for index, names in enumerate(self.buckets):
            local = {n: local_shard(params[n]).to(self.dtype) for n in names}
            for n in names:
                if tuple(local[n].shape) != self.held[self.rank][n].shape:
                    raise WeightSyncError(f"{n}: this rank holds a shard of shape {tuple(local[n].shape)}, expected "
                                          f"{self.held[self.rank][n].shape} (FSDP2 dim-0 chunks)")
            yield index, names, local

    def whole_buckets(self):
        """Per bucket: (index, [(name, whole tensor in the sync dtype)]). A collective: every rank
        iterates every bucket (FSDP's all-gathers)."""
        weights = full_weights(self.model, self.dtype)
        for index, names in enumerate(self.buckets):
            yield index, [next(weights) for _ in names]

    def send(self, group_name: str) -> dict[str, float]:
        """One sync, by the plan's transport (`group_name`: this process's worker group, where a
        colocated receiver is found)."""
        start = time.perf_counter()
        stats = {"received_bytes": 0, "exchange_seconds": 0.0, "assemble_seconds": 0.0}
        self.plan.transport.send(self, stats, group_name)
        stats["seconds"] = time.perf_counter() - start
        return {k: float(v) for k, v in stats.items()}

    def checksums(self) -> list[dict[str, tuple[float, float]]]:
        """Per generation rank, the checksum of the box it needs of every tensor (a collective)."""
        from hybridflow.resharding.verify import checksum

        out = [{} for _ in self.needs]
        for name, tensor in full_weights(self.model, self.dtype):
            for dst, need in enumerate(self.needs):
                parts = [checksum(tensor[p.slices()]) for p in need[name].read_parts()]  # what vLLM holds
                out[dst][name] = (sum(p[0] for p in parts), sum(p[1] for p in parts))
        return out


def _reshard(model: torch.nn.Module) -> None:
    """Put every FSDP2 unit back in its sharded state. A forward pass without backward (log-probs,
    the probe) leaves the root unit's parameters gathered; the plan reads the shards."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
