"""Actor (FSDP2 over 2 gloo ranks) colocated with vLLM at TP 1: weight sync and its checks,
reference log-probs at step 0, and the update path."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from hybridflow.config.schema import ActorConfig, HybridFlowConfig, OptimConfig, RolloutConfig, WeightSyncConfig
from hybridflow.controller import PoolSpec, ResourcePool, RoleSpec, spawn_workers
from hybridflow.resharding import WeightSyncError
from hybridflow.resharding.sync import WeightSync
from hybridflow.resharding.transports import Colocated
from hybridflow.data import ArithmeticSpec, make_arithmetic_rows
from hybridflow.data.prompts import encode_prompts
from tests.e2e.workers import CorruptibleVLLMRollout
from recipes.roles import actor_role, reference_role
from hybridflow.run.stage import prepare_stage
from hybridflow.training.objectives import PolicyObjective

MAX_PROMPT_TOKENS = 8
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


@pytest.fixture(scope="module")
def groups(ray_local, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rollout = RoleSpec(CorruptibleVLLMRollout, dict(
        model_path=str(tiny_model_dir), rollout=RolloutConfig(max_response_tokens=6), max_prompt_tokens=MAX_PROMPT_TOKENS,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, verifiable_weights=True))
    config = HybridFlowConfig(actor=ActorConfig(optim=OptimConfig(lr=1e-3), samples_per_micro_batch=4))
    actor, reference = actor_role(prepare_stage(config).config, tiny_model_dir), reference_role(prepare_stage(config).config, tiny_model_dir)
    out = spawn_workers(ResourcePool(PoolSpec("hybrid", devices_per_node=2)),
                        {"actor": actor, "rollout": rollout, "reference": reference}, env_vars=VLLM_ENV)
    for future in [out["actor"].start.remote(), out["reference"].start.remote(), out["rollout"].start.remote()]:
        future.get()
    out["sync"] = WeightSync(out["actor"], out["rollout"], WeightSyncConfig(checksum_every_steps=1), Colocated(),
                             "float32")
    out["sync"].setup()
    return out, tok


def _samples(groups, tok, seed=0, count=8):
    prompts = encode_prompts(make_arithmetic_rows(count, ArithmeticSpec(), seed=seed), tok, MAX_PROMPT_TOKENS)
    return groups["rollout"].generate(prompts)


def test_step0_reference_and_actor_log_probs_equal_the_samplers(groups):
    g, tok = groups
    samples = _samples(g, tok)
    actor = g["actor"].compute_log_probs(samples)
    ref = g["reference"].compute_ref_log_probs(samples)
    mask = samples["response_mask"]
    assert torch.equal(actor["old_log_probs"] * mask, ref["ref_log_probs"] * mask)
    torch.testing.assert_close(actor["old_log_probs"][mask], samples["sampler_log_probs"][mask], atol=1e-4, rtol=0)


def test_update_changes_weights_and_sync_makes_vllm_match(groups):
    g, tok = groups
    actor = g["actor"]
    before = actor.weight_checksums()[0][0]  # rank 0 result, rollout rank 0 (whole tensors at TP 1)
    samples = _samples(g, tok, seed=1)
    samples = samples.union(actor.compute_log_probs(samples))
    torch.manual_seed(0)
    samples.tensors["advantages"] = torch.randn(len(samples), 1).expand_as(samples["old_log_probs"]).contiguous()
    stats = actor.update_policy(samples)[0]
    assert stats["actor/grad_norm"] > 0 and stats["actor/log_prob_diff_from_old"] < 1e-5
    after = actor.weight_checksums()[0][0]
    changed = [name for name in before if before[name] != after[name]]
    assert len(changed) == len(before), f"unchanged after an update: {set(before) - set(changed)}"

    sync = g["sync"].sync(step=1, version=1)
    assert sync["weight_sync/verified_tensors"] > 0 and sync["weight_sync/probe_log_prob_gap"] < 1e-3
    # TP 1 on 2 FSDP ranks: each rank lacks the other half of every tensor, and receives exactly that.
    assert sync["weight_sync/bytes_received_per_rank"] == sync["weight_sync/min_bytes_per_rank"] > 0
    fresh = _samples(g, tok, seed=2)
    new_lp = actor.compute_log_probs(fresh)["old_log_probs"]
    mask = fresh["response_mask"]
    torch.testing.assert_close(new_lp[mask], fresh["sampler_log_probs"][mask], atol=1e-4, rtol=0)


def test_verification_fails_loudly_on_a_corrupted_vllm_tensor(groups):
    g, _ = groups
    g["sync"].sync(step=2, version=2)
    name = g["rollout"].corrupt_parameter("layers.1.post_attention_layernorm")[0]
    # the probe sees it, and answers which question failed with the checksums: the weights differ
    with pytest.raises(WeightSyncError, match=rf"(?s)weight sync verification failed for 1 of .*{name}"):
        g["sync"].probe()
    # The group is now marked broken (another rank could be stuck in a collective): this test
    # runs last of the tests that use it.


def test_micro_batch_split_does_not_change_gradients(tiny_model_dir):
    """One micro-batch or four: the same summed gradients (single process, no Ray)."""
    from hybridflow.batch import Batch
    from hybridflow.controller import WorkerContext

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    rows = make_arithmetic_rows(8, ArithmeticSpec(), seed=3)
    batch = encode_prompts(rows, tok, MAX_PROMPT_TOKENS)
    response = torch.randint(5, 60, (8, 5))
    mask = torch.rand(8, 5) > 0.3
    mask[:, 0] = True
    batch = batch.union(Batch({"response_ids": response, "response_mask": mask,
                               "old_log_probs": -torch.rand(8, 5) * 5, "advantages": torch.randn(8, 5)}))

    def grads(rows_per_micro: int) -> dict[str, torch.Tensor]:
        config = HybridFlowConfig(actor=ActorConfig(samples_per_micro_batch=rows_per_micro))
        worker = actor_role(prepare_stage(config).config, tiny_model_dir).build(WorkerContext())
        worker.start()
        worker.model.train()
        counts = {"global_token_count": float(mask.sum()), "global_sequence_count": float(mask.any(1).sum())}
        objective = PolicyObjective(worker.cfg, worker.temperature)
        for micro in batch.split(rows_per_micro):
            loss, _ = objective.loss(worker.model, micro, counts)
            loss.backward()
        return {n: p.grad.clone() for n, p in worker.model.named_parameters()}

    whole, split = grads(8), grads(2)
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], atol=1e-6, rtol=1e-4, msg=name)
