"""Entropy and token log-probs from logits: hand-worked values, stability, bf16 path, loop check."""

import math

import pytest
import torch

from hybridflow.algos.entropy import entropy_bonus, entropy_from_logits, log_probs_from_logits


def test_by_hand():
    # row 0: logits (0, 0) -> p = (1/2, 1/2), H = ln 2 = 0.693147
    # row 1: logits (0, ln 3) -> p = (1/4, 3/4), H = 1/4 ln 4 + 3/4 ln(4/3) = 0.346574 + 0.215762 = 0.562335
    logits = torch.tensor([[[0.0, 0.0], [0.0, math.log(3.0)]]])  # (B=1, T=2, V=2)
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([[0.693147, 0.562335]]))
    # token 1 in row 1: log(3/4) = -0.287682 ; token 0 in row 0: log(1/2) = -0.693147
    token_ids = torch.tensor([[0, 1]])
    torch.testing.assert_close(log_probs_from_logits(logits, token_ids), torch.tensor([[-0.693147, -0.287682]]))


def test_large_logits_are_stable():
    # logits (1000, 0): p ≈ (1, e^-1000); a naive exp overflows to inf/NaN
    logits = torch.tensor([[[1000.0, 0.0]]])
    assert entropy_from_logits(logits).item() == pytest.approx(0.0, abs=1e-6)
    assert log_probs_from_logits(logits, torch.tensor([[1]])).item() == pytest.approx(-1000.0)


def test_matches_loop():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, generator=gen) * 3
    token_ids = torch.randint(0, 5, (2, 3), generator=gen)
    entropy, log_probs = entropy_from_logits(logits), log_probs_from_logits(logits, token_ids)
    for b in range(2):
        for t in range(3):
            z = logits[b, t].tolist()
            norm = sum(math.exp(v) for v in z)
            p = [math.exp(v) / norm for v in z]
            assert entropy[b, t].item() == pytest.approx(-sum(q * math.log(q) for q in p), abs=1e-5)
            assert log_probs[b, t].item() == pytest.approx(math.log(p[token_ids[b, t]]), abs=1e-5)


def test_bf16_logits_computed_in_float32():
    logits = torch.randn(3, 4, 50).to(torch.bfloat16)
    token_ids = torch.randint(0, 50, (3, 4))
    reference = logits.float()
    assert entropy_from_logits(logits).dtype == torch.float32
    torch.testing.assert_close(entropy_from_logits(logits), entropy_from_logits(reference))
    torch.testing.assert_close(log_probs_from_logits(logits, token_ids), log_probs_from_logits(reference, token_ids))


def test_entropy_bonus_by_hand():
    entropy = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    mask = torch.tensor([[True, False], [True, True]])
    # token-mean: (1 + 3 + 4) / 3 = 8/3 ; bonus = 0.01 * 8/3
    bonus, stats = entropy_bonus(entropy=entropy, response_mask=mask, coef=0.01)
    assert bonus.item() == pytest.approx(0.08 / 3)
    assert stats["entropy"] == pytest.approx(8 / 3)
    # seq-mean-token-mean: (1 + 3.5) / 2 = 2.25
    bonus, _ = entropy_bonus(entropy=entropy, response_mask=mask, coef=1.0, aggregation="seq-mean-token-mean")
    assert bonus.item() == pytest.approx(2.25)


def test_log_probs_errors():
    logits = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="token_ids has shape"):
        log_probs_from_logits(logits, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="long"):
        log_probs_from_logits(logits, torch.zeros(2, 3, dtype=torch.int32))


@pytest.mark.parametrize("rows_per_chunk", [None, 1, 2])  # one chunk; split chunks recomputed in backward
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_fused_chunked_log_probs_and_entropy_match_the_separate_functions(dtype, temperature, rows_per_chunk):
    """token_log_probs_and_entropy (in chunks of rows, recomputed in backward when there are several)
    gives the values and the gradients of log_probs_from_logits and entropy_from_logits on
    logits / temperature."""
    from hybridflow.algos import entropy_from_logits, log_probs_from_logits, token_log_probs_and_entropy

    g = torch.Generator().manual_seed(0)
    base = (torch.randn(3, 5, 11, generator=g) * 3).to(dtype)
    ids = torch.randint(0, 11, (3, 5), generator=g)
    weights = torch.randn(3, 5, generator=g)
    fused_in = base.clone().requires_grad_(True)
    lp, ent = token_log_probs_and_entropy(fused_in, ids, temperature=temperature, rows_per_chunk=rows_per_chunk)
    ((lp * weights).sum() + (ent * weights).sum()).backward()
    plain_in = base.clone().requires_grad_(True)
    scaled = plain_in.float() / temperature
    lp_ref, ent_ref = log_probs_from_logits(scaled, ids), entropy_from_logits(scaled)
    ((lp_ref * weights).sum() + (ent_ref * weights).sum()).backward()
    assert lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(lp, lp_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent, ent_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused_in.grad, plain_in.grad)
    with torch.no_grad():  # without autograd: the same numbers, nothing kept
        again, _ = token_log_probs_and_entropy(base, ids, temperature=temperature, rows_per_chunk=2)
    torch.testing.assert_close(again, lp.detach())


@pytest.mark.parametrize("rows_per_chunk", [None, 1])
def test_an_entropy_reported_as_a_metric_has_no_gradient_and_leaves_the_log_probs_gradient_alone(rows_per_chunk):
    """entropy_grad=False (a loss with no entropy term): the same entropy values, outside autograd,
    and the log-probs' gradient unchanged."""
    from hybridflow.algos import token_log_probs_and_entropy

    g = torch.Generator().manual_seed(1)
    base = torch.randn(3, 4, 9, generator=g)
    ids = torch.randint(0, 9, (3, 4), generator=g)
    grads, entropies = [], []
    for entropy_grad in (True, False):
        x = base.clone().requires_grad_(True)
        lp, ent = token_log_probs_and_entropy(x, ids, rows_per_chunk=rows_per_chunk, entropy_grad=entropy_grad)
        assert ent.requires_grad is entropy_grad
        lp.sum().backward()
        grads.append(x.grad)
        entropies.append(ent.detach())
    torch.testing.assert_close(grads[0], grads[1])
    torch.testing.assert_close(entropies[0], entropies[1])


def test_fused_log_probs_refuse_mismatched_token_ids():
    from hybridflow.algos import token_log_probs_and_entropy

    with pytest.raises(ValueError, match="token_ids has shape"):
        token_log_probs_and_entropy(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="pass token_ids.long"):
        token_log_probs_and_entropy(torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.int32))
