"""hybridflow.patches.grouped_cpu_lora_ops against vLLM's own CPU LoRA ops: the same numbers on
random inputs (one adapter for every token, as in RL, and mixed adapters, -1 included), through
the decode ops and through the prefill ops that call them."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def ops():
    from vllm.lora.ops.torch_ops import lora_ops

    from hybridflow import patches

    before = {n: getattr(lora_ops, n) for n in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice", "sgmv_shrink")}
    assert "grouped_cpu_lora_ops" not in patches._applied  # only rollout workers apply it, not this process
    patches.grouped_cpu_lora_ops()
    from vllm.lora.punica_wrapper import punica_cpu

    assert punica_cpu.bgmv_shrink is lora_ops.bgmv_shrink is not before["bgmv_shrink"]
    return before, lora_ops


@pytest.mark.parametrize("indices", [[0] * 7, [1, 0, 1, 1, -1, 0, 2]], ids=["one-adapter", "mixed"])
def test_the_grouped_ops_compute_what_vllms_compute(ops, indices):
    before, patched = ops
    torch.manual_seed(0)
    idx = torch.tensor(indices)
    x = torch.randn(7, 24)
    a = torch.randn(3, 1, 8, 24)  # (slots, 1, r, in)
    b = torch.randn(3, 1, 40, 8)  # (slots, 1, out, r)
    want, got = torch.zeros(7, 8), torch.zeros(7, 8)
    before["bgmv_shrink"](x, a, want, idx, 0.5)
    patched.bgmv_shrink(x, a, got, idx, 0.5)
    torch.testing.assert_close(got, want)
    h = torch.randn(7, 8)
    for add in (True, False):
        want, got = torch.ones(7, 40), torch.ones(7, 40)
        before["bgmv_expand"](h, b, want, idx, add)
        patched.bgmv_expand(h, b, got, idx, add)
        torch.testing.assert_close(got, want)
        want, got = torch.ones(7, 64), torch.ones(7, 64)
        before["bgmv_expand_slice"](h, b, want, idx, 16, 40, add)
        patched.bgmv_expand_slice(h, b, got, idx, 16, 40, add)
        torch.testing.assert_close(got, want)
    # prefill: two sequences of 3 and 4 tokens on adapters 1 and 0, through sgmv_shrink -> bgmv_shrink
    want, got = torch.zeros(7, 8), torch.zeros(7, 8)
    meta = (torch.tensor([0, 3]), torch.tensor([3, 4]), torch.tensor([1, 0]), 2, 4, 7)
    ref = torch.repeat_interleave(torch.tensor([1, 0]), torch.tensor([3, 4]))
    before["bgmv_shrink"](x, a, want, ref, 1.0)
    patched.sgmv_shrink(x, a, got, *meta, 1.0)
    torch.testing.assert_close(got, want)
