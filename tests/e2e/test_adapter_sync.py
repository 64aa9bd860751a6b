"""LoRA served as a vLLM adapter (weight_sync.lora=adapter), for real: FSDP2 actors with a peft
adapter and vLLM engines with LoRA enabled, in Ray workers, on the CPU.

- each sync moves exactly the adapter (r x (in + out) per adapted layer, counted here by hand) to
  every rollout rank, which serves it under a new id; the engine's registered adapter matches the
  actor's checksums, and the sampler's log-probs are the actor's after a training step;
- an adapter that never reaches the engine stops the run at the first check, naming what the
  engine serves: at the first sync (no adapter at all), or later (the previous adapter, stale);
- a request sent without the adapter (the base model samples) stops the batch that carried it.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from hybridflow.config.schema import (ActorConfig, HybridFlowConfig, LoraConfig, OptimConfig, RolloutConfig,
                                      WeightSyncConfig)
from hybridflow.controller import RoleSpec
from hybridflow.data import ArithmeticSpec, make_arithmetic_rows
from hybridflow.data.prompts import encode_prompts
from hybridflow.resharding import WeightSyncError
from hybridflow.resharding.sync import AdapterSync
from hybridflow.resharding.transports import build_transport
from recipes.roles import actor_role
from hybridflow.run.stage import prepare_stage
from tests.e2e.workers import AdapterFaultVLLMRollout, spawn_actor_and_rollout

MAX_PROMPT_TOKENS = 8
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
RANK, ALPHA, TARGETS = 4, 8.0, ["q_proj", "v_proj", "down_proj"]


@pytest.fixture(scope="module")
def ray(ray_local):
    return ray_local


def _spawn(tiny_model_dir, actor_ranks: int, rollout_ranks: int | None, name: str):
    """Actor (LoRA) and rollout (adapters on) groups, on one pool when rollout_ranks is None, and their
    AdapterSync."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rollout = RoleSpec(AdapterFaultVLLMRollout, dict(
        model_path=str(tiny_model_dir), rollout=RolloutConfig(max_response_tokens=6),
        max_prompt_tokens=MAX_PROMPT_TOKENS, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        lora_rank=RANK))
    actor = actor_role(prepare_stage(HybridFlowConfig(actor=ActorConfig(
        optim=OptimConfig(lr=1e-2), samples_per_micro_batch=4,
        lora=LoraConfig(rank=RANK, alpha=ALPHA, target_modules=TARGETS)))).config, tiny_model_dir)
    groups = spawn_actor_and_rollout(actor, rollout, actor_ranks, rollout_ranks, name, VLLM_ENV)
    sync = AdapterSync(groups["actor"], groups["rollout"], WeightSyncConfig(timeout_s=60.0),
                       build_transport(rollout_ranks is None), "float32")
    return groups, sync, tok, sync.setup()


def _shutdown(groups) -> None:
    for group in {id(g.pool): g for g in groups.values()}.values():
        group.shutdown()


def _prompts(tok, seed: int):
    return encode_prompts(make_arithmetic_rows(8, ArithmeticSpec(), seed=seed), tok, MAX_PROMPT_TOKENS)


def _train_one_step(groups, tok, seed: int) -> None:
    samples = groups["rollout"].generate(_prompts(tok, seed))
    samples = samples.union(groups["actor"].compute_log_probs(samples))
    torch.manual_seed(seed)
    samples.tensors["advantages"] = torch.randn(len(samples), 1).expand_as(samples["old_log_probs"]).contiguous()
    groups["actor"].update_policy(samples)


def _adapter_bytes(model_dir) -> int:
    """By hand: r x (in + out) float32 values per adapted linear layer of the tiny model."""
    c = json.loads((model_dir / "config.json").read_text())
    H, inter = c["hidden_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * H // c["num_attention_heads"]
    shapes = {"q_proj": (H, H), "v_proj": (H, kv), "down_proj": (inter, H)}  # (in, out)
    return c["num_hidden_layers"] * sum(RANK * (i + o) for i, o in (shapes[t] for t in TARGETS)) * 4


def test_each_sync_moves_the_adapter_alone_and_a_stale_one_is_caught(ray, tiny_model_dir):
    """Colocated on 2 ranks (FSDP2 shards of A and B gathered, both engines served). Last: the
    adapter of version 2 never registered, so the engine still serves version 1's (the run stops)."""
    groups, sync, tok, setup = _spawn(tiny_model_dir, 2, None, "adapter-co")
    try:
        # a payload built from other weights than the actor holds, consistent with its own checksums:
        # compared with what was sent it passed; against the actor's live weights it stops the sync (the
        # probe is off, as it cannot see a B that is zero at the first sync)
        groups["rollout"].plant_adapter_fault("other_weights")
        unprobed = AdapterSync(groups["actor"], groups["rollout"], WeightSyncConfig(timeout_s=60.0, check="none"),
                               build_transport(True), "float32")
        unprobed.setup()
        with pytest.raises(WeightSyncError, match=r"policy version 0: the adapter the engine serves .* is not the "
                                                  r"actor's: 1 difference\(s\): .*lora_B: engine sum="):
            unprobed.sync(step=0, version=0)
        first = sync.sync(step=0, version=0)
        assert first["weight_sync/bytes_received_per_rank"] == _adapter_bytes(tiny_model_dir)
        assert first["weight_sync/adapter_fraction"] == pytest.approx(
            _adapter_bytes(tiny_model_dir) / setup["weight_sync/engine_bytes_per_rank"])
        layers = json.loads((tiny_model_dir / "config.json").read_text())["num_hidden_layers"]
        assert first["weight_sync/verified_tensors"] == 2 * len(TARGETS) * layers  # A and B of every module
        _train_one_step(groups, tok, seed=1)  # B moves off zero: the adapter changes the model
        after = sync.sync(step=1, version=1)
        assert after["weight_sync/probe_log_prob_gap"] < 1e-4
        samples = groups["rollout"].generate(_prompts(tok, seed=2))
        assert samples["behavior_version"].tolist() == [1] * len(samples)
        actor_lp = groups["actor"].compute_log_probs(samples)["old_log_probs"]
        mask = samples["response_mask"]
        assert float((actor_lp - samples["sampler_log_probs"]).abs()[mask].max()) < 1e-4  # vLLM samples the actor

        _train_one_step(groups, tok, seed=3)
        groups["rollout"].plant_adapter_fault("drop", 2)
        with pytest.raises(WeightSyncError, match=r"policy version 2: the adapter the engine serves "
                                                  r"\(adapter policy-v1 \(id 3\)\) is not the actor's"):  # id 1: the refused payload
            sync.sync(step=2, version=2)
    finally:
        _shutdown(groups)


def test_an_adapter_that_never_arrives_stops_the_sync_and_a_request_without_it_stops_its_batch(ray, tiny_model_dir):
    """Disaggregated 1 -> 1 (the adapter goes from the actor's pool to the rollout's through Ray), one
    pair for both faults (one start less: CI's time, tests/budget.py): version 0's adapter never
    reaches the engine, and the sync says so; version 1's does; then a request goes out without it."""
    groups, sync, tok, _ = _spawn(tiny_model_dir, 1, 1, "adapter-faults")
    try:
        groups["rollout"].plant_adapter_fault("drop", 0)
        with pytest.raises(WeightSyncError, match="the engine serves no adapter, not the actor's adapter: the "
                                                  "adapter never reached it"):
            sync.sync(step=0, version=0)
        assert sync.sync(step=1, version=1)["weight_sync/verified_tensors"] > 0
        groups["rollout"].plant_adapter_fault("base")  # for good: it goes last
        with pytest.raises(Exception, match=r"was generated with the base model \(no adapter\), while the engine "
                                            r"serves adapter policy-v1 \(id \d+\)"):
            groups["rollout"].generate(_prompts(tok, seed=1))
    finally:
        _shutdown(groups)
