"""The broadcast transport: the rollout runs on a pool of its own, and each bucket crosses once per layout.

A disaggregated sync needs collective groups that span two pools whose processes already have
their own default group (FSDP's on one side, vLLM's on the other). The generation ranks that need
the same boxes of every tensor form one *layout* (every rank at TP 1; the same tensor-parallel rank
of each engine at TP > 1), and training rank 0 and the ranks of one layout form a group of their
own: `join_group` builds it beside the default ones, over one TCPStore on training rank 0's host,
gloo on CPUs and NCCL on GPUs (the plan's device, `Transport.device`), so FSDP and vLLM are
unaffected. In a layout's group the sender is rank 0 and the layout's i-th generation rank is
rank i + 1. Every operation waits with the group's timeout, and a failure is re-raised naming what
was being moved and to which layout.

Sending: per bucket, every training rank gathers the bucket's whole tensors (FSDP's all-gathers, on
the training group), then training rank 0 packs, once per layout, one flat buffer with only the
boxes that layout needs (`WeightSender.parcels`, flat.py; on the device the tensors are on) and
broadcasts it to the layout's group. Every layout's broadcast of a bucket is posted at once, without
waiting: they run while the training ranks gather the next bucket, and the sender waits for a
bucket's broadcasts only before posting the one after next (two buckets in flight at most). So each
generation rank receives only its layout's bytes (a rank at TP 2 about half the model), the engines
of one layout receive them together (a broadcast, not one send after another), and the layouts move
side by side.

Receiving: each generation rank receives its layout's buffer per bucket inside vLLM's update
session (`receive_bucket`), or, at trainer.max_staleness >= 2, into host memory while the engine
generates (`stage_bucket`), loaded between two batches later (the engine's receiver).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from hybridflow.resharding import faults
from hybridflow.resharding.layout import Box, layouts
from hybridflow.resharding.transports.base import Transport, register_transport
from hybridflow.resharding.transports.flat import TransferError, unpack


@register_transport
class Broadcast(Transport):
    name = "broadcast"
    gathers_whole = True
    supports_staging = True

    @classmethod
    def serves(cls, colocated: bool, device: str) -> bool:
        return not colocated

    # ---- controller side ------------------------------------------------------------------
    def rendezvous(self, actor) -> tuple[str, int]:
        return tuple(actor.hosts[0].ask("rendezvous_address"))  # a Ray host's (hybridflow/controller/ray_host.py)

    def setup_calls(self, actor, rollout, plan) -> list:
        return [actor.setup_weight_sender.remote(plan), rollout.join_weight_sync.remote(plan)]

    def sync_calls(self, actor, rollout) -> list:
        return [actor.send_weights.remote(), rollout.receive_weights.remote()]

    def per_rank(self, results: list) -> list[dict]:
        return results[1]  # the rollout ranks' own statistics

    # ---- sending route ------------------------------------------------------------------------
    def connect(self, plan, rank: int):
        """Training rank 0 joins every layout's group (the rollout ranks join theirs from their side)."""
        if rank != 0:
            return None
        return [join_group(plan.master_addr, plan.master_port, 0, 1 + len(ranks), plan.timeout_s, layout, self.device,
                           hosts_store=layout == 0)
                for layout, ranks in enumerate(layouts(plan.needs))]

    def send(self, sender, link, stats: dict, engine) -> None:
        in_flight: list[list] = []  # per posted bucket: [(work, flat, what)], oldest first
        for parcels in sender.parcels():  # every rank: the bucket's FSDP gathers end here; rank 0 has parcels
            if not parcels:
                continue
            faults.before_sending(parcels[0].index)
            if len(in_flight) == 2:
                _wait(in_flight.pop(0))
            in_flight.append([(_post(link[p.layout], p.flat, p.what), p.flat, p.what) for p in parcels])
        for posted in in_flight:
            _wait(posted)

    # ---- receiving route ----------------------------------------------------------------------
    def receiving_init(self, plan, rank: int) -> dict:
        groups = layouts(plan.needs)
        layout = next(i for i, ranks in enumerate(groups) if rank in ranks)
        return {"master_addr": plan.master_addr, "master_port": plan.master_port,
                "rank": groups[layout].index(rank) + 1, "world_size": 1 + len(groups[layout]),
                "timeout_s": plan.timeout_s, "group": layout}

    def receiving_updates(self, plan, rank: int) -> list[dict]:
        need = plan.needs[rank]
        return [{"bucket": i, "names": names, "shapes": [plan.shapes[n] for n in names],
                 "boxes": [need[n] for n in names], "dtype": plan.dtype, "route": self}
                for i, names in enumerate(plan.buckets)]

    def open_receiving(self, info):
        return join_group(info.master_addr, info.master_port, info.rank, info.world_size, info.timeout_s, info.group,
                          self.device)

    def update_bytes(self, update: dict) -> int:
        size = torch.empty((), dtype=getattr(torch, update["dtype"])).element_size()
        return sum(Box.of(b).numel for b in update["boxes"]) * size

    def receive_bucket(self, engine, info) -> list:
        """This rank's boxes of one bucket, received now; or, loading weights staged earlier, those."""
        if info.weights is not None:
            return info.weights
        flat = self._receive_flat(engine, info)
        engine.received_bytes += flat.numel() * flat.element_size()
        return unpack(flat, info.names, info.shapes, [Box.of(b) for b in info.boxes], flat.dtype)

    def stage_bucket(self, engine, info) -> list:
        flat = self._receive_flat(engine, info).cpu()  # host memory: the engine may be generating
        return unpack(flat, info.names, info.shapes, [Box.of(b) for b in info.boxes], flat.dtype)

    def _receive_flat(self, engine, info):
        numel = sum(Box.of(b).numel for b in info.boxes)
        flat = torch.empty(numel, dtype=getattr(torch, info.dtype), device=_device(self.device))
        _wait([(_post(engine.link, flat, f"bucket {info.bucket + 1}"), flat, f"bucket {info.bucket + 1} "
                                                                             f"({numel} elements) from training rank 0")])
        faults.apply_to_bucket(info.bucket, flat)
        return flat


class _Group:
    """A layout's process group and the store it was built on (the store must live as long as the group)."""

    def __init__(self, group, store) -> None:
        self.group, self.store = group, store


def join_group(master_addr: str, master_port: int, rank: int, world_size: int, timeout_s: float, layout: int,
               device: str, hosts_store: bool = False) -> _Group:
    """Layout `layout`'s group (sender and that layout's generation ranks), gloo on the CPU and NCCL on
    GPUs; `hosts_store`: this process hosts the rendezvous store (training rank 0, once)."""
    timeout = timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(master_addr, master_port, is_master=hosts_store, timeout=timeout, wait_for_workers=False)
        prefixed = dist.PrefixStore(f"hybridflow-weight-sync/{layout}", store)
        if device == "cuda":
            group = dist.ProcessGroupNCCL(prefixed, rank, world_size)
        else:
            group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    except Exception as exc:
        raise TransferError(f"weight-sync group of layout {layout}: rendezvous at {master_addr}:{master_port} failed "
                            f"for rank {rank} of {world_size} within {timeout_s:.0f} s: {exc}") from exc
    return _Group(group, store)


def _device(device: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")


def _post(group: _Group, flat: torch.Tensor, what: str):
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    try:
        return group.group.broadcast([flat], opts)
    except Exception as exc:
        raise TransferError(f"weight sync: broadcasting {what} failed: {exc}") from exc


def _wait(posted: list) -> None:
    for work, _, what in posted:
        try:
            work.wait()
        except Exception as exc:
            raise TransferError(f"weight sync: broadcasting {what} failed: {exc}") from exc
