"""One mini-batch's gradient does not depend on how it is cut (issue 87: ms-swift #10117 and TRL PR
#6024 divided the loss by the accumulation steps twice for some aggregation modes). The real actor
and critic on the tiny model in float32, one process: the policy loss under every aggregation mode,
SFT's cross-entropy and the critic's value loss, each with micro-batches of 1, 2 and 4 samples, a
token budget, packed and padded — every gradient equal to the whole batch's padded one within 1e-5
relative and 1e-6 absolute (float32's summation order: on an AVX2-only EPYC one of the critic's 16,384
embedding gradients, 3e-3, moved 1.5e-7); and the planted fault (the loss divided once more by the number of micro-batches) is seen.
Over ranks: the same batch split over 2 FSDP2 ranks on gloo (each rank's loss times the world size
before FSDP2 averages the gradients) gives the 1-rank gradient, for the policy loss under every
aggregation mode, SFT and the critic, padded and packed under a token budget; the planted fault
(the world-size factor left out, halving the gradient) is seen there too."""

from __future__ import annotations

import socket

import pytest
import torch
from transformers import AutoTokenizer

from hybridflow.algos import LOSS_AGGREGATIONS
from hybridflow.batch import Batch
from hybridflow.config.schema import ActorConfig, CriticConfig, HybridFlowConfig, ModelConfig, OptimConfig
from hybridflow.controller import WorkerContext
from hybridflow.data import ArithmeticSpec, make_arithmetic_rows
from hybridflow.data.prompts import encode_prompts
from hybridflow.run.stage import prepare_stage
from hybridflow.training.objectives import PolicyObjective, SFTObjective, TopKDistillObjective, ValueObjective
from recipes.roles import actor_role, critic_role

ROWS = 8
# (samples_per_micro_batch, tokens_per_micro_batch, packed): the whole batch padded is the reference
SPLITS = [(1, None, False), (2, None, False), (4, None, True), (ROWS, None, True), (ROWS, 12, True), (3, None, False)]


def _batch(model_dir) -> Batch:
    tok = AutoTokenizer.from_pretrained(model_dir)
    generator = torch.Generator().manual_seed(0)
    batch = encode_prompts(make_arithmetic_rows(ROWS, ArithmeticSpec(), seed=5), tok, 8)
    lengths = torch.tensor([5, 2, 4, 1, 3, 5, 2, 4])  # ragged responses, right-padded: token counts differ by row
    mask = torch.arange(5)[None, :] < lengths[:, None]  # (B, R)
    return batch.union(Batch({"response_ids": torch.randint(5, 60, (ROWS, 5), generator=generator),
                              "response_mask": mask, "old_log_probs": -torch.rand(ROWS, 5, generator=generator) * 3,
                              "advantages": torch.randn(ROWS, 5, generator=generator),
                              "values": torch.randn(ROWS, 5, generator=generator),
                              "returns": torch.randn(ROWS, 5, generator=generator),
                              "teacher_topk_ids": torch.randint(5, 60, (ROWS, 5, 3), generator=generator),
                              "teacher_topk_log_probs": -torch.rand(ROWS, 5, 3, generator=generator) * 3}))


def _config(section: str, micro: int, budget: int | None, packed: bool, **options) -> HybridFlowConfig:
    optim = OptimConfig(max_grad_norm=0.0)
    role = dict(samples_per_micro_batch=micro, tokens_per_micro_batch=budget, optim=optim, **options)
    return HybridFlowConfig(model=ModelConfig(pack_sequences=packed, share_prompts=False),
                            **{section: (ActorConfig if section == "actor" else CriticConfig)(**role)})


def _keep_gradients(worker):
    worker.optimizer.step = lambda: None  # the one mini-batch's gradients stay to be compared
    worker.model.train()
    return worker


def _gradients(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda detail, name=name: f"{what}: {name}\n{detail}")


def _actor(model_dir, split, loss, aggregation="token-mean", divide_by_micro_batches=False):
    config = prepare_stage(_config("actor", *split, loss_aggregation=aggregation)).config
    worker = actor_role(config, model_dir).build(WorkerContext())
    worker.start()
    _keep_gradients(worker)
    objective = {"policy": lambda: PolicyObjective(worker.cfg, worker.temperature), "sft": SFTObjective,
                 "topk": lambda: TopKDistillObjective(beta=0.5)}[loss]()
    if divide_by_micro_batches:  # the planted fault: the accumulation steps divided out a second time
        count, plain = -(-ROWS // split[0]), objective.loss
        objective.loss = lambda model, micro, counts: (lambda loss, stats: (loss / count, stats))(  # noqa: E731
            *plain(model, micro, counts))
    stats, figures = worker.train_mini_batch(_batch(model_dir), objective, world=1)
    return _gradients(worker.model), {**stats, **figures}


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS.names())
def test_the_policy_gradient_is_the_same_for_every_micro_batch_split(tiny_model_dir, aggregation):
    whole, whole_stats = _actor(tiny_model_dir, (ROWS, None, False), "policy", aggregation)
    assert any(g.abs().sum() > 0 for g in whole.values())
    for split in SPLITS:
        grads, stats = _actor(tiny_model_dir, split, "policy", aggregation)
        _assert_same(grads, whole, f"{aggregation} {split}")
        assert stats["loss"] == pytest.approx(whole_stats["loss"], rel=1e-5, abs=1e-7), split


@pytest.mark.parametrize("loss", ["sft", "topk"])
def test_the_sft_and_top_k_distillation_gradients_are_the_same_for_every_micro_batch_split(tiny_model_dir, loss):
    """SFT's, and the top-k distillation's (the student's log-probs at the teacher's ids, gathered from the
    packed row or the padded batch), for every split and layout."""
    whole, whole_stats = _actor(tiny_model_dir, (ROWS, None, False), loss)
    assert any(g.abs().sum() > 0 for g in whole.values())
    for split in SPLITS:
        grads, stats = _actor(tiny_model_dir, split, loss)
        _assert_same(grads, whole, f"{loss} {split}")
        assert stats["loss"] == pytest.approx(whole_stats["loss"], rel=1e-5), split


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS.names())
def test_the_critic_gradient_is_the_same_for_every_micro_batch_split(tiny_model_dir, aggregation):
    def critic(split):
        config = prepare_stage(_config("critic", *split, loss_aggregation=aggregation)).config
        worker = _keep_gradients(_started(critic_role(config, tiny_model_dir).build(WorkerContext())))
        stats, figures = worker.train_mini_batch(_batch(tiny_model_dir), _value(worker), world=1)
        return _gradients(worker.model), {**stats, **figures}

    whole, whole_stats = critic((ROWS, None, False))
    assert any(g.abs().sum() > 0 for g in whole.values())
    for split in SPLITS:
        grads, stats = critic(split)
        _assert_same(grads, whole, f"critic {aggregation} {split}")
        for key in ("loss", "critic/value_loss", "critic/value_mean"):  # a loss part and a token-weighted mean
            assert stats[key] == pytest.approx(whole_stats[key], rel=1e-5, abs=1e-7), (key, split)


def _value(worker) -> ValueObjective:
    return ValueObjective(worker.cfg.value_clip_range, worker.cfg.loss_aggregation)


def test_a_loss_divided_twice_is_caught_by_the_split_comparison(tiny_model_dir):
    """The fault planted: each micro-batch's loss divided by the number of micro-batches once more
    (ms-swift #10117). The whole batch is one micro-batch and unchanged; four micro-batches give a
    quarter of the gradient, which the comparison above fails on."""
    whole, _ = _actor(tiny_model_dir, (ROWS, None, False), "policy", divide_by_micro_batches=True)
    split, _ = _actor(tiny_model_dir, (2, None, False), "policy", divide_by_micro_batches=True)
    with pytest.raises(AssertionError):
        _assert_same(split, whole, "planted")
    name = "model.embed_tokens.weight"
    torch.testing.assert_close(split[name] * 4, whole[name], rtol=1e-5, atol=1e-7)


# Over 2 ranks: the splits (samples_per_micro_batch, tokens_per_micro_batch, packed) each rank runs its half of the batch with
RANK_SPLITS = [(1, None, False), (4, 12, True)]


def _rank_gradients(rank: int, world: int, port: int, model_dir: str, out_file: str, planted: bool) -> None:
    """One of `world` gloo ranks: every loss and split on this rank's half of the batch; rank 0 saves
    the full (gathered) gradients."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        context = WorkerContext(rank=rank, world_size=world)
        scale = 1 if planted else world  # planted: the per-rank loss without the world-size factor
        batch = _batch(model_dir)
        half = batch.chunk(world)[rank]
        out = {}
        for split in RANK_SPLITS:
            for aggregation in LOSS_AGGREGATIONS.names():
                config = prepare_stage(_config("actor", *split, loss_aggregation=aggregation)).config
                worker = _keep_gradients(_started(actor_role(config, model_dir).build(context)))
                worker.train_mini_batch(half, PolicyObjective(worker.cfg, worker.temperature), world=scale)
                out[("policy", aggregation, split)] = _full_gradients(worker.model)
                config = prepare_stage(_config("critic", *split, loss_aggregation=aggregation)).config
                worker = _keep_gradients(_started(critic_role(config, model_dir).build(context)))
                worker.train_mini_batch(half, _value(worker), world=scale)
                out[("critic", aggregation, split)] = _full_gradients(worker.model)
            config = prepare_stage(_config("actor", *split)).config
            worker = _keep_gradients(_started(actor_role(config, model_dir).build(context)))
            worker.train_mini_batch(half, SFTObjective(), world=scale)
            out[("sft", None, split)] = _full_gradients(worker.model)
        if rank == 0:
            torch.save(out, out_file)
    finally:
        dist.destroy_process_group()


def _started(worker):
    worker.start()
    return worker


def _full_gradients(model) -> dict[str, torch.Tensor]:
    """The whole gradient of each parameter: FSDP2's shards gathered (a DTensor's full_tensor)."""
    grads = {}
    for name, param in model.named_parameters():
        if param.grad is not None:
            grad = param.grad
            grads[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()
    return grads


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _over_two_ranks(model_dir, out_file, planted: bool) -> dict:
    from tests.ranks import start_ranks

    start_ranks(_rank_gradients, (2, _free_port(), str(model_dir), str(out_file), planted), 2, [__name__])
    return torch.load(out_file, weights_only=False)


def _one_rank_reference(model_dir) -> dict:
    """The whole batch on one rank, padded, one micro-batch: each loss's reference gradient."""
    want = {}
    for aggregation in LOSS_AGGREGATIONS.names():
        want[("policy", aggregation)] = _actor(model_dir, (ROWS, None, False), "policy", aggregation)[0]
        config = prepare_stage(_config("critic", ROWS, None, False, loss_aggregation=aggregation)).config
        worker = _keep_gradients(_started(critic_role(config, model_dir).build(WorkerContext())))
        worker.train_mini_batch(_batch(model_dir), _value(worker), world=1)
        want[("critic", aggregation)] = _gradients(worker.model)
    want[("sft", None)] = _actor(model_dir, (ROWS, None, False), "sft")[0]
    return want


def _named(grads: dict) -> dict:
    """FSDP2's parameter names are the plain module's (fully_shard wraps in place)."""
    return {name.replace("_checkpoint_wrapped_module.", ""): g for name, g in grads.items()}


def test_the_gradient_over_two_ranks_equals_one_ranks_for_every_loss_and_split(tiny_model_dir, tmp_path):
    got = _over_two_ranks(tiny_model_dir, tmp_path / "two.pt", planted=False)
    want = _one_rank_reference(tiny_model_dir)
    assert len(got) == len(RANK_SPLITS) * (2 * len(LOSS_AGGREGATIONS.names()) + 1)
    for (loss, aggregation, split), grads in got.items():
        _assert_same(_named(grads), want[(loss, aggregation)], f"2 ranks: {loss} {aggregation} {split}")


def test_a_rank_loss_without_the_world_size_factor_is_caught_by_the_rank_comparison(tiny_model_dir, tmp_path):
    """The fault planted: each rank's loss not multiplied by the world size, so FSDP2's average over the
    ranks halves every gradient; the comparison above fails on it."""
    got = _over_two_ranks(tiny_model_dir, tmp_path / "planted.pt", planted=True)
    want = _one_rank_reference(tiny_model_dir)
    grads = _named(got[("policy", "token-mean", RANK_SPLITS[0])])
    with pytest.raises(AssertionError):
        _assert_same(grads, want[("policy", "token-mean")], "planted")
    name = "model.embed_tokens.weight"
    torch.testing.assert_close(grads[name] * 2, want[("policy", "token-mean")][name], rtol=1e-5, atol=1e-7)
