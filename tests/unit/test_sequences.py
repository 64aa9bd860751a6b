"""Trimming all-padding columns before the forward pass changes no logit or value."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from hybridflow.batch import Batch
from hybridflow.training.sequences import model_inputs, response_log_probs, trimmed_inputs


def _batch() -> Batch:
    # Prompts left-padded to 8 columns (real lengths 3 and 5), responses right-padded to 6
    # (real lengths 2 and 4): columns 0-2 and 10-13 are padding in every row.
    prompt_ids = torch.tensor([[0, 0, 0, 0, 0, 7, 8, 9], [0, 0, 0, 4, 5, 6, 7, 8]])
    prompt_mask = prompt_ids != 0
    response_ids = torch.tensor([[3, 2, 0, 0, 0, 0], [9, 8, 7, 2, 0, 0]])
    response_mask = response_ids != 0
    return Batch({"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids,
                  "response_mask": response_mask})


def _model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return Qwen2ForCausalLM(config).eval()


def test_trimmed_inputs_drop_only_all_padding_columns():
    inputs, prompt_len, response_len = trimmed_inputs(_batch())
    assert (prompt_len, response_len) == (5, 4)  # 8 - 3 leading pad columns; 4 of 6 response columns
    assert inputs["input_ids"].shape == (2, 9)
    # positions count real tokens, as before trimming
    assert inputs["position_ids"][1].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert inputs["position_ids"][0, 2:7].tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_response_log_probs_equal_the_untrimmed_forward(temperature):
    """Trimmed columns, logits at the response positions only, one row at a time: the same numbers
    as log-softmax over the whole untrimmed forward's logits."""
    model, batch = _model(), _batch()
    with torch.no_grad():
        full = model(**model_inputs(batch), use_cache=False).logits[:, 7:13] / temperature  # P - 1 = 7, R = 6
        log_probs, entropy = response_log_probs(model, batch, temperature)
    expected_lp = torch.log_softmax(full, -1).gather(-1, batch["response_ids"][..., None])[..., 0]
    expected_ent = -(torch.softmax(full, -1) * torch.log_softmax(full, -1)).sum(-1)
    mask = batch["response_mask"]
    assert log_probs.shape == entropy.shape == (2, 6)
    torch.testing.assert_close(log_probs[mask], expected_lp[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy[mask], expected_ent[mask], rtol=1e-5, atol=1e-5)
    assert torch.all(log_probs[:, 4:] == 0) and torch.all(entropy[:, 4:] == 0)  # past every response


def test_response_log_probs_without_logits_to_keep_are_the_same(monkeypatch):
    """A model whose forward does not take `logits_to_keep` (remote code) is sliced after the forward."""
    from hybridflow.training import sequences

    model, batch = _model(), _batch()
    with torch.no_grad():
        kept = response_log_probs(model, batch)
        monkeypatch.setitem(sequences._LOGITS_TO_KEEP, type(model), False)
        sliced = response_log_probs(model, batch)
    torch.testing.assert_close(kept, sliced, rtol=1e-5, atol=1e-6)


def test_a_row_without_response_tokens_keeps_one_column():
    batch = _batch()
    batch.tensors["response_mask"] = torch.zeros_like(batch["response_mask"])
    _, prompt_len, response_len = trimmed_inputs(batch)
    assert (prompt_len, response_len) == (5, 1)


def _agent_batch() -> Batch:
    # One two-turn trajectory: model tokens 3 2 | tool output 5 6 | model tokens 7 1, then padding.
    batch = _batch()
    batch.tensors["response_ids"] = torch.tensor([[3, 2, 5, 6, 7, 1], [9, 8, 7, 2, 0, 0]])
    batch.tensors["response_mask"] = batch["response_ids"] != 0
    batch.tensors["loss_mask"] = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    return batch


def test_loss_mask_leaves_tool_tokens_out_of_the_loss_but_attention_sees_them():
    from hybridflow.training.sequences import log_probs_and_entropy, loss_mask

    model, batch = _model(), _agent_batch()
    inputs = model_inputs(batch)
    # attention covers the tool tokens (columns 8 + 2, 8 + 3 of row 0): they are real input
    assert inputs["attention_mask"][0, 10:12].tolist() == [1, 1]
    assert inputs["input_ids"][0, 8:].tolist() == [3, 2, 5, 6, 7, 1]
    # ... while the loss mask, and so the log-probs, leave them out
    assert loss_mask(batch)[0].tolist() == [True, True, False, False, True, True]
    log_probs, entropy = log_probs_and_entropy(model, batch, rows_per_micro_batch=2)
    assert log_probs[0, 2:4].tolist() == [0.0, 0.0] and entropy[0, 2:4].tolist() == [0.0, 0.0]
    assert torch.all(log_probs[0, [0, 1, 4, 5]] < 0)
    # the model tokens after the tool output are conditioned on it: changing a tool token changes
    # the log-prob of the next model token (attention saw it), not that of the tokens before it
    changed = _agent_batch()
    changed.tensors["response_ids"][0, 3] = 11
    changed_lp, _ = log_probs_and_entropy(model, changed, rows_per_micro_batch=2)
    assert torch.equal(changed_lp[0, :2], log_probs[0, :2])
    assert not torch.allclose(changed_lp[0, 4], log_probs[0, 4])


def test_without_a_loss_mask_every_response_token_is_trained():
    from hybridflow.training.sequences import loss_mask

    batch = _batch()
    assert torch.equal(loss_mask(batch), batch["response_mask"])
