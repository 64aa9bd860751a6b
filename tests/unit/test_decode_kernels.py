"""The hf engine's CPU kernels (hybridflow/training/decode_kernels.py) compute what transformers' defaults compute:
the grouped-query attention bit for bit, under a padding mask and without one; the oneDNN linear layers to float32's
rounding, a product that records gradients through `F.linear`; the engine starts with both (the engine's own
outputs against the plain model: tests/unit/test_hf_engine.py)."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hybridflow.training.decode_kernels import (ATTENTION, ONEDNN_MIN_WEIGHTS, _attention, grouped_query_attention,
                                                onednn_linears)


class _Heads(torch.nn.Module):
    num_key_value_groups, is_causal = 3, True


@pytest.mark.parametrize("queries", [1, 5])
@pytest.mark.parametrize("masked", [True, False])
def test_grouped_attention_is_transformers_sdpa_bit_for_bit(queries, masked):
    torch.manual_seed(0)
    rows, keys = 4, 7
    q, k, v = torch.randn(rows, 9, queries, 16), torch.randn(rows, 3, keys, 16), torch.randn(rows, 3, keys, 16)
    mask = None
    if masked:  # left padding of 0-3 positions, causal over the last `queries`
        mask = torch.ones(rows, 1, queries, keys, dtype=torch.bool).tril(keys - queries)
        for row in range(rows):
            mask[row, :, :, :row] = False
    ours, _ = _attention(_Heads(), q, k, v, mask, scaling=0.25)
    theirs, _ = sdpa_attention_forward(_Heads(), q, k, v, mask, scaling=0.25)
    assert torch.equal(ours, theirs)


def test_the_engines_kernels_leave_a_models_logits_and_gradients_as_they_were(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert grouped_query_attention(model) and model.config._attn_implementation == ATTENTION
    assert onednn_linears(model) == 0  # the tiny model's weights are all below the size oneDNN repays
    assert onednn_linears(model, min_weights=1) == linears > 0
    assert onednn_linears(model, min_weights=1) == 0  # set once: a replaced forward is left alone
    ids = torch.randint(3, 100, (3, 6))
    mask = torch.ones_like(ids)
    mask[1, :2] = mask[2, :4] = 0  # left padding
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = plain(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        got = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for m in (plain, model):  # with gradients the products are F.linear's
        m.requires_grad_(True)
        m(input_ids=ids, attention_mask=mask, position_ids=positions).logits.logsumexp(-1).sum().backward()
    for (name, a), b in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)


def test_the_hf_engine_starts_with_the_cpu_kernels(tiny_model_dir):
    from transformers import AutoTokenizer

    from hybridflow.config.schema import Dtype, RolloutConfig
    from hybridflow.controller import WorkerContext
    from workers.rollout.hf_rollout import HFRollout

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = HFRollout(WorkerContext(rank=0, world_size=1, device="cpu", group_name="kernels"), str(tiny_model_dir),
                       RolloutConfig(dtype=Dtype.float32), 8, tok.eos_token_id, tok.pad_token_id)
    engine.start()
    assert engine.model.config._attn_implementation == ATTENTION
    assert all(("forward" in vars(m)) == (m.weight.numel() >= ONEDNN_MIN_WEIGHTS)
               for m in engine.model.modules() if type(m) is torch.nn.Linear)


def _resident_bytes() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="madvise is Linux's")
def test_ended_rows_give_their_kv_cache_pages_back_and_the_live_rows_keep_theirs():
    """A decode's ended rows leave the preallocated cache (`batch_select_indices`): the pages they had written return
    to the system (the resident set falls by about their size, and they read back as zeros), the live rows'
    keys and values move to the front unchanged."""
    from hybridflow.training.kv_cache import _PreallocatedLayer

    torch.manual_seed(0)
    rows, heads, positions, dim = 64, 4, 512, 64  # 32 MiB a buffer
    layer = _PreallocatedLayer(positions)
    keys, values = torch.randn(rows, heads, positions, dim), torch.randn(rows, heads, positions, dim)
    layer.update(keys, values)  # every position written: every page resident
    before = _resident_bytes()
    keep = torch.tensor([3, 10])
    layer.batch_select_indices(keep)
    released = before - _resident_bytes()
    assert released > 0.9 * 2 * (rows - 2) * heads * positions * dim * 4  # both buffers' ended rows
    assert torch.equal(layer.keys, keys[keep]) and torch.equal(layer.values, values[keep])
    assert not layer._keys[3:-1].any() and not layer._values[3:-1].any()  # given back: zeros (whole pages only)
