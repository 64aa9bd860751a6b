"""The weight checksum (hybridflow/resharding/verify.py `checksum`, shared by the actor's side and every
engine's): the sums of one float64 pass, within float64 rounding, without ever making a float64 copy of the
whole tensor (issue 83 item 7): every float64 tensor it creates is recorded and none passes the chunk bound."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

import hybridflow.resharding.verify as verify
from hybridflow.resharding.verify import CHECKSUM_CHUNK_ELEMENTS, checksum


def _one_pass(t: torch.Tensor) -> tuple[float, float]:
    """The formula before issue 83: the whole tensor to float64 at once."""
    t64 = t.detach().to(torch.float64)
    return float(t64.sum()), float((t64 * t64).sum())


class _Float64Sizes(TorchFunctionMode):
    """The element count of every float64 tensor a torch call returns while active."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype == torch.float64:
            self.sizes.append(out.numel())
        return out


def _assert_same(t: torch.Tensor):
    got, want = checksum(t), _one_pass(t)
    scale = float(t.detach().double().abs().sum())  # a sum's rounding is relative to the sum of magnitudes
    assert abs(got[0] - want[0]) <= 1e-12 * max(scale, 1e-300), (got, want)
    assert abs(got[1] - want[1]) <= 1e-12 * max(want[1], 1e-300), (got, want)


def test_a_large_tensor_matches_one_float64_pass_and_no_float64_tensor_passes_the_chunk():
    t = torch.randn(2 * CHECKSUM_CHUNK_ELEMENTS + 12_345, generator=torch.Generator().manual_seed(0)) + 0.25
    with _Float64Sizes() as recorded:
        checksum(t)
    assert recorded.sizes and max(recorded.sizes) <= CHECKSUM_CHUNK_ELEMENTS  # 3 chunks, each its own copy
    with _Float64Sizes() as whole:  # the recorder sees what the one-pass formula made: the whole tensor
        _one_pass(t)
    assert max(whole.sizes) == t.numel()
    assert CHECKSUM_CHUNK_ELEMENTS * 8 <= 64 * 2 ** 20  # the bound: 64 MiB of float64 at most
    _assert_same(t)


@pytest.mark.parametrize("view", ["contiguous", "transposed", "column_box", "row_of_one", "bf16", "scalar", "empty"])
def test_views_and_dtypes_match_one_float64_pass_within_the_bound(monkeypatch, view):
    """With a small chunk (1,000 elements), the strided views the sender checksums (a box of a tensor), a
    bfloat16 tensor, a 0-d and an empty one: the same sums, and no float64 tensor above the chunk."""
    monkeypatch.setattr(verify, "CHECKSUM_CHUNK_ELEMENTS", 1000)
    base = torch.randn(64, 300, generator=torch.Generator().manual_seed(1))
    t = {"contiguous": base, "transposed": base.t(), "column_box": base[:, 7:290], "row_of_one": base[None, 3:4, :],
         "bf16": base.to(torch.bfloat16), "scalar": base[0, 0], "empty": base[:0]}[view]
    with _Float64Sizes() as recorded:
        checksum(t)
    assert max(recorded.sizes) <= 1000
    _assert_same(t)


def test_identical_weights_give_identical_checksums_on_both_sides():
    """The actor's box and the engine's tensor, the same values in different layouts, read the same sums
    exactly when their chunks meet the same elements in the same order (a contiguous copy)."""
    t = torch.randn(3000, 2000, generator=torch.Generator().manual_seed(2))
    assert checksum(t) == checksum(t.clone()) == checksum(t.t().contiguous().t().contiguous())
