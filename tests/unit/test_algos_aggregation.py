"""Loss aggregation: hand-worked values, loop check, micro-batch invariance, registry errors."""

import pytest
import torch

from hybridflow.algos.aggregation import LOSS_AGGREGATIONS, aggregate_loss

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def _example():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    # row 0: tokens 1, 2 ; row 1: token 4 ; row 2: all padding (data-parallel filler)
    mask = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])
    return loss, mask


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 7.0 / 3.0),  # (1 + 2 + 4) / 3 tokens
        ("seq-mean-token-mean", 2.75),  # (mean(1, 2) + mean(4)) / 2 sequences = (1.5 + 4) / 2
        ("seq-mean-token-sum", 3.5),  # ((1 + 2) + 4) / 2 sequences
        ("seq-mean-token-sum-norm", 7.0 / 6.0),  # ((1 + 2) / 3 + 4 / 3) / 2, T = 3
    ],
)
def test_by_hand_padding_row_not_counted(mode, expected):
    loss, mask = _example()
    assert aggregate_loss(loss, mask, mode).item() == pytest.approx(expected, rel=1e-6)


def test_global_counts_replace_local_ones():
    loss, mask = _example()
    # token-mean: 7 / 7 = 1 ; seq-mean-token-sum: 7 / 4 = 1.75
    assert aggregate_loss(loss, mask, "token-mean", global_token_count=7).item() == pytest.approx(1.0)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum", global_sequence_count=4).item() == pytest.approx(1.75)


def _loop(loss, mask, mode):
    B, T = loss.shape
    rows = [[loss[i, t].item() for t in range(T) if mask[i, t]] for i in range(B)]
    rows = [r for r in rows if r]
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in rows) / len(rows)
    return sum(sum(r) / T for r in rows) / len(rows)


def _ragged(B, T, seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=gen)
    lengths[0] = T  # at least one non-empty row
    mask = torch.arange(T) < lengths.unsqueeze(-1)
    mask &= torch.rand(B, T, generator=gen) > 0.1  # holes inside responses (multi-turn)
    return torch.randn(B, T, generator=gen), mask


@pytest.mark.parametrize("mode", MODES)
def test_matches_loop(mode):
    loss, mask = _ragged(6, 9, seed=1)
    assert aggregate_loss(loss, mask, mode).item() == pytest.approx(_loop(loss, mask, mode), rel=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_four_micro_batches_equal_one(mode):
    values, mask = _ragged(8, 5, seed=2)
    mask[3] = False  # an empty row inside a micro-batch
    weights = torch.randn(8, 5)

    full_param = values.clone().requires_grad_(True)
    full = aggregate_loss(full_param * weights, mask, mode)
    full.backward()

    micro_param = values.clone().requires_grad_(True)
    tokens, sequences = int(mask.sum()), int(mask.any(-1).sum())
    total = 0.0
    for idx in torch.arange(8).chunk(4):
        part = aggregate_loss(
            micro_param[idx] * weights[idx], mask[idx], mode, global_token_count=tokens, global_sequence_count=sequences
        )
        part.backward()
        total += part.item()
    assert total == pytest.approx(full.item(), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(micro_param.grad, full_param.grad)


def test_local_normalisation_is_not_split_invariant():
    # guards the test above: without global counts, averaging micro-batch token means differs
    loss = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    full = aggregate_loss(loss, mask, "token-mean").item()  # 7 / 4 = 1.75
    halves = (aggregate_loss(loss[:1], mask[:1]).item() + aggregate_loss(loss[1:], mask[1:]).item()) / 2  # (1+4)/2
    assert full == pytest.approx(1.75) and halves == pytest.approx(2.5)


def test_all_padding_micro_batch_gives_zero():
    loss = torch.full((2, 3), float("nan"))
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for mode in MODES:
        assert aggregate_loss(loss, mask, mode).item() == 0.0


def test_errors_name_the_problem():
    loss, mask = _example()
    with pytest.raises(KeyError, match="seq-mean-token-mean.*token-mean"):
        aggregate_loss(loss, mask, "sum")
    with pytest.raises(ValueError, match="global_token_count=0"):
        aggregate_loss(loss, mask, "token-mean", global_token_count=0)
    with pytest.raises(TypeError, match="mask"):
        aggregate_loss(loss, mask.float(), "token-mean")
    with pytest.raises(KeyError, match="already registered"):
        LOSS_AGGREGATIONS.register("token-mean")(lambda *a, **k: None)


def test_micro_batch_stats_add_loss_parts_and_weigh_means_by_tokens():
    from hybridflow.algos import micro_batch_stat

    parts = [({"policy_loss": 0.25, "clip_fraction": 0.5}, 0.75), ({"policy_loss": 0.5, "clip_fraction": 1.0}, 0.25)]
    for world, loss in ((1, 0.75), (4, 3.0)):  # a rank's parts summed, times the ranks for the mean over them
        totals = {k: sum(micro_batch_stat(k, stats[k], share, world) for stats, share in parts)
                  for k in ("policy_loss", "clip_fraction")}
        assert totals == {"policy_loss": loss, "clip_fraction": 0.625}  # the token-weighted mean, any world
    assert micro_batch_stat("critic/value_loss", 0.25, 0.5, 2) == 0.5  # a loss part under a role's namespace
    assert micro_batch_stat("critic/value_mean", 0.25, 0.5, 2) == 0.125
