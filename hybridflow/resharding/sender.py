"""The training side of a weight sync: what the actor delegates `send_weights` to.

`WeightSender` owns everything a sync knows about the two layouts: which part of each tensor
every training rank holds (FSDP2 dim-0 shards) and every generation rank needs (the plan's
`needs`), the pieces that move between them (`layout.plan_pieces`, planned once), the layouts
that receive the same bytes, and whether whole tensors are gathered first (a LoRA model is folded,
which needs whole A and B; a transport that sends from one rank needs them). It hands a transport
(transports/) only what travels, in one of two shapes:

- `parcels()`: per bucket, on training rank 0, one flat buffer per layout of the generation
  ranks with only the boxes that layout needs — for a route that sends from one rank (broadcast);
- `local_slices(exchange)`: per bucket, full-shape tensors with this rank's own generation slice
  filled, the missing pieces moved by the transport's `exchange` collective among the training
  ranks — for a route whose generation ranks are the training ranks (colocated).

So a transport moves bytes and never reads the layouts; `send` opens nothing and moves nothing itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from hybridflow.resharding import faults
from hybridflow.resharding.layout import Box, fsdp_box, layouts, numel, plan_pieces
from hybridflow.resharding.transports.flat import pack
from hybridflow.resharding.verify import WeightSyncError
from hybridflow.resharding.weights import checkpoint_shapes, full_weights, is_peft, local_shard

Bucket = list[tuple[str, torch.Tensor]]  # (checkpoint name, full-shape tensor), in parameter order
# a transport's collective among the training ranks: (flat send buffer, elements to each rank, elements
# from each rank, what is moved) -> the received buffer, laid out by source rank
Exchange = Callable[[torch.Tensor, list[int], list[int], str], torch.Tensor]


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


@dataclass(frozen=True)
class Parcel:
    """One bucket's boxes for the generation ranks of one layout, flattened in bucket order (flat.pack)."""

    index: int  # the bucket's
    layout: int
    ranks: list[int]  # the generation ranks that receive it
    flat: torch.Tensor
    what: str  # for errors: the bucket, its bytes and where it goes


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
        self.plan.transport.check_plan(self.plan, self.world)

    def connect(self) -> None:
        """Open this rank's end of the transport's route, if it has one."""
        self.link = self.plan.transport.connect(self.plan, self.rank)

    def send(self, engine=None) -> dict[str, float]:
        """One sync, by the plan's transport (`engine`: the rollout engine of this process, which a
        colocated route loads into; None when the actor met none)."""
        start = time.perf_counter()
        stats = {"received_bytes": 0, "exchange_seconds": 0.0, "assemble_seconds": 0.0}
        self.plan.transport.send(self, self.link, stats, engine)
        stats["seconds"] = time.perf_counter() - start
        return {k: float(v) for k, v in stats.items()}

    # ---- what a transport is handed ---------------------------------------------------------
    def parcels(self) -> Iterator[list[Parcel]]:
        """Per bucket, this rank's parcels: on training rank 0 one per layout of the generation ranks,
        elsewhere none. A collective: every rank iterates every bucket (FSDP's all-gathers)."""
        groups = layouts(self.needs)
        for index, bucket in self.whole_buckets():
            if self.rank != 0:
                yield []
                continue
            names, tensors = [n for n, _ in bucket], [t for _, t in bucket]
            out = []
            for layout, ranks in enumerate(groups):
                need = self.needs[ranks[0]]
                flat = pack(tensors, [need[n] for n in names], self.dtype, device=tensors[0].device)
                what = (f"bucket {index + 1}/{len(self.buckets)} ({flat.numel() * flat.element_size()} bytes) to "
                        f"layout {layout} (generation ranks {ranks})")
                out.append(Parcel(index, layout, ranks, flat, what))
            yield out

    def local_slices(self, exchange: Exchange, stats: dict) -> Iterator[Bucket]:
        """Per bucket, full-shape tensors with this rank's generation slice filled (the rest is not
        read); `exchange` moves what this rank lacks. Bytes received per rank are the layout minimum,
        except for a LoRA model (whole tensors, folded: what each rank lacked of them counts)."""
        if self.gathers:
            yield from self._counted(stats)
            return
        for index, names, local in self.shard_buckets():
            yield self._exchange(index, names, local, exchange, stats)

    # ---- the buckets ------------------------------------------------------------------------
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

    def _counted(self, stats: dict) -> Iterator[Bucket]:
        size = torch.empty((), dtype=self.dtype).element_size()
        for _, bucket in self.whole_buckets():
            for name, _ in bucket:
                lacked = numel(self.shapes[name]) - self.held[self.rank][name].numel
                stats["received_bytes"] += lacked * size if self.world > 1 else 0
            yield bucket

    def _exchange(self, index: int, names: list[str], local: dict, exchange: Exchange, stats: dict) -> Bucket:
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
        received = exchange(flat_send, send_sizes, recv_sizes, f"weight sync bucket {index + 1}/{len(self.buckets)}")
        faults.apply_to_bucket(index, received)
        stats["received_bytes"] += received.numel() * received.element_size()
        stats["exchange_seconds"] += time.perf_counter() - start
        start = time.perf_counter()
        out = self._assemble(names, pieces, local, received, recv_sizes)
        stats["assemble_seconds"] += time.perf_counter() - start
        return out

    def _assemble(self, names: list[str], pieces: list, local: dict, received: torch.Tensor,
                  recv_sizes: list[int]) -> Bucket:
        """Full-shape tensors with this rank's generation slice filled: its own part from its shard,
        the rest from `received` (laid out by source rank, in piece order)."""
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
