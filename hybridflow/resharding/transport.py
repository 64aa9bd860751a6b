"""Moving flat buffers between processes: the cross-pool group, send/recv with deadlines, packing.

A disaggregated sync needs a collective group that spans two pools whose processes already
have their own default group (FSDP's on one side, vLLM's on the other). `join_group` builds
one beside them: a TCPStore rendezvous and a `ProcessGroupGloo` over it, which is not the
default group, so FSDP and vLLM are unaffected. Every operation waits with the group's
timeout, and a failure is re-raised naming what was being moved and to or from which rank.

A bucket travels as one flat buffer per destination: the needed box of each tensor, flattened
and concatenated in bucket order (`pack`), and cut back into full-shape tensors on arrival
(`unpack`), where only the received box is filled — vLLM's loaders read no other part.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

from hybridflow.resharding.layout import Box


class TransferError(RuntimeError):
    """A send or receive of the weight sync failed or timed out."""


class _Group:
    """A gloo group and the store it was built on (the store must live as long as the group)."""

    def __init__(self, group, store) -> None:
        self.group, self.store = group, store

    def send(self, tensors, dst: int, tag: int):
        return self.group.send(tensors, dst, tag)

    def recv(self, tensors, src: int, tag: int):
        return self.group.recv(tensors, src, tag)


def join_group(master_addr: str, master_port: int, rank: int, world_size: int, timeout_s: float):
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


def pack(tensors: Sequence[torch.Tensor], boxes: Sequence[Box], dtype: torch.dtype) -> torch.Tensor:
    """The `boxes` of full-shape `tensors`, flattened and concatenated, in `dtype`."""
    total = sum(b.numel for b in boxes)
    flat = torch.empty(total, dtype=dtype)
    offset = 0
    for tensor, box in zip(tensors, boxes):
        n = box.numel
        flat[offset:offset + n].view(box.shape).copy_(tensor[box.slices()])
        offset += n
    return flat


def unpack(flat: torch.Tensor, names: Sequence[str], shapes: Sequence[Sequence[int]], boxes: Sequence[Box],
           dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """Full-shape tensors with only their box filled from `flat` (the inverse of `pack`).

    A box that is the whole tensor is returned as a view of `flat`, without a copy."""
    out, offset = [], 0
    for name, shape, box in zip(names, shapes, boxes):
        n = box.numel
        piece = flat[offset:offset + n].view(box.shape)
        offset += n
        if box == Box.whole(shape):
            out.append((name, piece))
            continue
        full = torch.empty(tuple(shape), dtype=dtype)
        full[box.slices()].copy_(piece)
        out.append((name, full))
    if offset != flat.numel():
        raise TransferError(f"weight sync: a bucket of {flat.numel()} elements held {offset} for {list(names)}")
    return out
