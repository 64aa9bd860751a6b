"""Supervised targets: the answer tokens that follow a prompt, for SFT."""

from __future__ import annotations

import torch

from hybridflow.batch import Batch


def encode_answers(answers: list[str], tokenizer, max_response_tokens: int) -> Batch:
    """`response_ids` (B, R) right-padded: answer tokens then EOS; `response_mask` True on them."""
    ids = torch.full((len(answers), max_response_tokens), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(answers), max_response_tokens), dtype=torch.bool)
    for i, answer in enumerate(answers):
        tokens = tokenizer(str(answer), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        if len(tokens) > max_response_tokens:
            raise ValueError(f"SFT answer of sample {i} ({str(answer)[:40]!r}) needs {len(tokens)} tokens with EOS, "
                             f"more than rollout.max_response_tokens={max_response_tokens}; raise it")
        ids[i, : len(tokens)] = torch.tensor(tokens)
        mask[i, : len(tokens)] = True
    return Batch(tensors={"response_ids": ids, "response_mask": mask})
