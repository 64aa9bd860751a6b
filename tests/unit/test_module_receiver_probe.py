"""The Hugging Face receiver's probe gives the model's own log-probs (what the sync check compares
with the actor's), not generation scores that a logits processor has already reshaped."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from hybridflow.resharding.receiver import ModuleReceiver


def test_probe_log_probs_equal_a_plain_forward(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    prompt = [3, 4, 5, 6, 7, 8]
    tokens, log_probs = ModuleReceiver(model, pad_token_id=0).probe(prompt, 4)
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].double()
    expected = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None])[:, 0]
    # with min_new_tokens, generate's `scores` drop EOS and renormalise (off by ~1e-2 on this model)
    torch.testing.assert_close(log_probs, expected, atol=1e-6, rtol=0)
