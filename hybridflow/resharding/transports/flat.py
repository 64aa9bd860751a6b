"""Flat buffers, for a transport that moves each bucket as one buffer per destination.

A bucket travels as the needed box of each tensor, flattened and concatenated in bucket order
(`pack`), and is cut back into full-shape tensors on arrival (`unpack`), where only the received
box is filled — vLLM's loaders read no other part.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hybridflow.resharding.layout import Box


class TransferError(RuntimeError):
    """A send or receive of the weight sync failed or timed out."""


def pack(tensors: Sequence[torch.Tensor], boxes: Sequence[Box], dtype: torch.dtype,
         device: torch.device | str = "cpu") -> torch.Tensor:
    """The `boxes` of full-shape `tensors`, flattened and concatenated, in `dtype`, on `device`."""
    total = sum(b.numel for b in boxes)
    flat = torch.empty(total, dtype=dtype, device=device)
    offset = 0
    for tensor, box in zip(tensors, boxes):
        n = box.numel
        flat[offset:offset + n].view(box.shape).copy_(tensor[box.slices()])
        offset += n
    return flat


def unpack(flat: torch.Tensor, names: Sequence[str], shapes: Sequence[Sequence[int]], boxes: Sequence[Box],
           dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """Full-shape tensors with only their box filled from `flat` (the inverse of `pack`).

    A box that is the whole tensor is returned as a view of `flat`, without a copy; the rest on
    `flat`'s device."""
    out, offset = [], 0
    for name, shape, box in zip(names, shapes, boxes):
        n = box.numel
        piece = flat[offset:offset + n].view(box.shape)
        offset += n
        if box == Box.whole(shape):
            out.append((name, piece))
            continue
        full = torch.empty(tuple(shape), dtype=dtype, device=flat.device)
        full[box.slices()].copy_(piece)
        out.append((name, full))
    if offset != flat.numel():
        raise TransferError(f"weight sync: a bucket of {flat.numel()} elements held {offset} for {list(names)}")
    return out
