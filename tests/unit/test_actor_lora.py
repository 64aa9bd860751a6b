"""The actor with a LoRA adapter (single process): folded weights for the rollout, reference
log-probs with the adapter disabled, and only adapter weights trained."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.batch import Batch
from hybridflow.controller import WorkerContext
from hybridflow.data import ArithmeticSpec, make_arithmetic_rows
from hybridflow.data.prompts import encode_prompts
from hybridflow.resharding.weights import full_weights
from hybridflow.config.schema import ActorConfig, HybridFlowConfig, LoraConfig, OptimConfig
from recipes.roles import actor_role
from hybridflow.run.stage import prepare_stage
from workers.actor import ActorWorker


def _actor(model_dir) -> ActorWorker:
    lora = LoraConfig(rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj"])
    config = HybridFlowConfig(actor=ActorConfig(optim=OptimConfig(lr=1e-2), lora=lora))
    actor = actor_role(prepare_stage(config).config, model_dir).build(WorkerContext())
    actor.start()
    return actor


def _batch(model_dir) -> Batch:
    tok = AutoTokenizer.from_pretrained(model_dir)
    batch = encode_prompts(make_arithmetic_rows(4, ArithmeticSpec(), seed=0), tok, 8)
    torch.manual_seed(0)
    return batch.union(Batch({"response_ids": torch.randint(5, 60, (4, 3)), "response_mask": torch.ones(4, 3, dtype=torch.bool),
                              "advantages": torch.randn(4, 1).expand(4, 3).contiguous()}))


def test_lora_update_folds_into_hf_named_weights_and_reference_stays_base(tiny_model_dir):
    actor = _actor(tiny_model_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    base_params = dict(base.named_parameters())
    batch = _batch(tiny_model_dir)
    batch = batch.union(actor.compute_log_probs(batch))
    ref_before = actor.compute_ref_log_probs(batch)["ref_log_probs"]
    torch.testing.assert_close(ref_before, batch["old_log_probs"])  # B starts at zero: adapter is a no-op

    actor.update_policy(batch)
    folded = dict(full_weights(actor.model))
    assert set(folded) == set(base_params), "folded names must be the plain Hugging Face names"
    changed = {n for n in folded if not torch.equal(folded[n], base_params[n].detach())}
    assert changed and all("q_proj.weight" in n or "v_proj.weight" in n for n in changed)
    # the reference (adapter disabled) is still the base model after the update
    torch.testing.assert_close(actor.compute_ref_log_probs(batch)["ref_log_probs"], ref_before)
    # and the folded weights reproduce the adapted model's log-probs
    base.load_state_dict(folded, strict=False)
    adapted = actor.compute_log_probs(batch)["old_log_probs"]
    actor.model = base
    torch.testing.assert_close(actor.compute_log_probs(batch)["old_log_probs"], adapted, atol=1e-5, rtol=0)
