"""Sequences as the model sees them: left-padded prompt + right-padded response.

Every batch that reaches a model has `prompt_ids` (B, P) left-padded with `prompt_mask`, and
`response_ids` (B, R) right-padded with `response_mask` (True on generated tokens). The model
input is their concatenation (B, P+R); position ids count real tokens only, so left padding
does not shift positions. The logits that predict response token t sit at position P-1+t.
"""

from __future__ import annotations

from typing import Iterator

import torch

from hybridflow.batch import Batch


def model_inputs(batch: Batch) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask and position_ids (each (B, P+R)) for a prompt+response batch."""
    input_ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1)
    position_ids = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)
    return {"input_ids": input_ids, "attention_mask": attention_mask.long(), "position_ids": position_ids}


def response_logits(model: torch.nn.Module, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
    """Logits (B, R, V) predicting each response token, divided by the sampling temperature."""
    inputs = model_inputs(batch)
    prompt_len = batch["prompt_ids"].shape[1]
    width = batch["response_ids"].shape[1]
    logits = model(**inputs, use_cache=False).logits  # (B, P+R, V)
    logits = logits[:, prompt_len - 1 : prompt_len - 1 + width].float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    return logits


def micro_batches(batch: Batch, rows_per_micro_batch: int) -> Iterator[Batch]:
    yield from batch.split(rows_per_micro_batch)


def mini_batches(batch: Batch, rows_per_mini_batch: int, generator: torch.Generator | None = None) -> list[Batch]:
    """Shuffled mini-batches of equal size (the caller checks divisibility)."""
    order = torch.randperm(len(batch), generator=generator) if generator is not None else torch.arange(len(batch))
    return batch.reorder(order).split(rows_per_mini_batch)


@torch.no_grad()
def log_probs_and_entropy(model: torch.nn.Module, batch: Batch, rows_per_micro_batch: int,
                          temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the response tokens and the entropy at each position, (B, R) each, 0 on padding."""
    from hybridflow.algos import entropy_from_logits, log_probs_from_logits

    model.eval()
    parts_lp, parts_ent = [], []
    for micro in micro_batches(batch, rows_per_micro_batch):
        logits = response_logits(model, micro, temperature)
        mask = micro["response_mask"]
        parts_lp.append(log_probs_from_logits(logits, micro["response_ids"]) * mask)
        parts_ent.append(entropy_from_logits(logits) * mask)
    return torch.cat(parts_lp), torch.cat(parts_ent)
