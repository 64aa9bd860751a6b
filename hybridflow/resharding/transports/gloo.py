"""The gloo transport: the rollout runs on a pool of its own, and weights cross over a gloo group.

A disaggregated sync needs a collective group that spans two pools whose processes already
have their own default group (FSDP's on one side, vLLM's on the other). `join_group` builds
one beside them: a TCPStore rendezvous on training rank 0's host and a `ProcessGroupGloo` over
it, which is not the default group, so FSDP and vLLM are unaffected. Transfer rank 0 is training
rank 0; generation rank r is transfer rank r + 1. Every operation waits with the group's
timeout, and a failure is re-raised naming what was being moved and to or from which rank.

Sending: per bucket, every training rank first gathers the bucket's whole tensors (FSDP's
all-gathers end before any cross-pool send starts: interleaving the two is what deadlocks),
then training rank 0 sends each generation rank one flat buffer with only the boxes that rank
needs (flat.py). A rollout rank at TP 2 receives about half the model, not all of it.

Receiving: each generation rank receives its buffer per bucket inside vLLM's update session
(`receive_bucket`), or, at trainer.max_staleness >= 2, into host memory while the engine
generates (`stage_bucket`), loaded between two batches later (receiver.py). On GPUs the same
path runs through host memory.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from hybridflow.resharding import faults
from hybridflow.resharding.layout import Box
from hybridflow.resharding.transports import Transport, register_transport
from hybridflow.resharding.transports.flat import TransferError, pack, unpack


@register_transport
class Gloo(Transport):
    name = "gloo"
    gathers_whole = True
    supports_staging = True

    @classmethod
    def serves(cls, colocated: bool, device: str) -> bool:
        return not colocated

    # ---- controller side ------------------------------------------------------------------
    def rendezvous(self, actor) -> tuple[str, int]:
        import ray

        return tuple(ray.get(actor.hosts[0].rendezvous_address.remote()))

    def setup_calls(self, actor, rollout, plan) -> list:
        return [actor.setup_weight_sender.remote(plan), rollout.join_weight_sync.remote(plan)]

    def sync_calls(self, actor, rollout) -> list:
        return [actor.send_weights.remote(), rollout.receive_weights.remote()]

    def per_rank(self, results: list) -> list[dict]:
        return results[1]  # the rollout ranks' own statistics

    # ---- sending route ------------------------------------------------------------------------
    def connect(self, sender):
        """Training rank 0 opens the transfer group (rollout ranks join from their side)."""
        if sender.rank != 0:
            return None
        return join_group(sender.plan.master_addr, sender.plan.master_port, 0, 1 + len(sender.needs),
                          sender.plan.timeout_s)

    def send(self, sender, stats: dict, group_name: str) -> None:
        for index, bucket in sender.whole_buckets():  # every rank: the bucket's FSDP gathers end here
            if sender.rank != 0:
                continue
            names, tensors = [n for n, _ in bucket], [t for _, t in bucket]
            faults.before_sending(index)
            for dst, need in enumerate(sender.needs):
                flat = pack(tensors, [need[n] for n in names], sender.dtype)
                send_flat(sender.link, flat, dst + 1, what=f"bucket {index + 1}/{len(sender.buckets)}")

    # ---- receiving route ----------------------------------------------------------------------
    def receiving_init(self, plan, rank: int) -> dict:
        return {"master_addr": plan.master_addr, "master_port": plan.master_port, "rank": rank + 1,
                "world_size": 1 + len(plan.needs), "timeout_s": plan.timeout_s}

    def receiving_updates(self, plan, rank: int) -> list[dict]:
        need = plan.needs[rank]
        return [{"bucket": i, "names": names, "shapes": [plan.shapes[n] for n in names],
                 "boxes": [need[n] for n in names], "dtype": plan.dtype, "route": self}
                for i, names in enumerate(plan.buckets)]

    def open_receiving(self, info):
        return join_group(info.master_addr, info.master_port, info.rank, info.world_size, info.timeout_s)

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
        flat = self._receive_flat(engine, info)
        return unpack(flat, info.names, info.shapes, [Box.of(b) for b in info.boxes], flat.dtype)

    def _receive_flat(self, engine, info):
        numel = sum(Box.of(b).numel for b in info.boxes)
        flat = recv_flat(engine.link, numel, getattr(torch, info.dtype), src=0, what=f"bucket {info.bucket}")
        faults.apply_to_bucket(info.bucket, flat)
        return flat


class _Group:
    """A gloo group and the store it was built on (the store must live as long as the group)."""

    def __init__(self, group, store) -> None:
        self.group, self.store = group, store

    def send(self, tensors, dst: int, tag: int):
        return self.group.send(tensors, dst, tag)

    def recv(self, tensors, src: int, tag: int):
        return self.group.recv(tensors, src, tag)


def join_group(master_addr: str, master_port: int, rank: int, world_size: int, timeout_s: float) -> _Group:
    """A gloo group of `world_size` processes (rank 0 hosts the rendezvous store)."""
    timeout = timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(master_addr, master_port, world_size, is_master=rank == 0, timeout=timeout,
                              wait_for_workers=False)
        group = dist.ProcessGroupGloo(dist.PrefixStore("hybridflow-weight-sync", store), rank, world_size, timeout)
    except Exception as exc:
        raise TransferError(f"weight-sync group rendezvous at {master_addr}:{master_port} failed for rank {rank} of "
                            f"{world_size} within {timeout_s:.0f} s: {exc}") from exc
    return _Group(group, store)


def send_flat(group, flat: torch.Tensor, dst: int, what: str) -> None:
    try:
        group.send([flat], dst, 0).wait()
    except Exception as exc:
        raise TransferError(f"weight sync: sending {what} ({flat.numel() * flat.element_size()} bytes) to transfer "
                            f"rank {dst} failed: {exc}") from exc


def recv_flat(group, numel: int, dtype: torch.dtype, src: int, what: str) -> torch.Tensor:
    flat = torch.empty(numel, dtype=dtype)
    try:
        group.recv([flat], src, 0).wait()
    except Exception as exc:
        raise TransferError(f"weight sync: receiving {what} ({numel} elements) from transfer rank {src} failed: "
                            f"{exc}") from exc
    return flat
