"""vLLM's prefix cache after a weight load (docs/resharding.md, "The prefix cache after a load").

vLLM caches the KV of full prompt blocks (128 tokens on the CPU) and keeps them across a weight
load. A prompt of three full blocks is read from the cache on its second run; after a load of
changed weights the receiver resets the cache, so the prompt is computed again and its log-probs
equal a plain forward of the new weights. Without the reset the same load leaves the old keys
and values in place and the log-probs are those of neither model.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridflow.builders import build_tiny_model
from hybridflow.config.schema import RolloutConfig, TinyModelConfig
from hybridflow.controller import PoolSpec, ResourcePool, RoleSpec, spawn_workers
from tests.e2e.workers import PrefixCacheVLLMRollout

BLOCK = 128  # vLLM's CPU block size
PROMPT_TOKENS = 3 * BLOCK + 10
NEW_TOKENS = 4
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


@pytest.fixture(scope="module")
def setup(ray_local, tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp("long") / "model", TinyModelConfig(max_position_embeddings=512))
    spec = RoleSpec(PrefixCacheVLLMRollout, dict(
        model_path=str(model_dir), rollout=RolloutConfig(max_response_tokens=NEW_TOKENS), max_prompt_tokens=PROMPT_TOKENS,
        eos_token_id=2, pad_token_id=0))
    group = spawn_workers(ResourcePool(PoolSpec("prefix", devices_per_node=1)), {"rollout": spec},
                          env_vars=VLLM_ENV)["rollout"]
    group.start()
    yield group, model_dir
    group.shutdown()


def _forward_log_probs(model_dir, scale: float, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
        ids = torch.tensor([prompt + tokens])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None])[:, 0]


def test_the_prefix_cache_is_reset_after_every_load(setup):
    group, model_dir = setup
    prompt = torch.randint(5, 60, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0)).tolist()
    group.greedy(prompt, NEW_TOKENS)
    _, _, cached = group.greedy(prompt, NEW_TOKENS)[0]
    assert cached == 3 * BLOCK, "prefix caching is off: this test would prove nothing"

    group.load_scaled(1.5, reset_prefix_cache=False)  # what a load did before the reset
    tokens, stale, cached = group.greedy(prompt, NEW_TOKENS)[0]
    assert cached == 3 * BLOCK
    gap = (torch.tensor(stale, dtype=torch.float64) - _forward_log_probs(model_dir, 1.5, prompt, tokens)).abs().max()
    assert gap > 1e-2, f"the stale cache went unnoticed ({gap:.2g}): the check below could not fail"

    group.load_scaled(2.0, reset_prefix_cache=True)
    tokens, fresh, cached = group.greedy(prompt, NEW_TOKENS)[0]
    assert cached == 0, "after a load the prompt must be computed again, not read from the cache"
    torch.testing.assert_close(torch.tensor(fresh, dtype=torch.float64),
                               _forward_log_probs(model_dir, 2.0, prompt, tokens), atol=1e-3, rtol=0)
