"""The actor's side of the step hooks (single process): `load_weights` takes Hugging Face
named full tensors (the tied lm_head may be absent) and optionally clears Adam's moments;
`scale_lr` multiplies the lr of the next update only; both updates (SFT and policy) report the
loss and gradient norm the hooks watch."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from hybridflow.config.schema import ActorConfig, HybridFlowConfig, OptimConfig
from hybridflow.controller import WorkerContext
from hybridflow.data.corpus import sequence_batch
from recipes.roles import actor_role
from hybridflow.run.stage import prepare_stage
from workers.actor import ActorWorker


def _actor(model_dir) -> ActorWorker:
    config = HybridFlowConfig(actor=ActorConfig(optim=OptimConfig(lr=1e-2)))
    actor = actor_role(prepare_stage(config).config, model_dir).build(WorkerContext())
    actor.start()
    return actor


def _batch():
    torch.manual_seed(0)
    return sequence_batch(torch.randint(5, 60, (4, 6)), start_token_id=1)


def test_load_weights_restores_exact_tensors_and_resets_the_optimizer(tiny_model_dir):
    actor = _actor(tiny_model_dir)
    saved = load_file(tiny_model_dir / "model.safetensors")  # hf names, no lm_head (tied)
    assert "lm_head.weight" not in saved
    actor.train_sft(_batch())
    assert actor.optimizer.state
    actor.load_weights(saved, reset_optimizer=True)
    state = actor.model.state_dict()
    for key, value in saved.items():
        assert torch.equal(state[key], value), key
    assert torch.equal(state["lm_head.weight"], saved["model.embed_tokens.weight"])  # still tied
    assert not actor.optimizer.state
    with pytest.raises(KeyError, match="unexpected"):
        actor.load_weights({**saved, "extra.weight": torch.zeros(1)})


def test_scale_lr_lasts_one_update(tiny_model_dir):
    actor = _actor(tiny_model_dir)
    assert actor.scale_lr(100.0) == pytest.approx(1.0)  # 1e-2 * 100
    stats = actor.train_sft(_batch())
    assert stats["actor/lr"] == pytest.approx(1e-2)  # the scheduler set the next update's lr again


def test_both_updates_report_what_the_step_hooks_read(tiny_model_dir):
    from hybridflow.training.hooks import GRAD_NORM_KEY, LOSS_KEY

    actor = _actor(tiny_model_dir)
    batch = _batch()
    sft = actor.train_sft(batch)
    batch = batch.union(actor.compute_log_probs(batch))  # old_log_probs, (B, T)
    batch.tensors["advantages"] = torch.randn(batch["old_log_probs"].shape)
    policy = actor.update_policy(batch)
    for stats in (sft, policy):  # recipe=pretrain / sft, and the RL recipes
        assert {LOSS_KEY, GRAD_NORM_KEY} <= set(stats), sorted(stats)
