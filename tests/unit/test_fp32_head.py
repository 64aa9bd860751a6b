"""The float32 output head (actor.fp32_lm_head, rollout.fp32_lm_head; hybridflow.training.fsdp.fp32_output_head):
on a model computing in bfloat16 its logits are float32 and its log-probs nearer the float64 head's
than the bfloat16 head's; an engine that cannot is refused before start; the memory floor prices it."""

from __future__ import annotations

import pytest
import torch

from hybridflow.config import compose


def _log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1]
    return torch.log_softmax(logits.double(), -1).gather(-1, ids[:, 1:, None])[..., 0]


def test_the_float32_head_computes_the_logits_in_float32_and_brings_the_log_probs_nearer_float64(tiny_model_dir):
    """With the same bfloat16 body, the head's logits are the float32 product of its bfloat16 hidden states
    and weight (not that product rounded to bfloat16), and its log-probs are nearer the float64 product's of the
    same hidden states and weight than the bfloat16 head's are. (The whole float64 model is no reference for the
    head alone: the bfloat16 body's own rounding, which differs between CPUs with and without bfloat16
    instructions, can outweigh the head's on a model this small.)"""
    from transformers import AutoModelForCausalLM

    from hybridflow.training.fsdp import fp32_output_head

    torch.manual_seed(0)
    bf16 = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    ids = torch.randint(0, bf16.config.vocab_size, (4, 24))
    with torch.no_grad():
        plain = _log_probs(bf16, ids)
        hidden = bf16.model(input_ids=ids).last_hidden_state  # (B, T, H) bfloat16
        assert bf16(input_ids=ids).logits.dtype == torch.bfloat16
        exact_logits = hidden.double() @ bf16.lm_head.weight.double().T  # the same inputs, float64
        exact = torch.log_softmax(exact_logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        fp32_output_head(bf16)
        logits = bf16(input_ids=ids).logits
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits, hidden.float() @ bf16.lm_head.weight.float().T, rtol=0, atol=0)
        headed = _log_probs(bf16, ids)
    gap_plain, gap_headed = (plain - exact).abs().mean(), (headed - exact).abs().mean()
    assert gap_headed < gap_plain / 10, (float(gap_plain), float(gap_headed))


def test_an_engine_that_cannot_compute_its_head_in_float32_is_refused_naming_those_that_can():
    with pytest.raises(ValueError, match=r"rollout.fp32_lm_head=True is invalid: rollout.backend=vllm computes its "
                                         r"output head in rollout.dtype; engines that compute it in float32: \['hf'\]"):
        compose(["recipe=grpo", "rollout.fp32_lm_head=true"])
    compose(["recipe=grpo", "rollout=hf", "rollout.fp32_lm_head=true", "actor.fp32_lm_head=true"])


def test_the_memory_floor_prices_float32_logits():
    from hybridflow.checks.memory_budget import MemoryInputs, ModelShape, micro_batch_terms

    shape = ModelShape(parameters=10 ** 8, layers=4, hidden=256, intermediate=1024, heads=4, vocab=50000)
    common = dict(shape=shape, compute_bytes=2, master_bytes=4, rollout_bytes=2, rows=2, prompt_tokens=8,
                  response_tokens=16, checkpointing=False, kv_cache_bytes=0)
    bf16 = micro_batch_terms(MemoryInputs(**common))
    fp32 = micro_batch_terms(MemoryInputs(**common, fp32_head=True))
    (plain_key, plain), = [(k, v) for k, v in bf16.items() if k.startswith("its logits")]
    (fp32_key, priced), = [(k, v) for k, v in fp32.items() if k.startswith("its logits")]
    assert plain == 2 * 2 * 16 * 50000 * 2 and priced == 2 * plain and "actor.fp32_lm_head" in fp32_key
