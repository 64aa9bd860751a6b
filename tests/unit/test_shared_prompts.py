"""Shared prompts (hybridflow/training/shared_prompts.py) compute what unshared packing computes: each
group's prompt once, every response attending to it, the same log-probs, entropies and gradients for
the zoo's architectures; the same actor update, reference log-probs and critic values; micro-batches
that keep a group together and count its prompt once; and the CUDA path's layout, through a CPU
stand-in for PyTorch's variable-length kernel."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridflow.batch import Batch
from hybridflow.builders.architectures import ARCHITECTURES, build_tiny_architecture
from hybridflow.config.schema import ActorConfig, CriticConfig, HybridFlowConfig, ModelConfig, OptimConfig
from hybridflow.controller import WorkerContext
from hybridflow.training.packing import choose_packing, pack, packed_attention, packing_unsupported
from hybridflow.training.shared_prompts import (choose_sharing, prompt_groups, shared_attention,
                                                shared_varlen_attention, shares_prompts)
from hybridflow.training.sequences import (computed_tokens, loss_mask, micro_batch_rows, response_log_probs,
                                          row_facts, token_budget_groups)
from recipes.roles import actor_role, critic_role, reference_role
from hybridflow.run.stage import prepare_stage

PROMPT_WIDTH, RESPONSE_WIDTH = 8, 7
# (prompt, response tokens) per row: a group of 4 (responses of 5, 1, 0 and 7 tokens), a row of its own,
# a group of 3 with a row of the first group's prompt between its rows (groups go by tokens, not order)
PROMPTS = [0, 0, 0, 0, 1, 2, 0, 2, 2]
RESPONSES = [5, 1, 0, 7, 4, 3, 2, 6, 1]
PROMPT_LENGTHS = {0: 6, 1: 3, 2: 8}


def _batch(vocab: int = 40, seed: int = 0) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    prompts = {k: torch.randint(3, vocab, (n,), generator=generator) for k, n in PROMPT_LENGTHS.items()}
    rows = len(PROMPTS)
    prompt_ids = torch.zeros(rows, PROMPT_WIDTH, dtype=torch.long)
    prompt_mask = torch.zeros(rows, PROMPT_WIDTH, dtype=torch.bool)
    response_mask = torch.zeros(rows, RESPONSE_WIDTH, dtype=torch.bool)
    for i, (k, r) in enumerate(zip(PROMPTS, RESPONSES)):
        prompt_ids[i, PROMPT_WIDTH - len(prompts[k]):] = prompts[k]
        prompt_mask[i, PROMPT_WIDTH - len(prompts[k]):] = True
        response_mask[i, :r] = True
    response_ids = torch.randint(3, vocab, (rows, RESPONSE_WIDTH), generator=generator) * response_mask
    advantages = torch.randn(rows, 1, generator=generator).expand(rows, RESPONSE_WIDTH).contiguous()
    return Batch({"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids,
                  "response_mask": response_mask, "advantages": advantages})


def _pack(batch: Batch, share: bool):
    return pack(batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"], batch["response_mask"], share=share)


def test_prompt_groups_go_by_the_prompts_tokens():
    batch = _batch()
    assert prompt_groups(batch["prompt_ids"], batch["prompt_mask"]) == [0, 0, 0, 0, 1, 2, 0, 2, 2]


def test_a_shared_pack_holds_each_prompt_once_and_points_at_each_response_tokens_predecessor():
    batch = _batch()
    shared, unshared = _pack(batch, True), _pack(batch, False)
    # prompts 6 (once for 5 rows) + 3 + 8 (once for 3 rows), responses 29
    assert shared.input_ids.shape == (1, 6 + 3 + 8 + sum(RESPONSES))
    assert unshared.input_ids.shape == (1, sum(PROMPT_LENGTHS[k] for k in PROMPTS) + sum(RESPONSES))
    # every response token is predicted by the same token, at the same position, as unshared
    for name in ("input_ids", "position_ids"):
        assert torch.equal(getattr(shared, name)[0, shared.predicting], getattr(unshared, name)[0, unshared.predicting])
    assert torch.equal(shared.response_index, unshared.response_index)
    # the group of four's prompt's last position predicts the first token of each of its three responses
    first_tokens = shared.predicting[torch.tensor([0, 5, 6])]
    assert first_tokens.tolist() == [5, 5, 5]


def test_a_batch_with_nothing_to_share_packs_as_unshared():
    batch = _batch().index([0, 4, 5])  # three different prompts
    shared, unshared = _pack(batch, True), _pack(batch, False)
    assert shared.shared is None
    for name in ("input_ids", "position_ids", "cu_seq_lens", "predicting"):
        assert torch.equal(getattr(shared, name), getattr(unshared, name)), name


def _masked(values: torch.Tensor, batch: Batch) -> torch.Tensor:
    return values * loss_mask(batch)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_shared_log_probs_entropies_and_gradients_equal_unshared_packings_for_the_zoo(architecture, tmp_path):
    model_dir = build_tiny_architecture(architecture, tmp_path / architecture)
    batch = _batch(vocab=200)
    models = {name: AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32) for name in ("one", "shared")}
    if packing_unsupported(models["shared"]) is not None:  # Gemma2: padded, so nothing to share; `true` says why
        packed = choose_packing(models["shared"], None)
        assert choose_sharing(models["shared"], None, packed) is False
        with pytest.raises(ValueError, match="model.share_prompts=true.*does not run packed"):
            choose_sharing(models["shared"], True, packed)
        return
    assert choose_sharing(models["one"], False, choose_packing(models["one"], True)) is False
    assert choose_sharing(models["shared"], None, choose_packing(models["shared"], True)) is True
    assert shares_prompts(models["shared"]) and not shares_prompts(models["one"])
    results = {}
    for name, model in models.items():
        log_probs, entropy = response_log_probs(model, batch)
        (_masked(log_probs, batch).sum() + 0.1 * _masked(entropy, batch).sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[name] = (_masked(log_probs, batch).detach(), _masked(entropy, batch).detach(), grads)
    torch.testing.assert_close(results["shared"][0], results["one"][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results["shared"][1], results["one"][1], atol=1e-5, rtol=1e-5)
    assert results["shared"][2].keys() == results["one"][2].keys() and results["one"][2]
    for name, grad in results["one"][2].items():  # the prompt's gradient: the sum over its group
        torch.testing.assert_close(results["shared"][2][name], grad, atol=1e-5, rtol=1e-4, msg=name)


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """What PyTorch's varlen kernel computes with window_size=(-1, 0), one sequence at a time: causal
    aligned at the bottom right (query t of an lq-token sequence sees keys up to t + lk - lq)."""
    out = []
    for s in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[s]:cu_q[s + 1]], k[cu_k[s]:cu_k[s + 1]], v[cu_k[s]:cu_k[s + 1]]
        lq, lk = len(qs), len(ks)
        visible = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        out.append(torch.nn.functional.scaled_dot_product_attention(
            qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), attn_mask=visible, scale=scale).transpose(0, 1))
    return torch.cat(out)


def test_the_cuda_paths_layout_computes_what_the_cpu_path_does_through_a_stand_in_kernel():
    """The layout `shared_varlen_attention` gives the kernel (queries in packed order, the prompt's keys
    gathered in front of each response's) equals the CPU path's two calls, values and gradients."""
    packed = _pack(_batch(), True)
    generator = torch.Generator().manual_seed(1)
    tokens = packed.input_ids.shape[1]
    base = [torch.randn(1, 4, tokens, 8, generator=generator) for _ in range(3)]
    outs, grads = {}, {}
    for name in ("cpu", "varlen"):
        q, k, v = (t.clone().requires_grad_() for t in base)
        if name == "cpu":
            out = shared_attention(q, k, v, packed.shared, scaling=None, dropout=0.0)
        else:
            out = shared_varlen_attention(q, k, v, packed.shared, None, _reference_varlen)
        (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        outs[name], grads[name] = out.detach(), [t.grad for t in (q, k, v)]
    torch.testing.assert_close(outs["varlen"], outs["cpu"], atol=1e-6, rtol=1e-5)
    for a, b in zip(grads["varlen"], grads["cpu"]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_a_model_that_drops_the_layout_is_refused_rather_than_attending_across_responses():
    packed = _pack(_batch(), True)
    q = k = v = torch.zeros(1, 2, packed.input_ids.shape[1], 4)
    module = torch.nn.Module()
    kwargs = packed.model_kwargs()
    with pytest.raises(ValueError, match="drop keyword arguments; set model.share_prompts=false"):
        packed_attention(module, q, k, v, None, cu_seq_lens_q=kwargs["cu_seq_lens_q"],
                         max_length_q=kwargs["max_length_q"], cu_seq_lens_k=kwargs["cu_seq_lens_k"])


# ---- micro-batches ---------------------------------------------------------------------------------


def test_micro_batches_keep_a_group_together_and_count_its_prompt_once():
    lengths = [PROMPT_LENGTHS[k] for k in PROMPTS]
    shared = token_budget_groups(lengths, RESPONSES, 24, packed=True, prompt_groups=PROMPTS)
    # group 0: 6 + 15 = 21 tokens, group 2: 8 + 10 = 18, row 4: 7 (unshared the rows would need 80)
    assert sorted(shared) == [[0, 1, 2, 3, 6], [4], [5, 7, 8]] or sorted(shared) == [[0, 1, 2, 3, 6], [4, 5, 7, 8]]
    # a group over the budget goes row by row
    split = token_budget_groups(lengths, RESPONSES, 19, packed=True, prompt_groups=PROMPTS)
    assert sorted(i for g in split for i in g) == list(range(len(PROMPTS)))
    assert not any({0, 1, 2, 3, 6} <= set(g) for g in split)
    # as many micro-batches as another rank needs: a single group's rows go apart
    assert len(token_budget_groups([6, 6, 6], [1, 2, 3], 100, packed=True, groups_at_least=2,
                                   prompt_groups=[0, 0, 0])) == 2


@pytest.mark.parametrize("budget", [None, 20])
def test_computed_tokens_are_the_packed_rows_tokens(budget):
    batch = _batch()
    facts = row_facts(batch, share=True)
    rows = micro_batch_rows(batch, 3, budget, packed=True, share=True, facts=facts)
    counts = computed_tokens(facts, rows, packed=True)
    assert counts["perf/computed_tokens"] == sum(_pack(batch.index(r), True).input_ids.shape[1] for r in rows)
    unshared = computed_tokens(row_facts(batch), rows, packed=True)
    assert unshared["perf/computed_tokens"] == sum(_pack(batch.index(r), False).input_ids.shape[1] for r in rows)
    assert unshared["perf/sharing_saved_tokens"] == 0 and counts["perf/sharing_saved_tokens"] == unshared["perf/computed_tokens"] - counts["perf/computed_tokens"]
    full = len(PROMPTS) * (PROMPT_WIDTH + RESPONSE_WIDTH)
    for c in (counts, unshared):
        assert c["perf/computed_tokens"] + c["perf/sharing_saved_tokens"] + c["perf/padding_saved_tokens"] == full
    if budget is None:  # one micro-batch: groups of 5 and 3 rows share 4 x 6 + 2 x 8 prompt tokens
        assert counts["perf/sharing_saved_tokens"] == 4 * 6 + 2 * 8


# ---- the workers --------------------------------------------------------------------------------


def _config(share: bool, tokens: int | None = None, gradient_checkpointing: bool = False) -> HybridFlowConfig:
    return HybridFlowConfig(model=ModelConfig(pack_sequences=True, share_prompts=share),
                            actor=ActorConfig(optim=OptimConfig(lr=1e-2), samples_per_micro_batch=3,
                                              tokens_per_micro_batch=tokens, gradient_checkpointing=gradient_checkpointing,
                                              kl_loss_coef=0.1, entropy_coef=0.01),
                            critic=CriticConfig(optim=OptimConfig(lr=1e-2), samples_per_micro_batch=3))


@pytest.mark.parametrize("tokens,gradient_checkpointing", [(None, False), (20, False), (None, True)])
def test_the_actors_shared_update_equals_its_unshared_update(tiny_model_dir, tokens, gradient_checkpointing):
    """One micro-batch; a budget of 20 tokens (the group of four goes row by row); activation
    checkpointing's recomputation (the layout reaches attention again in the backward pass)."""
    batch = _batch()
    results = {}
    for share in (False, True):
        config = _config(share, tokens, gradient_checkpointing)
        reference = reference_role(prepare_stage(config).config, tiny_model_dir).build(WorkerContext())
        reference.start()
        actor = actor_role(prepare_stage(config).config, tiny_model_dir).build(WorkerContext())
        assert actor.start()["shared_prompts"] is share
        scored = batch.union(actor.compute_log_probs(batch)).union(reference.compute_ref_log_probs(batch))
        actor.free_gradients = lambda: None  # the update's gradients stay to be compared
        stats = actor.update_policy(scored)
        grads = {n: p.grad.clone() for n, p in actor.model.named_parameters()}
        results[share] = (scored["old_log_probs"], scored["ref_log_probs"], stats, grads)
    torch.testing.assert_close(results[True][0], results[False][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results[True][1], results[False][1], atol=1e-5, rtol=1e-5)
    for key in ("actor/loss", "policy_loss", "kl_loss", "actor/entropy", "actor/grad_norm"):
        assert results[True][2][key] == pytest.approx(results[False][2][key], rel=1e-4, abs=1e-7), key
    for name, grad in results[False][3].items():
        torch.testing.assert_close(results[True][3][name], grad, atol=1e-6, rtol=1e-4, msg=name)
    shared, unshared = results[True][2], results[False][2]
    assert shared["perf/computed_tokens"] < unshared["perf/computed_tokens"]
    assert shared["perf/sharing_saved_tokens"] == unshared["perf/computed_tokens"] - shared["perf/computed_tokens"]
    assert unshared["perf/sharing_saved_tokens"] == 0
    assert shared["perf/padding_saved_tokens"] == unshared["perf/padding_saved_tokens"]


def test_the_critics_shared_values_equal_its_unshared_values(tiny_model_dir):
    batch = _batch()
    values = {}
    for share in (False, True):
        critic = critic_role(prepare_stage(_config(share)).config, tiny_model_dir).build(WorkerContext())
        critic.start()
        values[share] = critic.compute_values(batch)["values"]
    torch.testing.assert_close(values[True], values[False], atol=1e-5, rtol=1e-4)


def test_share_prompts_true_without_packing_is_refused_in_the_config():
    with pytest.raises(ValueError, match="model.share_prompts=True.*pack_sequences"):
        ModelConfig(pack_sequences=False, share_prompts=True)


def test_mini_batches_of_a_sharing_model_hold_whole_groups():
    from hybridflow.training.sequences import mini_batches

    batch = _batch().index([0, 1, 2, 3, 6, 4, 5, 7, 8, 4])  # groups of 5, 2 and 3 rows
    for seed in range(4):
        minis = mini_batches(batch, 5, torch.Generator().manual_seed(seed), share=True)
        assert [len(m) for m in minis] == [5, 5]
        joined = torch.cat([m["prompt_ids"] for m in minis])
        runs = prompt_groups(joined, joined != 0)
        assert [g for k, g in enumerate(runs) if k == 0 or runs[k - 1] != g] == sorted(set(runs), key=runs.index)
    # one mini-batch, or a model that does not share: the row shuffle as before
    shuffled = batch.reorder(torch.randperm(10, generator=torch.Generator().manual_seed(0)))["prompt_ids"]
    plain = mini_batches(batch, 5, torch.Generator().manual_seed(0))
    whole = mini_batches(batch, 10, torch.Generator().manual_seed(0), share=True)
    assert torch.equal(torch.cat([m["prompt_ids"] for m in plain]), shuffled)
    assert torch.equal(whole[0]["prompt_ids"], shuffled)
