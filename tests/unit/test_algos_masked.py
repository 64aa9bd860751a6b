"""Masked reductions: hand-worked values, NaN padding never leaks, loop check, mask checks."""

import math

import pytest
import torch

from hybridflow.algos.masked import check_mask, masked_mean, masked_sum, masked_var, masked_whiten

NAN = float("nan")


def _example():
    # valid entries: row 0 -> 1, 2 ; row 1 -> 4 ; padding holds NaN on purpose
    values = torch.tensor([[1.0, 2.0, NAN], [4.0, NAN, NAN]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    return values, mask


def test_sum_and_mean_by_hand():
    values, mask = _example()
    # sum = 1 + 2 + 4 = 7 ; mean = 7 / 3 ; row means: (1+2)/2 = 1.5 and 4/1 = 4
    assert masked_sum(values, mask).item() == pytest.approx(7.0)
    assert masked_mean(values, mask).item() == pytest.approx(7.0 / 3.0)
    torch.testing.assert_close(masked_mean(values, mask, dim=-1), torch.tensor([1.5, 4.0]))
    torch.testing.assert_close(masked_sum(values, mask, dim=-1), torch.tensor([3.0, 4.0]))


def test_mean_of_empty_row_is_zero_not_nan():
    values = torch.tensor([[1.0, 2.0], [NAN, NAN]])
    mask = torch.tensor([[True, True], [False, False]])
    torch.testing.assert_close(masked_mean(values, mask, dim=-1), torch.tensor([1.5, 0.0]))


def test_var_by_hand():
    values, mask = _example()
    # valid 1, 2, 4: mean 7/3; squared deviations 16/9 + 1/9 + 25/9 = 42/9 = 14/3
    # unbiased: (14/3) / 2 = 7/3 ; biased: (14/3) / 3 = 14/9
    assert masked_var(values, mask).item() == pytest.approx(7.0 / 3.0, rel=1e-6)
    assert masked_var(values, mask, unbiased=False).item() == pytest.approx(14.0 / 9.0, rel=1e-6)


def test_var_of_one_entry_is_zero():
    values = torch.tensor([[3.0, NAN]])
    mask = torch.tensor([[True, False]])
    assert masked_var(values, mask).item() == 0.0


def test_whiten_by_hand():
    values, mask = _example()
    # (x - 7/3) / sqrt(7/3) = [-4/3, -1/3, 5/3] / 1.527525 = [-0.872872, -0.218218, 1.091089]; padding -> 0
    expected = torch.tensor([[-0.872872, -0.218218, 0.0], [1.091089, 0.0, 0.0]])
    torch.testing.assert_close(masked_whiten(values, mask, eps=0.0), expected, atol=1e-5, rtol=0)


def test_whiten_matches_loop_on_ragged_batch():
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(5, 7, generator=gen)
    mask = torch.rand(5, 7, generator=gen) > 0.4
    kept = [values[i, t].item() for i in range(5) for t in range(7) if mask[i, t]]
    mean = sum(kept) / len(kept)
    std = math.sqrt(sum((x - mean) ** 2 for x in kept) / (len(kept) - 1))
    out = masked_whiten(values, mask, eps=1e-6)
    for i in range(5):
        for t in range(7):
            expected = (values[i, t].item() - mean) / (std + 1e-6) if mask[i, t] else 0.0
            assert out[i, t].item() == pytest.approx(expected, abs=1e-5)


def test_check_mask_rejects_float_and_wrong_shape():
    x = torch.zeros(2, 3)
    with pytest.raises(TypeError, match="response_mask.*torch.bool"):
        check_mask(torch.ones(2, 3), x)
    with pytest.raises(ValueError, match=r"\(2, 4\)"):
        check_mask(torch.ones(2, 4, dtype=torch.bool), x)
