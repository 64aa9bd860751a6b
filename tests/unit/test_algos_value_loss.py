"""Clipped value loss against a hand-worked example, a loop, and the micro-batch split."""

import pytest
import torch

from hybridflow.algos.value_loss import clipped_value_loss


def _example():
    # ε = 0.2, R = 1 everywhere
    # a: V 1.0, V_old 0.5: unclipped 0; V_clip = 0.7 -> 0.09; max 0.09 -> ½ = 0.045 (clipped, grad 0)
    # b: V 0.6, V_old 0.5: inside the range, (0.6 - 1)² = 0.16 -> 0.08 (grad V - R = -0.4)
    # c: V 0.0, V_old 0.5: unclipped 1; V_clip = 0.3 -> 0.49; max 1 -> 0.5 (grad V - R = -1)
    # d: padding
    # token-mean: (0.045 + 0.08 + 0.5) / 3 = 0.208333 ; gradients / 3
    values = torch.tensor([[1.0, 0.6, 0.0, 100.0]], requires_grad=True)
    old_values = torch.tensor([[0.5, 0.5, 0.5, 0.5]])
    returns = torch.ones(1, 4)
    mask = torch.tensor([[True, True, True, False]])
    return values, old_values, returns, mask


def test_clipped_value_loss_by_hand():
    values, old_values, returns, mask = _example()
    loss, stats = clipped_value_loss(values=values, old_values=old_values, returns=returns, response_mask=mask)
    loss.backward()
    assert loss.item() == pytest.approx(0.625 / 3, rel=1e-6)
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, -0.4 / 3, -1.0 / 3, 0.0]]))
    assert stats["value_clip_fraction"] == pytest.approx(1 / 3)
    assert stats["value_loss"] == pytest.approx(0.625 / 3, rel=1e-6)


def test_unclipped_by_hand():
    values, old_values, returns, mask = _example()
    # ½ (0 + 0.16 + 1) / 3 = 0.193333
    loss, stats = clipped_value_loss(values=values, old_values=old_values, returns=returns, response_mask=mask,
                                     clip_range=None)
    assert loss.item() == pytest.approx(0.58 / 3, rel=1e-6) and stats["value_clip_fraction"] == 0.0


def test_matches_loop_and_micro_batch_split():
    gen = torch.Generator().manual_seed(0)
    old_values, returns = torch.randn(8, 6, generator=gen), torch.randn(8, 6, generator=gen)
    start = old_values + torch.randn(8, 6, generator=gen) * 0.3
    mask = torch.arange(6) < torch.randint(1, 7, (8, 1), generator=gen)
    expected, count = 0.0, 0
    for b in range(8):
        for t in range(6):
            if mask[b, t]:
                v, o, r = start[b, t].item(), old_values[b, t].item(), returns[b, t].item()
                clipped = o + min(max(v - o, -0.2), 0.2)
                expected += 0.5 * max((v - r) ** 2, (clipped - r) ** 2)
                count += 1
    full = start.clone().requires_grad_(True)
    loss, _ = clipped_value_loss(values=full, old_values=old_values, returns=returns, response_mask=mask)
    loss.backward()
    assert loss.item() == pytest.approx(expected / count, rel=1e-5)

    micro = start.clone().requires_grad_(True)
    total = 0.0
    for idx in torch.arange(8).chunk(4):
        part, _ = clipped_value_loss(values=micro[idx], old_values=old_values[idx], returns=returns[idx],
                                     response_mask=mask[idx], global_token_count=count)
        part.backward()
        total += part.item()
    assert total == pytest.approx(loss.item(), rel=1e-5)
    torch.testing.assert_close(micro.grad, full.grad)


def test_bad_clip_range():
    values, old_values, returns, mask = _example()
    with pytest.raises(ValueError, match="clip_range=0"):
        clipped_value_loss(values=values, old_values=old_values, returns=returns, response_mask=mask, clip_range=0)
