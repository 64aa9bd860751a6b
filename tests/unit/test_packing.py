"""Packed sequences (hybridflow/training/packing.py) compute what the padded path computes: the same
log-probs and gradients for every architecture in the zoo, the same values for the critic, the
same actor update; and a model that cannot run packed says why. Micro-batches by token budget
(hybridflow/training/sequences.py) cover every row once within the budget and leave log-probs and
gradients as one micro-batch gives them."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridflow.batch import Batch
from hybridflow.builders.architectures import ARCHITECTURES, build_tiny_architecture
from hybridflow.config.schema import ActorConfig, CriticConfig, HybridFlowConfig, ModelConfig, OptimConfig
from hybridflow.controller import WorkerContext
from hybridflow.training.packing import choose_packing, pack, packing_unsupported, runs_packed
from hybridflow.training.sequences import (balanced_over_ranks, loss_mask, micro_batch_rows, rank_balanced_order,
                                          response_log_probs, token_budget_groups)
from recipes.roles import actor_role, critic_role
from hybridflow.run.stage import prepare_stage

# (prompt tokens, response tokens) per row: full rows, short ones, a one-token prompt, an empty response
LENGTHS = [(7, 9), (3, 4), (1, 9), (5, 0), (2, 1), (6, 5)]


def _batch(vocab: int = 200, prompt_width: int = 7, response_width: int = 9, seed: int = 0) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    rows = len(LENGTHS)
    prompt_mask = torch.zeros(rows, prompt_width, dtype=torch.bool)
    response_mask = torch.zeros(rows, response_width, dtype=torch.bool)
    for i, (p, r) in enumerate(LENGTHS):
        prompt_mask[i, prompt_width - p:] = True
        response_mask[i, :r] = True
    prompt_ids = torch.randint(3, vocab, (rows, prompt_width), generator=generator) * prompt_mask
    response_ids = torch.randint(3, vocab, (rows, response_width), generator=generator) * response_mask
    advantages = torch.randn(rows, 1, generator=generator).expand(rows, response_width).contiguous()
    return Batch({"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids,
                  "response_mask": response_mask, "advantages": advantages})


def test_pack_concatenates_real_tokens_and_points_at_each_response_tokens_predecessor():
    batch = _batch()
    packed = pack(batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"], batch["response_mask"])
    lengths = [p + r for p, r in LENGTHS]
    assert packed.input_ids.shape == (1, sum(lengths))
    assert packed.cu_seq_lens.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert packed.max_length == max(lengths)
    starts = packed.cu_seq_lens[:-1].long()
    assert (packed.position_ids[0, starts] == 0).all()  # positions restart with every sequence
    # each response token's predecessor in the packed row is the token before it in its own sequence
    expected_predecessors = []
    for i, (p, r) in enumerate(LENGTHS):
        sequence = [*batch["prompt_ids"][i, 7 - p:].tolist(), *batch["response_ids"][i, :r].tolist()]
        expected_predecessors += sequence[p - 1: p - 1 + r]
    assert packed.input_ids[0, packed.predicting].tolist() == expected_predecessors
    assert packed.input_ids[0, packed.predicting + 1].tolist() == batch["response_ids"][batch["response_mask"]].tolist()


def test_a_row_with_a_response_and_no_prompt_is_not_packed():
    batch = _batch()
    prompt_mask = batch["prompt_mask"].clone()
    prompt_mask[1] = False
    assert pack(batch["prompt_ids"], prompt_mask, batch["response_ids"], batch["response_mask"]) is None


def _masked(values: torch.Tensor, batch: Batch) -> torch.Tensor:
    return values * loss_mask(batch)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_packed_log_probs_and_gradients_equal_the_padded_paths_for_the_zoo(architecture, tmp_path):
    model_dir = build_tiny_architecture(architecture, tmp_path / architecture)
    batch = _batch()
    padded_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    packed_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    reason = packing_unsupported(packed_model)
    if reason is not None:  # the zoo's Gemma2 soft-caps its attention logits: padded, and `true` says why
        assert architecture == "gemma2" and "attn_logit_softcapping" in reason
        assert choose_packing(packed_model, None) is False and not runs_packed(packed_model)
        with pytest.raises(ValueError, match="model.pack_sequences=true.*attn_logit_softcapping.*=false"):
            choose_packing(packed_model, True)
        return
    assert choose_packing(packed_model, None) is True and runs_packed(packed_model)
    assert choose_packing(padded_model, False) is False and not runs_packed(padded_model)

    results = {}
    for name, model in (("padded", padded_model), ("packed", packed_model)):
        log_probs, entropy = response_log_probs(model, batch)
        (_masked(log_probs, batch).sum() + 0.1 * _masked(entropy, batch).sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[name] = (_masked(log_probs, batch).detach(), _masked(entropy, batch).detach(), grads)
    torch.testing.assert_close(results["packed"][0], results["padded"][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results["packed"][1], results["padded"][1], atol=1e-5, rtol=1e-5)
    assert results["packed"][2].keys() == results["padded"][2].keys() and results["padded"][2]
    for name, grad in results["padded"][2].items():
        torch.testing.assert_close(results["packed"][2][name], grad, atol=1e-5, rtol=1e-4, msg=name)
    # past every response the packed path gives 0
    assert (results["packed"][0][~batch["response_mask"]] == 0).all()


def test_packed_log_probs_in_bfloat16_stay_within_its_tolerance(tiny_model_dir):
    batch = _batch(vocab=40)
    padded = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    packed = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    assert choose_packing(packed, True)
    with torch.no_grad():
        a, _ = response_log_probs(padded, batch)
        b, _ = response_log_probs(packed, batch)
    torch.testing.assert_close(_masked(b, batch), _masked(a, batch), atol=0.05, rtol=0.02)


def _config(pack_sequences: bool | None, gradient_checkpointing: bool = False) -> HybridFlowConfig:
    return HybridFlowConfig(model=ModelConfig(pack_sequences=pack_sequences),
                            actor=ActorConfig(optim=OptimConfig(lr=1e-2), samples_per_micro_batch=2,
                                              gradient_checkpointing=gradient_checkpointing),
                            critic=CriticConfig(optim=OptimConfig(lr=1e-2), samples_per_micro_batch=2))


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_the_actors_packed_update_equals_its_padded_update(tiny_model_dir, gradient_checkpointing):
    batch = _batch(vocab=40)
    grads, stats = {}, {}
    for setting in (False, True):
        actor = actor_role(prepare_stage(_config(setting, gradient_checkpointing)).config, tiny_model_dir).build(WorkerContext())
        assert actor.start()["packed_sequences"] is setting
        batch_with_old = batch.union(actor.compute_log_probs(batch))
        actor.free_gradients = lambda: None  # the update's gradients stay to be compared
        stats[setting] = actor.update_policy(batch_with_old)
        grads[setting] = {n: p.grad.clone() for n, p in actor.model.named_parameters()}  # left by the update
    assert stats[True]["actor/grad_norm"] == pytest.approx(stats[False]["actor/grad_norm"], rel=1e-4)
    assert stats[True]["actor/loss"] == pytest.approx(stats[False]["actor/loss"], rel=1e-4, abs=1e-7)
    for name, grad in grads[False].items():  # gradients, not weights: Adam's first step is lr * sign(g)
        torch.testing.assert_close(grads[True][name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_the_critics_packed_values_equal_its_padded_values(tiny_model_dir):
    batch = _batch(vocab=40)
    values = {}
    for setting in (False, True):
        critic = critic_role(prepare_stage(_config(setting)).config, tiny_model_dir).build(WorkerContext())
        critic.start()
        values[setting] = critic.compute_values(batch)["values"]
    torch.testing.assert_close(values[True], values[False], atol=1e-5, rtol=1e-4)


# ---- micro-batches by token budget ----------------------------------------------------------------

PROMPTS_FOR_BUDGET = [20, 1, 10, 30, 2, 5, 12, 1, 9, 4, 50]
RESPONSES_FOR_BUDGET = [10, 4, 2, 10, 5, 2, 10, 2, 9, 5, 10]
LENGTHS_FOR_BUDGET = [p + r for p, r in zip(PROMPTS_FOR_BUDGET, RESPONSES_FOR_BUDGET)]  # 30, 5, 12, 40, ... 60


@pytest.mark.parametrize("packed", [True, False])
def test_token_budget_groups_cover_every_row_once_within_the_budget(packed):
    budget = 50
    groups = token_budget_groups(PROMPTS_FOR_BUDGET, RESPONSES_FOR_BUDGET, budget, packed)
    assert sorted(i for g in groups for i in g) == list(range(len(LENGTHS_FOR_BUDGET)))
    assert all(g == sorted(g) for g in groups)  # each micro-batch's rows in their batch order
    if packed:  # its real tokens
        def cost(g):
            return sum(LENGTHS_FOR_BUDGET[i] for i in g)
    else:  # rows x the width it is trimmed to: its longest prompt + its longest response
        def cost(g):
            return len(g) * (max(PROMPTS_FOR_BUDGET[i] for i in g) + max(RESPONSES_FOR_BUDGET[i] for i in g))
    over = [g for g in groups if cost(g) > budget]
    assert over == [[10]]  # only the 60-token row, alone: a row longer than the budget is its own micro-batch
    if packed:  # as few as the tokens need (213 of them, 50 a micro-batch -> 5), about even
        assert len(groups) == 5
        loads = sorted(cost(g) for g in groups if g != [10])
        assert loads[-1] - loads[0] <= max(LENGTHS_FOR_BUDGET[:10])
    else:  # rows of like length together: each micro-batch is a run of the length-sorted rows
        order = sorted(range(len(LENGTHS_FOR_BUDGET)), key=lambda i: -LENGTHS_FOR_BUDGET[i])
        runs = sorted(groups, key=lambda g: min(order.index(i) for i in g))
        assert [i for g in runs for i in sorted(g, key=order.index)] == order


def test_token_budget_groups_split_to_as_many_as_another_rank_needs():
    groups = token_budget_groups(PROMPTS_FOR_BUDGET, RESPONSES_FOR_BUDGET, 1000, packed=True, groups_at_least=4)
    assert len(groups) == 4 and all(groups)
    assert sorted(i for g in groups for i in g) == list(range(len(LENGTHS_FOR_BUDGET)))
    assert len(token_budget_groups([5, 5], [0, 0], 1000, packed=True, groups_at_least=4)) == 2  # never an empty one


@pytest.mark.parametrize("rows,ranks", [(16, 2), (16, 4), (13, 4), (5, 4), (3, 8)])
def test_rank_balancing_gives_each_rank_of_the_split_about_the_same_tokens(rows, ranks):
    """Generation order puts long responses together (here the lengths fall from first row to last):
    the data-parallel split (padded to a multiple of the ranks, consecutive equal chunks) then gives
    rank 0 the most tokens. After `rank_balanced_order` each rank's real rows are within one row's
    length of every other's, each rank keeps as many real rows as the split gives it, and its rows
    stay in batch order."""
    lengths = [100 - 6 * i for i in range(rows)]
    order = rank_balanced_order(lengths, ranks)
    assert sorted(order) == list(range(rows))
    per = -(-rows // ranks)
    chunks = [order[k * per:(k + 1) * per] for k in range(ranks)]  # what DP_SPLIT hands each rank (pad rows last)
    assert [len(c) for c in chunks] == [min(per, max(0, rows - per * k)) for k in range(ranks)]
    assert all(c == sorted(c) for c in chunks)
    full = [sum(lengths[i] for i in c) for c in chunks if len(c) == per]
    assert max(full) - min(full) <= max(lengths)
    before = [sum(lengths[k * per:(k + 1) * per]) for k in range(ranks) if len(range(rows)[k * per:(k + 1) * per]) == per]
    assert max(full) - min(full) <= max(before) - min(before)
    if (rows, ranks) == (16, 2):  # 880 tokens: 632 / 248 in generation order, 440 / 440 balanced
        assert (before, full) == ([632, 248], [440, 440])
    assert rank_balanced_order(lengths, 1) == list(range(rows))


def test_balanced_batches_carry_every_row_whole():
    batch = _batch()  # rows of 16, 7, 10, 5, 3, 11 real tokens
    balanced = balanced_over_ranks(batch, 2)
    order = rank_balanced_order([p + r for p, r in LENGTHS], 2)
    assert order != list(range(len(LENGTHS)))
    for key in batch.keys():
        assert torch.equal(balanced[key], batch[key][order]), key
    assert [sum(p + r for p, r in (LENGTHS[i] for i in order[k * 3:(k + 1) * 3])) for k in range(2)] == [26, 26]


def _budget_config(samples: int, tokens: int | None, pack_sequences: bool) -> HybridFlowConfig:
    return HybridFlowConfig(model=ModelConfig(pack_sequences=pack_sequences),
                            actor=ActorConfig(optim=OptimConfig(lr=1e-2), samples_per_micro_batch=samples,
                                              tokens_per_micro_batch=tokens))


@pytest.mark.parametrize("pack_sequences", [True, False])
def test_a_token_budget_leaves_log_probs_and_the_updates_gradients_unchanged(tiny_model_dir, pack_sequences):
    batch = _batch(vocab=40)
    results = {}
    for name, samples, tokens in (("one micro-batch", len(LENGTHS), None), ("token budget", 1, 12)):
        actor = actor_role(prepare_stage(_budget_config(samples, tokens, pack_sequences)).config, tiny_model_dir).build(WorkerContext())
        actor.start()
        out = actor.compute_log_probs(batch)
        actor.free_gradients = lambda: None  # the update's gradients stay to be compared
        stats = actor.update_policy(batch.union(out))
        grads = {n: p.grad.clone() for n, p in actor.model.named_parameters()}
        results[name] = (out["old_log_probs"], stats, grads)
    torch.testing.assert_close(results["token budget"][0], results["one micro-batch"][0], atol=1e-5, rtol=1e-5)
    for key in ("actor/loss", "policy_loss", "clip_fraction", "approx_kl", "actor/entropy"):  # split-free stats too
        assert results["token budget"][1][key] == pytest.approx(results["one micro-batch"][1][key], rel=1e-4,
                                                                abs=1e-7), key
    for name, grad in results["one micro-batch"][2].items():
        torch.testing.assert_close(results["token budget"][2][name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_the_default_budget_is_the_rows_full_width_worth():
    batch = _batch()  # rows of 16, 7, 10, 5, 3, 11 real tokens in a width of 7 + 9
    groups = micro_batch_rows(batch, rows_per_micro_batch=2, packed=True)  # 2 x 16 tokens a micro-batch
    assert sorted(i for g in groups for i in g) == list(range(len(LENGTHS)))
    assert all(sum(p + r for p, r in (LENGTHS[i] for i in g)) <= 32 for g in groups)
    assert len(groups) == 2  # 52 real tokens; by rows it would take 3 micro-batches of 2


def _rank_counts(rank: int, port: int, out_dir: str) -> None:
    import json
    from pathlib import Path

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        batch = _batch(seed=rank)
        if rank == 1:  # rank 1's rows are all short: on its own it would need one micro-batch
            batch = Batch({**{k: batch[k] for k in batch.keys()},
                           "prompt_mask": batch["prompt_mask"] & (torch.arange(7) >= 6),
                           "response_mask": batch["response_mask"] & (torch.arange(9) < 1)})
        groups = micro_batch_rows(batch, rows_per_micro_batch=1, tokens_per_micro_batch=16, packed=True)
        Path(out_dir, f"{rank}.json").write_text(json.dumps(groups))
    finally:
        dist.destroy_process_group()


def test_every_rank_runs_as_many_micro_batches_as_the_rank_that_needs_the_most(tmp_path):
    import json
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank_counts, args=(port, str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    groups = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)]
    assert len(groups[0]) == len(groups[1]) > 1  # rank 0's 52 tokens need 4 of 16; rank 1 splits to match
    assert sorted(i for g in groups[1] for i in g) == list(range(len(LENGTHS)))


def test_an_active_sliding_window_stays_padded_and_an_inactive_one_packs():
    from transformers import MistralConfig, Qwen2Config

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=100)
    windowed = AutoModelForCausalLM.from_config(MistralConfig(**shape, sliding_window=4096))
    assert packing_unsupported(windowed) == "MistralConfig.sliding_window=4096 (attention within a window)"
    assert choose_packing(windowed, None) is False
    switched_off = AutoModelForCausalLM.from_config(Qwen2Config(**shape, sliding_window=4096, use_sliding_window=False))
    assert packing_unsupported(switched_off) is None
