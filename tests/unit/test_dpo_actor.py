"""The actor's preference step (single process): its gradient is the DPO loss's gradient computed the
plain way (one full forward per response, the published formula), for any micro-batch split; its
statistics are TRL's; the held-out scoring gives each response's log-probability."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from hybridflow.config.schema import ActorConfig, HybridFlowConfig, OptimConfig
from hybridflow.controller import WorkerContext
from hybridflow.data.preference import encode_pairs, synthetic_pairs
from hybridflow.data.tokenizer import load_tokenizer
from recipes.roles import actor_role

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
    actor = actor_role(config, model_dir).build(WorkerContext())
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
        assert stats["actor/preference_loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
        assert stats["actor/reward_margin"] == pytest.approx(float(torch.stack(margins).mean()), rel=1e-4, abs=1e-6)
        assert stats["actor/reward_accuracy"] == pytest.approx(float((torch.stack(margins) > 0).float().mean()))
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
