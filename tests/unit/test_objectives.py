"""Adding an objective is one new file (hybridflow/training/objectives): an objective defined here, outside
the package, runs through the trained roles' one loop (hybridflow.training.loop, here by `ActorWorker._train`:
accumulation, the loss scale, clipping, the schedule, the reduction over ranks) with nothing else changed. Minus the mean log-prob of
the trained tokens is SFT's token-mean cross-entropy written anew, so its step equals `train_sft`'s
for any micro-batch split; a batch without a column the objective needs is refused naming it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from hybridflow.algos import masked_mean
from hybridflow.batch import Batch
from hybridflow.config.schema import ActorConfig, HybridFlowConfig, OptimConfig
from hybridflow.controller import WorkerContext
from hybridflow.data import ArithmeticSpec, make_arithmetic_rows
from hybridflow.data.prompts import encode_prompts
from hybridflow.run.stage import prepare_stage
from hybridflow.training.objectives import Objective
from hybridflow.training.sequences import loss_mask, response_log_probs
from recipes.roles import actor_role


class MeanLogProb(Objective):
    """Minus the mean log-prob of the trained tokens of the whole batch, one step; reports the mean."""

    epochs = 1
    whole_batch = True

    def loss(self, model, micro, counts):
        log_probs, _ = response_log_probs(model, micro, with_entropy=False)
        mask = loss_mask(micro)
        loss = -(log_probs * mask).sum() / counts["global_token_count"]
        return loss, {"mean_log_prob": masked_mean(log_probs.detach(), mask)}


class NeedsAdvantages(MeanLogProb):
    needs = (*Objective.needs, "advantages")


def _batch(model_dir) -> Batch:
    tok = AutoTokenizer.from_pretrained(model_dir)
    generator = torch.Generator().manual_seed(0)
    batch = encode_prompts(make_arithmetic_rows(6, ArithmeticSpec(), seed=2), tok, 8)
    mask = torch.arange(4)[None, :] < torch.tensor([4, 1, 3, 2, 4, 2])[:, None]
    return batch.union(Batch({"response_ids": torch.randint(5, 60, (6, 4), generator=generator), "response_mask": mask}))


def _actor(model_dir, rows_per_micro: int):
    config = HybridFlowConfig(actor=ActorConfig(samples_per_micro_batch=rows_per_micro,
                                                optim=OptimConfig(lr=1e-3, max_grad_norm=0.0)))
    worker = actor_role(prepare_stage(config).config, model_dir).build(WorkerContext())
    worker.start()
    return worker


def _gradients(worker) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in worker.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("rows_per_micro", [1, 4])
def test_an_objective_defined_outside_the_package_runs_through_the_workers_loop(tiny_model_dir, rows_per_micro):
    sft, custom = _actor(tiny_model_dir, 6), _actor(tiny_model_dir, rows_per_micro)
    for worker in (sft, custom):
        worker.optimizer.step = lambda: None  # the step's gradients stay to be compared
        worker.free_gradients = lambda: None  # (the loop frees them after an update)
    want = sft.train_sft(_batch(tiny_model_dir))
    got = custom._train(_batch(tiny_model_dir), MeanLogProb())
    assert got["actor/loss"] == pytest.approx(want["actor/loss"], rel=1e-5)
    assert got["mean_log_prob"] == pytest.approx(-got["actor/loss"], rel=1e-5)  # token-weighted over micro-batches
    assert got["actor/grad_norm"] == pytest.approx(want["actor/grad_norm"], rel=1e-4)
    assert got["actor/lr"] == want["actor/lr"] and custom.updates == 1
    assert {k for k in want if k.startswith(("perf/", "precision/"))} <= set(got)
    want_grads, got_grads = _gradients(sft), _gradients(custom)
    assert want_grads.keys() == got_grads.keys() and any(g.abs().sum() > 0 for g in got_grads.values())
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_batch_without_a_column_the_objective_needs_is_refused_naming_it(tiny_model_dir):
    worker = _actor(tiny_model_dir, 6)
    with pytest.raises(KeyError, match=r"NeedsAdvantages needs the batch columns \['advantages'\]"):
        worker._train(_batch(tiny_model_dir), NeedsAdvantages())
    assert worker.updates == 0


def test_an_update_frees_its_gradients_before_anything_after_it(tiny_model_dir):
    """The loop sets every gradient to None once the update's last optimizer step is taken, so the weight
    sync after it holds none (hybridflow/checks/memory_budget.py's GPU "weight sync" phase counts none); the
    update's grad norm is read before, and the next update trains as before."""
    worker = _actor(tiny_model_dir, 2)
    seen = []
    step = worker.optimizer.step

    def recording_step(*args, **kwargs):  # the gradients exist at each optimizer step
        seen.append(sum(p.grad is not None for p in worker.model.parameters()))
        return step(*args, **kwargs)
    worker.optimizer.step = recording_step
    batch = _batch(tiny_model_dir)
    batch = batch.union(worker.compute_log_probs(batch)).union(
        Batch({"advantages": torch.linspace(-1, 1, 6)[:, None].expand(6, 4).contiguous()}))
    for _ in range(2):
        stats = worker.update_policy(batch)
        assert stats["actor/grad_norm"] > 0
        assert [n for n, p in worker.model.named_parameters() if p.grad is not None] == []
    assert seen and all(n == len(list(worker.model.parameters())) for n in seen), seen
    assert worker.train_sft(batch)["actor/grad_norm"] > 0 and all(p.grad is None for p in worker.model.parameters())
