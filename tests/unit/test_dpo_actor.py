"""The actor's preference step (single process): its gradient is the DPO loss's gradient computed the
plain way (one full forward per response, the published formula), for any micro-batch split; its
statistics are TRL's, under TRL's names; the held-out scoring gives each response's log-probability;
the reference log-probs of the training pairs are computed once and reused (recipes/dpo.py
`ReferenceScores`, dpo.reuse_reference_log_probs), with the per-step path's losses, and computed
again when the reference changes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from hybridflow.config.schema import ActorConfig, HybridFlowConfig, OptimConfig
from hybridflow.controller import WorkerContext
from hybridflow.data.preference import encode_pairs, synthetic_pairs
from hybridflow.data.tokenizer import load_tokenizer
from recipes.dpo import ReferenceScores
from recipes.roles import actor_role, reference_role
from hybridflow.run.stage import prepare_stage

BETA = 0.1


def _pairs(model_dir, count=6):
    tokenizer = load_tokenizer(model_dir)
    rows = synthetic_pairs([{"prompt": f"{a}+{a * 7 % 50}=", "ground_truth": str(a + a * 7 % 50)}
                            for a in range(3, 3 + count)], seed=0)
    pairs = encode_pairs(rows, tokenizer, max_prompt_tokens=8, max_response_tokens=4)
    generator = torch.Generator().manual_seed(1)
    return pairs.union(type(pairs)(tensors={"ref_chosen_log_probs": -5 - torch.rand(count, generator=generator),
                                            "ref_rejected_log_probs": -5 - torch.rand(count, generator=generator)}))


def _actor(model_dir, rows_per_micro: int):
    config = HybridFlowConfig(actor=ActorConfig(optim=OptimConfig(lr=1e-3, max_grad_norm=0.0),
                                                samples_per_micro_batch=rows_per_micro))
    actor = actor_role(prepare_stage(config).config, model_dir).build(WorkerContext())
    actor.start()
    return actor


def _plain_sum(model, prompt_ids, prompt_mask, response_ids, response_mask) -> torch.Tensor:
    """log pi(response | prompt) of one pair half: the real tokens only, one forward, no padding."""
    tokens = torch.cat([prompt_ids[prompt_mask], response_ids[response_mask]])[None]
    log_probs = torch.log_softmax(model(tokens).logits[0, :-1].float(), dim=-1)
    targets = tokens[0, 1:]
    picked = log_probs.gather(1, targets[:, None])[:, 0]
    return picked[-int(response_mask.sum()):].sum()


def _grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[name.replace("_fsdp_wrapped_module.", "")] = grad.clone()
    return out


def test_the_preference_step_has_the_plain_dpo_gradient_for_any_micro_batch_split(tiny_model_dir):
    pairs = _pairs(tiny_model_dir)
    results = {}
    for rows in (2, 4, 12):  # one pair per micro-batch, two (not dividing 6 pairs), all
        actor = _actor(tiny_model_dir, rows)
        actor.free_gradients = lambda: None  # the update's gradients stay to be compared
        stats = actor.train_preference(pairs, loss="sigmoid", beta=BETA)
        results[rows] = stats, _grads(actor.model)

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    losses, margins = [], []
    for i in range(len(pairs)):
        chosen = _plain_sum(model, pairs["prompt_ids"][i], pairs["prompt_mask"][i], pairs["chosen_ids"][i],
                            pairs["chosen_mask"][i])
        rejected = _plain_sum(model, pairs["prompt_ids"][i], pairs["prompt_mask"][i], pairs["rejected_ids"][i],
                              pairs["rejected_mask"][i])
        h = (chosen - pairs["ref_chosen_log_probs"][i]) - (rejected - pairs["ref_rejected_log_probs"][i])
        losses.append(-F.logsigmoid(BETA * h))  # Rafailov et al. 2023, eq. 7
        margins.append(BETA * h.detach())
    loss = torch.stack(losses).mean()
    loss.backward()
    plain = {n: p.grad for n, p in model.named_parameters()}

    for rows, (stats, grads) in results.items():
        assert stats["actor/loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
        assert stats["rewards/margins"] == pytest.approx(float(torch.stack(margins).mean()), rel=1e-4, abs=1e-6)
        assert stats["rewards/accuracies"] == pytest.approx(float((torch.stack(margins) > 0).float().mean()))
        assert stats["rewards/chosen"] - stats["rewards/rejected"] == pytest.approx(stats["rewards/margins"], abs=1e-6)
        assert stats["logps/chosen"] < 0 and stats["logps/rejected"] < 0
        assert stats["actor/lr"] >= 0 and stats["actor/grad_norm"] > 0
        for name, grad in plain.items():
            if name == "lm_head.weight" and name not in grads:
                continue  # tied to the embedding: its gradient is in model.embed_tokens.weight
            torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-4, msg=f"{rows} rows: {name}")


def test_the_held_out_scoring_gives_each_responses_log_probability(tiny_model_dir):
    pairs = _pairs(tiny_model_dir, count=3)
    actor = _actor(tiny_model_dir, 4)
    scored = actor.compute_pair_log_probs(pairs)
    per_token = actor.compute_pair_log_probs(pairs, per_token=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for i in range(3):
            for half in ("chosen", "rejected"):
                expected = _plain_sum(model, pairs["prompt_ids"][i], pairs["prompt_mask"][i], pairs[f"{half}_ids"][i],
                                      pairs[f"{half}_mask"][i])
                assert float(scored[f"{half}_log_probs"][i]) == pytest.approx(float(expected), rel=1e-5)
                tokens = int(pairs[f"{half}_mask"][i].sum())
                assert float(per_token[f"{half}_log_probs"][i]) == pytest.approx(float(expected) / tokens, rel=1e-5)
    with pytest.raises(RuntimeError, match="needs actor.lora.rank > 0"):
        actor.compute_ref_pair_log_probs(pairs)


def test_reference_log_probs_are_computed_once_across_steps_and_give_the_per_step_losses(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    config = HybridFlowConfig(actor=ActorConfig(samples_per_micro_batch=4))
    reference = reference_role(prepare_stage(config).config, tiny_model_dir).build(WorkerContext())
    reference.start()
    scored = []

    def score(pairs):
        scored.append(len(pairs))
        return reference.compute_ref_pair_log_probs(pairs)

    rows = synthetic_pairs([{"prompt": f"{a}+{a * 7 % 50}=", "ground_truth": str(a + a * 7 % 50)}
                            for a in range(3, 9)], seed=0)
    steps = [rows[:4], rows[2:], rows[:4], rows[1:5]]  # later steps draw pairs drawn before, in other batches
    cache = ReferenceScores(score, reuse=True)
    reused, per_step = _actor(tiny_model_dir, 4), _actor(tiny_model_dir, 4)
    for step_rows in steps:
        pairs = encode_pairs(step_rows, tokenizer, max_prompt_tokens=8, max_response_tokens=4)
        fresh = reference.compute_ref_pair_log_probs(pairs)  # the per-step path: scored every step
        cached = cache.of(step_rows, pairs)
        torch.testing.assert_close(cached["ref_chosen_log_probs"], fresh["ref_chosen_log_probs"], rtol=1e-6, atol=1e-6)
        a = reused.train_preference(pairs.union(cached), loss="sigmoid", beta=BETA)
        b = per_step.train_preference(pairs.union(fresh), loss="sigmoid", beta=BETA)
        for key in ("actor/loss", "rewards/margins", "rewards/chosen", "logps/rejected"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    assert scored == [4, 2] and cache.scored_pairs == 6  # each of the 6 pairs once, over 4 steps

    # the reference changes (a reference hook loads new weights): the cached numbers are stale
    with torch.no_grad():
        for parameter in reference.model.parameters():
            parameter.mul_(1.05)
    pairs = encode_pairs(rows[:4], tokenizer, max_prompt_tokens=8, max_response_tokens=4)
    stale = cache.of(rows[:4], pairs)
    cache.invalidate("step 4")
    renewed = cache.of(rows[:4], pairs)
    assert scored == [4, 2, 4]
    torch.testing.assert_close(renewed["ref_chosen_log_probs"],
                               reference.compute_ref_pair_log_probs(pairs)["ref_chosen_log_probs"])
    assert not torch.allclose(renewed["ref_chosen_log_probs"], stale["ref_chosen_log_probs"])
    without = ReferenceScores(score, reuse=False)  # dpo.reuse_reference_log_probs=false: every call scores
    without.of(rows[:4], pairs), without.of(rows[:4], pairs)
    assert scored == [4, 2, 4, 4, 4] and without.scored_pairs == 8
