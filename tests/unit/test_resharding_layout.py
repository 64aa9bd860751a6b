"""The resharding arithmetic against hand-worked examples, and the packing round trip."""

from __future__ import annotations

import random

import pytest
import torch

from hybridflow.resharding.layout import Box, buckets, fsdp_box, layout_minimum, plan_pieces
from hybridflow.resharding.transports.flat import pack, unpack


def test_fsdp_box_follows_torch_chunk_including_uneven_and_empty_ranks():
    # torch.chunk(5 rows, 2) -> 3 + 2; torch.chunk(2 rows, 4) -> 1 + 1 + 0 + 0
    assert [fsdp_box((5, 3), 2, r).ranges for r in range(2)] == [((0, 3), (0, 3)), ((3, 5), (0, 3))]
    assert [fsdp_box((2,), 4, r).shape for r in range(4)] == [(1,), (1,), (0,), (0,)]
    for rows, world in [(7, 3), (97, 2), (1, 2), (8, 4)]:
        sizes = [c.shape[0] for c in torch.empty(rows).chunk(world)] + [0] * world
        assert [fsdp_box((rows,), world, r).shape[0] for r in range(world)] == sizes[:world]


def test_layout_minimum_by_hand_for_fsdp2_to_tp2_on_the_same_ranks():
    """A (4, 4) row-parallel weight (vLLM splits columns) and a (4,) norm (replicated) on 2 ranks.

    Rank r holds rows [2r, 2r+2). Row-parallel: rank r needs columns [2r, 2r+2) of all 4 rows;
    it holds 2x2 of those, lacks the other 2x2 = 4 elements. Norm: needs 4, holds 2, lacks 2.
    A column-parallel (4, 4) weight (rows [2r, 2r+2)) is exactly held: 0.
    """
    shapes = {"o": (4, 4), "norm": (4,), "q": (4, 4)}
    held = [{n: fsdp_box(s, 2, r) for n, s in shapes.items()} for r in range(2)]
    needed = [{"o": Box.along((4, 4), 1, 2 * r, 2 * r + 2), "norm": Box.whole((4,)),
               "q": Box.along((4, 4), 0, 2 * r, 2 * r + 2)} for r in range(2)]
    assert layout_minimum(shapes, needed, held, element_size=4) == [(4 + 2) * 4, (4 + 2) * 4]
    assert layout_minimum(shapes, needed, None, element_size=4) == [(8 + 4 + 8) * 4] * 2
    pieces = plan_pieces(list(shapes), held, needed)
    received = [sum(p.box.numel for p in pieces if p.dst == r and p.src != r) for r in range(2)]
    assert received == [6, 6]
    assert [p for p in pieces if p.name == "q" and p.src != p.dst] == []


def test_plan_pieces_cover_each_needed_element_exactly_once_on_random_layouts():
    rng = random.Random(0)
    for _ in range(50):
        shape = (rng.randint(1, 9), rng.randint(1, 9))
        world = rng.randint(1, 4)
        held = [{"w": fsdp_box(shape, world, r)} for r in range(world)]
        needed = []
        for _ in range(rng.randint(1, 4)):
            dim = rng.randint(0, 1)
            a = rng.randint(0, shape[dim])
            needed.append({"w": Box.along(shape, dim, a, rng.randint(a, shape[dim]))})
        pieces = plan_pieces(["w"], held, needed)
        for d, need in enumerate(needed):
            hits = torch.zeros(shape, dtype=torch.int32)
            for p in pieces:
                if p.dst == d:
                    hits[p.box.slices()] += 1
                    assert p.box == p.box.intersect(held[p.src]["w"])  # sent only by its holder
            expected = torch.zeros(shape, dtype=torch.int32)
            expected[need["w"].slices()] = 1
            assert torch.equal(hits, expected)


def test_a_needed_element_nobody_holds_is_an_error():
    with pytest.raises(ValueError, match="w: rank 0 needs"):
        plan_pieces(["w"], [{"w": Box.along((4,), 0, 0, 2)}], [{"w": Box.whole((4,))}])


def test_buckets_keep_order_and_size_and_let_a_large_tensor_travel_alone():
    sizes = {"a": 4, "b": 4, "c": 10, "d": 1, "e": 3}
    assert buckets(list(sizes), sizes, 8) == [["a", "b"], ["c"], ["d", "e"]]


def test_pack_then_unpack_returns_each_box_in_place():
    torch.manual_seed(0)
    tensors = [torch.randn(4, 6), torch.randn(5), torch.randn(3, 2)]
    boxes = [Box.along((4, 6), 1, 2, 5), Box.whole((5,)), Box.along((3, 2), 0, 1, 3)]
    flat = pack(tensors, boxes, torch.float32)
    assert flat.numel() == 12 + 5 + 4
    out = unpack(flat, ["x", "y", "z"], [(4, 6), (5,), (3, 2)], boxes, torch.float32)
    for (name, got), want, box in zip(out, tensors, boxes):
        assert got.shape == want.shape, name
        assert torch.equal(got[box.slices()], want[box.slices()]), name
