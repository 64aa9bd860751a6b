"""Which part of each weight a rank holds and which part it needs: the arithmetic of resharding.

Pure functions on shapes, no tensors moved. A `Box` is a rectangular region of a full
(checkpoint-shaped) tensor, one `[start, stop)` range per dimension. The training side holds
FSDP2 shards: `torch.chunk` pieces along dim 0. The generation side needs the region vLLM's
loader narrows a checkpoint tensor to for its tensor-parallel rank: rows for column-parallel
layers and the vocab-parallel embedding, columns for row-parallel layers, everything for
replicated tensors (norms). A rank must receive what it needs and does not hold; the layout
minimum is the size of that difference, summed over tensors.

`plan_pieces` turns "who holds what" and "who needs what" into the pieces each rank sends to
each other rank; every needed element comes from exactly one holder, so nothing is sent twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

Range = tuple[int, int]


@dataclass(frozen=True)
class Box:
    """A region `[start, stop)` per dimension of a tensor of known full shape.

    `parts`, when given, are the disjoint boxes inside it that a rank really reads (a fused
    tensor's q, k and v rows): the box is what travels, the parts are what the layout minimum
    and the checksums count. Empty: the box itself is read."""

    ranges: tuple[Range, ...]
    parts: tuple["Box", ...] = field(default=(), compare=False)

    @staticmethod
    def of(ranges) -> "Box":
        """A box from ranges as they travel between processes (lists or tuples), or from
        `{"box": ranges, "parts": [ranges, ...]}` (`Box.travelling`)."""
        if isinstance(ranges, dict):
            return Box(Box.of(ranges["box"]).ranges, tuple(Box.of(p) for p in ranges["parts"]))
        return Box(tuple((int(a), int(b)) for a, b in ranges))

    def travelling(self):
        """This box as it travels between processes (`Box.of` reads it back)."""
        return {"box": self.ranges, "parts": [p.ranges for p in self.parts]} if self.parts else self.ranges

    def read_parts(self) -> tuple["Box", ...]:
        return self.parts or (self,)

    @property
    def read_numel(self) -> int:
        """Elements really read: the parts' (disjoint), else the whole box's."""
        return sum(p.numel for p in self.read_parts())

    @staticmethod
    def whole(shape: Sequence[int]) -> "Box":
        return Box(tuple((0, int(n)) for n in shape))

    @staticmethod
    def along(shape: Sequence[int], dim: int, start: int, stop: int) -> "Box":
        """The whole tensor except `[start, stop)` along `dim`."""
        ranges = [(0, int(n)) for n in shape]
        ranges[dim] = (int(start), int(stop))
        return Box(tuple(ranges))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(max(0, b - a) for a, b in self.ranges)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def intersect(self, other: "Box") -> "Box":
        if len(self.ranges) != len(other.ranges):
            raise ValueError(f"boxes of different rank: {self.ranges} and {other.ranges}")
        return Box(tuple((max(a0, b0), max(max(a0, b0), min(a1, b1)))
                         for (a0, a1), (b0, b1) in zip(self.ranges, other.ranges)))

    def relative_to(self, outer: "Box") -> "Box":
        """This box in the coordinates of `outer` (which must contain it)."""
        return Box(tuple((a - o, b - o) for (a, b), (o, _) in zip(self.ranges, outer.ranges)))

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(a, b) for a, b in self.ranges)


def fsdp_box(shape: Sequence[int], world_size: int, rank: int) -> Box:
    """The part of a tensor FSDP2 places on `rank`: `torch.chunk(world_size, dim=0)[rank]`.

    torch.chunk makes chunks of ceil(n / world) rows; trailing ranks may get fewer or none.
    A 0-d tensor is held whole by every rank.
    """
    if not shape:
        return Box(())
    rows = int(shape[0])
    size = -(-rows // world_size)
    start = min(rank * size, rows)
    return Box.along(shape, 0, start, min(start + size, rows))


@dataclass(frozen=True)
class Piece:
    """`box` of tensor `name` travels from rank `src` to rank `dst` (`src == dst`: a local copy)."""

    name: str
    src: int
    dst: int
    box: Box


def plan_pieces(names: Sequence[str], held: Sequence[Mapping[str, Box]], needed: Sequence[Mapping[str, Box]]
                ) -> list[Piece]:
    """Every (name, holder -> needer) piece, in `names` order, then by destination and source.

    `held[r][name]`: what sending rank r holds (the holders' boxes must not overlap);
    `needed[d][name]`: what receiving rank d needs. Each needed element comes from the one
    rank holding it; an element needed but held by nobody raises.
    """
    pieces = []
    for name in names:
        for dst, needs in enumerate(needed):
            want = needs[name]
            covered = 0
            for src, holds in enumerate(held):
                part = want.intersect(holds[name])
                if part.numel:
                    pieces.append(Piece(name, src, dst, part))
                    covered += part.numel
            if covered != want.numel:
                raise ValueError(f"{name}: rank {dst} needs {want.ranges} but the holders cover only "
                                 f"{covered} of its {want.numel} elements")
    return pieces


def numel(shape: Sequence[int]) -> int:
    return math.prod(int(n) for n in shape)


def layout_minimum(shapes: Mapping[str, Sequence[int]], needed: Sequence[Mapping[str, Box]],
                   held_by_receiver: Sequence[Mapping[str, Box]] | None, element_size: int) -> list[int]:
    """Bytes each receiving rank must get, whatever the transport: what it reads minus what it
    already holds (`held_by_receiver`, colocated only; None when the receiver holds nothing).
    Where a rank is sent a larger box than it reads (`Box.parts`), the transport moves more."""
    out = []
    for rank, needs in enumerate(needed):
        total = 0
        for name in shapes:
            for part in needs[name].read_parts():  # what the rank reads, not the box that travels
                own = part.numel
                if held_by_receiver is not None:
                    own -= part.intersect(held_by_receiver[rank][name]).numel
                total += own
        out.append(total * element_size)
    return out


def buckets(names: Sequence[str], sizes_bytes: Mapping[str, int], bucket_bytes: int) -> list[list[str]]:
    """Consecutive names grouped so each group's bytes stay within `bucket_bytes` (a tensor larger
    than a bucket travels alone)."""
    out: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name in names:
        size = sizes_bytes[name]
        if current and used + size > bucket_bytes:
            out.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    if current:
        out.append(current)
    return out


def layouts(needs: list[dict]) -> list[list[int]]:
    """The generation ranks grouped by what they need (`needs`: per rank, {name: Box or its ranges}),
    in order of each layout's first rank: the ranks of one layout receive the same bytes."""
    groups: dict[tuple, list[int]] = {}
    for rank, need in enumerate(needs):
        key = tuple(sorted((name, (box if isinstance(box, Box) else Box.of(box)).ranges) for name, box in need.items()))
        groups.setdefault(key, []).append(rank)
    return list(groups.values())
