"""The region arithmetic of `workers.rollout.vllm.regions` and `Box.parts`, on meta tensors.

The loaders' op chains are written by hand here as vLLM's would record them: a column-parallel
narrow, Phi3's fused qkv (three narrows of one tensor), GPT-2's transposed Conv1D weight.
"""

from __future__ import annotations

import torch

from hybridflow.resharding.layout import Box, fsdp_box, layout_minimum
from workers.rollout.vllm.regions import bounding, replay, union_numel, view_box

NARROW = "narrow"


def test_a_column_parallel_narrow_is_a_row_box():
    # rank 1 of TP 2 on a (384, 128) weight: rows [192, 384)
    assert replay([384, 128], [(NARROW, (0, 192, 192), ())]) == Box(((192, 384), (0, 128)))


def test_a_transposed_conv1d_weight_reads_checkpoint_columns():
    # GPT-2's c_attn (H=128, 3H=384) is transposed to (384, 128); rank 0 of the q part at TP 2
    # reads rows [0, 64) of the transpose, i.e. columns [0, 64) of the checkpoint tensor
    ops = [("t", (), ()), (NARROW, (0, 0, 128), ()), (NARROW, (0, 0, 64), ())]
    assert replay([128, 384], ops) == Box(((0, 128), (0, 64)))


def test_phi3_fused_qkv_at_tp2_is_three_row_ranges_inside_one_box():
    # qkv_proj (384, 128), 4 heads of 32 each for q, k and v; rank 1 reads heads 2-3 of each
    parts = [replay([384, 128], [(NARROW, (0, start, 128), ()), (NARROW, (0, 64, 64), ())]) for start in (0, 128, 256)]
    assert parts == [Box(((64, 128), (0, 128))), Box(((192, 256), (0, 128))), Box(((320, 384), (0, 128)))]
    assert bounding(parts, [384, 128]) == Box(((64, 384), (0, 128)))
    assert union_numel(parts) == 3 * 64 * 128


def test_a_reshape_across_dimensions_is_not_a_box():
    base = torch.empty(4, 6, device="meta")
    assert view_box(base.narrow(1, 0, 3).reshape(-1)[:5], base) is None
    assert view_box(torch.empty(4, 6, device="meta"), base) is None  # a copy, not a view


def test_box_parts_travel_and_count_only_what_is_read():
    parts = (Box(((0, 2), (0, 4))), Box(((6, 8), (0, 4))))
    box = Box(((0, 8), (0, 4)), parts)
    assert Box.of(box.travelling()) == box and Box.of(box.travelling()).parts == parts
    assert box == Box(((0, 8), (0, 4)))  # parts do not change which region travels
    assert box.read_numel == 16 and box.numel == 32
    # colocated, 2 ranks: rank 0 holds rows [0, 4) and reads rows [0, 2) and [6, 8): it lacks 8 elements
    held = [{"w": fsdp_box([8, 4], 2, r)} for r in range(2)]
    assert layout_minimum({"w": [8, 4]}, [{"w": box}, {"w": box}], held, 1) == [8, 8]
