"""The `hf` engine's own decode loop (workers/rollout/hf_rollout.py): greedy output equals transformers'
`generate`, the sampler log-probs of sampled tokens equal a full forward pass's tempered, top-p filtered
log-probs of the same tokens (what the trainer's ratio reads), and the top-p filter keeps the smallest
set reaching top_p, worked by hand."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.config.schema import Dtype, RolloutConfig
from hybridflow.controller import WorkerContext


def _engine(tiny_model_dir, **rollout):
    from transformers import AutoTokenizer

    from workers.rollout.hf_rollout import HFRollout

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ctx = WorkerContext(rank=0, world_size=1, device="cpu", group_name="hf-engine")
    engine = HFRollout(ctx, str(tiny_model_dir), RolloutConfig(dtype=Dtype.float32, **rollout), 8, tok.eos_token_id,
                       tok.pad_token_id)
    engine.start()
    return engine, tok


def _prompts(tok, rows: int):
    from hybridflow.data import ArithmeticSpec, make_arithmetic_rows
    from hybridflow.data.prompts import encode_prompts

    batch = encode_prompts(make_arithmetic_rows(rows, ArithmeticSpec(), seed=3), tok, 8)
    batch.tensors["sample_seed"] = torch.arange(rows)
    return batch


def test_greedy_output_equals_transformers_generate(tiny_model_dir):
    engine, tok = _engine(tiny_model_dir, max_response_tokens=6)
    prompts = _prompts(tok, 5)
    out = engine.generate(prompts, greedy=True)
    reference = engine.model.generate(prompts["prompt_ids"], attention_mask=prompts["prompt_mask"].long(),
                                      max_new_tokens=6, do_sample=False, eos_token_id=tok.eos_token_id,
                                      pad_token_id=tok.pad_token_id)[:, prompts["prompt_ids"].shape[1]:]
    width = reference.shape[1]
    mask = out["response_mask"][:, :width]
    assert torch.equal(out["response_ids"][:, :width][mask], reference[mask])


@pytest.mark.parametrize("top_p", [1.0, 0.7])
def test_sampler_log_probs_are_the_full_forwards_tempered_top_p_log_probs(tiny_model_dir, top_p):
    engine, tok = _engine(tiny_model_dir, max_response_tokens=5, temperature=0.8, top_p=top_p)
    prompts = _prompts(tok, 4)
    out = engine.generate(prompts)
    again = engine.generate(prompts)
    assert torch.equal(out["response_ids"], again["response_ids"])  # the batch's seed: reproducible
    ids = torch.cat([prompts["prompt_ids"], out["response_ids"]], 1)
    mask = torch.cat([prompts["prompt_mask"], out["response_mask"]], 1).long()
    logits = engine.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
    width, start = out["response_ids"].shape[1], prompts["prompt_ids"].shape[1]
    full = engine._processed_log_probs(logits[:, start - 1:start - 1 + width].float().reshape(-1, logits.shape[-1]),
                                       sample=True).reshape(len(prompts), width, -1)
    expected = full.gather(-1, out["response_ids"][..., None])[..., 0]
    m = out["response_mask"]
    torch.testing.assert_close(out["sampler_log_probs"][m], expected[m], atol=1e-4, rtol=1e-4)
    assert out.objects["finish_reason"] == ["length" if bool(r[-1]) and int(i[-1]) != tok.eos_token_id else "stop"
                                            for r, i in zip(m, out["response_ids"])]


def test_top_p_keeps_the_smallest_set_that_reaches_it_by_hand(tiny_model_dir):
    engine, _ = _engine(tiny_model_dir, temperature=1.0, top_p=0.6)
    # probabilities 0.5, 0.3, 0.2: the mass before each token is 0, 0.5, 0.8; tokens with mass before
    # them >= 0.6 go: the third. Kept 0.5, 0.3 renormalised: 0.625, 0.375.
    logits = torch.log(torch.tensor([[0.3, 0.5, 0.2]]))
    torch.testing.assert_close(engine._processed_log_probs(logits, sample=True).exp(),
                               torch.tensor([[0.375, 0.625, 0.0]]))
    assert math.isinf(float(engine._processed_log_probs(logits, sample=True)[0, 2]))


def test_top_k_keeps_the_k_likeliest_before_top_p_by_hand(tiny_model_dir):
    engine, _ = _engine(tiny_model_dir, temperature=1.0, top_k=2, top_p=0.7)
    # probabilities 0.3, 0.5, 0.2: top-k=2 keeps 0.5 and 0.3, renormalised 0.625, 0.375; top-p 0.7 over
    # those: mass before each is 0, 0.625, so both stay (vLLM's order: top-k, then top-p over the rest)
    logits = torch.log(torch.tensor([[0.3, 0.5, 0.2]]))
    torch.testing.assert_close(engine._processed_log_probs(logits, sample=True).exp(),
                               torch.tensor([[0.375, 0.625, 0.0]]))
