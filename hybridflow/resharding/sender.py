"""The training side of a weight sync: what the actor delegates `send_weights` to.

Two transports (transports.py: what differs between them is there), one plan
(`hybridflow.resharding.layout`):

- colocated: the generation ranks are the training ranks (same processes). Per bucket, each
  rank sends every peer the pieces of its FSDP2 shard that the peer's generation slice needs
  and it lacks, in one `all_to_all_single` over the training group, then assembles
  full-shape tensors with only its own generation slice filled (its own shard's part copied,
  the rest received) and hands them to the receiver of its own process. Bytes received per
  rank are exactly the layout minimum: zero for column-parallel tensors when the
  generation TP size equals the FSDP group, the missing quarter of each row-parallel tensor
  at TP 2, the missing half of each replicated one, half of everything at TP 1.
- gloo (disaggregated): the rollout runs on its own pool. Per bucket, every training rank
  first gathers the bucket's full tensors (FSDP's all-gathers end before any cross-pool send
  starts: interleaving the two is what deadlocks), then training rank 0 sends each rollout
  rank one flat buffer with only the boxes that rank needs, over a gloo group spanning both
  pools. A rollout rank at TP 2 receives about half the model, not all of it.

A LoRA model is folded first (the fold needs whole A and B), so its colocated sync gathers
whole tensors; it is correct but not at the layout minimum.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hybridflow.resharding import faults
from hybridflow.resharding.layout import Box, fsdp_box, numel, plan_pieces
from hybridflow.resharding.transport import TransferError, pack, send_flat
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
    master_addr: str = ""  # gloo: the transfer group's rendezvous (training rank 0's host)
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
        self.group = None
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
        self.plan.transport.connect(self)

    # ---- colocated ------------------------------------------------------------------------------

    def colocated_buckets(self, stats: dict):
        """Lazily, per bucket: [(name, full-shape tensor with this rank's generation slice filled)]."""
        if self.gathers:
            yield from self._gathered_buckets(stats)
            return
        _reshard(self.model)
        params = dict(self.model.named_parameters())  # not peft: parameter names are checkpoint names
        for index, names in enumerate(self.buckets):
            local = {n: local_shard(params[n]).to(self.dtype) for n in names}
            for n in names:
                if tuple(local[n].shape) != self.held[self.rank][n].shape:
                    raise WeightSyncError(f"{n}: this rank holds a shard of shape {tuple(local[n].shape)}, expected "
                                          f"{self.held[self.rank][n].shape} (FSDP2 dim-0 chunks)")
            yield self._exchange(index, names, local, stats)

    def _exchange(self, index: int, names: list[str], local: dict, stats: dict) -> list:
        """One bucket: send each peer what it lacks of its slice, receive what this rank lacks."""
        start = time.perf_counter()
        me, pieces = self.rank, self.pieces[index]
        send = [[] for _ in range(self.world)]
        recv_sizes = [0] * self.world
        for p in pieces:
            if p.src == me and p.dst != me:
                send[p.dst].append(local[p.name][p.box.relative_to(self.held[me][p.name]).slices()].reshape(-1))
            elif p.dst == me and p.src != me:
                recv_sizes[p.src] += p.box.numel
        send_sizes = [sum(t.numel() for t in parts) for parts in send]
        device = next(iter(local.values())).device  # the shards' device: NCCL exchanges GPU buffers
        flat_send = torch.cat([t for parts in send for t in parts]) if any(send_sizes) else \
            torch.empty(0, dtype=self.dtype, device=device)
        received = torch.empty(sum(recv_sizes), dtype=self.dtype, device=device)
        if self.world > 1:
            try:
                dist.all_to_all_single(received, flat_send, recv_sizes, send_sizes)
            except Exception as exc:
                raise TransferError(f"weight sync bucket {index + 1}/{len(self.buckets)}: the exchange between "
                                    f"training ranks failed: {exc}") from exc
        faults.apply_to_bucket(index, received)
        stats["received_bytes"] += received.numel() * received.element_size()
        stats["exchange_seconds"] += time.perf_counter() - start
        start = time.perf_counter()
        out = self._assemble(names, pieces, local, received, recv_sizes)
        stats["assemble_seconds"] += time.perf_counter() - start
        return out

    def _assemble(self, names: list[str], pieces: list, local: dict, received: torch.Tensor,
                  recv_sizes: list[int]) -> list[tuple[str, torch.Tensor]]:
        """Full-shape tensors with this rank's generation slice filled: its own part from its
        shard, the rest from `received` (laid out by source rank, in piece order)."""
        me = self.rank
        offsets = [sum(recv_sizes[:s]) for s in range(self.world)]
        out = []
        for name in names:
            need, held = self.needs[me][name], self.held[me][name]
            if need == held == Box.whole(self.shapes[name]):
                out.append((name, local[name]))  # a single rank: its shard is the whole tensor
                continue
            full = torch.empty(self.shapes[name], dtype=self.dtype, device=received.device)  # only the box is written
            for p in (p for p in pieces if p.name == name and p.dst == me):
                if p.src == me:
                    full[p.box.slices()].copy_(local[name][p.box.relative_to(held).slices()])
                else:
                    n = p.box.numel
                    full[p.box.slices()].copy_(received[offsets[p.src]:offsets[p.src] + n].view(p.box.shape))
                    offsets[p.src] += n
            out.append((name, full))
        return out

    def _gathered_buckets(self, stats: dict):
        size = torch.empty((), dtype=self.dtype).element_size()
        weights = full_weights(self.model, self.dtype)
        for names in self.buckets:
            bucket = [next(weights) for _ in names]
            for name, _ in bucket:
                whole = numel(self.shapes[name])
                stats["received_bytes"] += (whole - self.held[self.rank][name].numel) * size if self.world > 1 else 0
            yield bucket

    # ---- disaggregated ----------------------------------------------------------------------------

    def send_gloo(self) -> None:
        weights = full_weights(self.model, self.dtype)
        for index, names in enumerate(self.buckets):
            bucket = [next(weights) for _ in names]  # every rank: the bucket's FSDP gathers end here
            if self.rank != 0:
                continue
            tensors = [t for _, t in bucket]
            faults.before_sending(index)
            for dst, need in enumerate(self.needs):
                flat = pack(tensors, [need[n] for n in names], self.dtype)
                send_flat(self.group, flat, dst + 1, what=f"bucket {index + 1}/{len(self.buckets)}")

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
