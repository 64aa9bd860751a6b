"""Samples whose advantages are all zero are left out of the policy update's forward/backward,
and the gradient is the same as with every sample (single process, no Ray)."""

from __future__ import annotations

import torch
from transformers import AutoTokenizer

from hybridflow.batch import Batch
from hybridflow.controller import WorkerContext
from hybridflow.data import ArithmeticSpec, make_arithmetic_rows
from hybridflow.data.prompts import encode_prompts
from hybridflow.config.schema import ActorConfig, HybridFlowConfig, OptimConfig
from recipes.roles import actor_role
from hybridflow.run.stage import prepare_stage
from hybridflow.training.objectives import PolicyObjective


def _batch(model_dir) -> Batch:
    tok = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(0)
    batch = encode_prompts(make_arithmetic_rows(8, ArithmeticSpec(), seed=5), tok, 8)
    mask = torch.rand(8, 4) > 0.3
    mask[:, 0] = True
    advantages = torch.randn(8, 4)
    advantages[[0, 2, 3, 6]] = 0.0  # four groups where every sample scored the same
    return batch.union(Batch({"response_ids": torch.randint(5, 60, (8, 4)), "response_mask": mask,
                              "old_log_probs": -torch.rand(8, 4) * 3, "advantages": advantages}))


def _gradients(model_dir, batch: Batch, **actor) -> tuple[dict[str, torch.Tensor], dict]:
    config = HybridFlowConfig(actor=ActorConfig(samples_per_micro_batch=2, optim=OptimConfig(max_grad_norm=0.0), **actor))
    worker = actor_role(prepare_stage(config).config, model_dir).build(WorkerContext())
    worker.start()
    worker.optimizer.step = lambda: None  # keep the gradients of the one mini-batch to compare
    worker.model.train()
    stats, figures = worker.train_mini_batch(batch, PolicyObjective(worker.cfg, worker.temperature), world=1)
    return {n: p.grad.clone() for n, p in worker.model.named_parameters()}, {**stats, **figures}


def test_skipping_zero_advantage_samples_keeps_the_gradient(tiny_model_dir):
    batch = _batch(tiny_model_dir)
    every, every_stats = _gradients(tiny_model_dir, batch, skip_zero_advantage_samples=False)
    skipped, skipped_stats = _gradients(tiny_model_dir, batch, skip_zero_advantage_samples=True)
    assert every_stats["actor/trained_sample_fraction"] == 1.0
    assert skipped_stats["actor/trained_sample_fraction"] == 0.5
    assert abs(every_stats["loss"] - skipped_stats["loss"]) < 1e-6
    for name in every:
        torch.testing.assert_close(skipped[name], every[name], atol=1e-6, rtol=1e-4, msg=name)


def test_no_skipping_when_the_loss_has_an_entropy_term(tiny_model_dir):
    # The entropy bonus has a gradient on every sample, advantage or not.
    _, stats = _gradients(tiny_model_dir, _batch(tiny_model_dir), entropy_coef=0.01)
    assert stats["actor/trained_sample_fraction"] == 1.0
