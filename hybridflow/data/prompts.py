"""Turning data rows into a prompt Batch of fixed-width, left-padded token ids."""

from __future__ import annotations

import torch

from hybridflow.batch import Batch
from hybridflow.data.chat import is_chat, render_prompt


def encode_prompts(rows: list[dict], tokenizer, max_prompt_tokens: int, source: str = "data") -> Batch:
    """A Batch with `prompt_ids` (B, P) left-padded, `prompt_mask` (B, P) True on real tokens,
    and every column of the rows as per-sample objects. P is `max_prompt_tokens` for every
    batch, so batches from different ranks concatenate.

    A chat prompt (a list of {role, content} messages, verl's layout) is rendered with the
    tokenizer's chat template: the `prompt` object is then the rendered text, the text the model
    saw and reward functions receive, and `prompt_messages` keeps the messages.
    """
    pad = tokenizer.pad_token_id
    if pad is None:
        raise ValueError("tokenizer of the model has no pad token; set one (e.g. tokenizer.pad_token = tokenizer.eos_token)")
    ids = torch.full((len(rows), max_prompt_tokens), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), max_prompt_tokens), dtype=torch.bool)
    texts = []
    for i, row in enumerate(rows):
        try:
            text = render_prompt(row["prompt"], tokenizer)
        except ValueError as exc:
            raise ValueError(f"{source}: sample {i}: {exc}") from None
        texts.append(text)
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(tokens) > max_prompt_tokens:
            raise ValueError(
                f"{source}: prompt of sample {i} ({text[:60]!r}...) has {len(tokens)} tokens, more than "
                f"data.max_prompt_tokens={max_prompt_tokens}; raise data.max_prompt_tokens or shorten the prompt")
        if tokens:
            ids[i, -len(tokens):] = torch.tensor(tokens)
            mask[i, -len(tokens):] = True
    columns = sorted({k for row in rows for k in row})
    objects = {k: [row.get(k) for row in rows] for k in columns}
    if any(is_chat(row["prompt"]) for row in rows):
        objects["prompt_messages"] = [row["prompt"] if is_chat(row["prompt"]) else None for row in rows]
    objects["prompt"] = texts
    return Batch(tensors={"prompt_ids": ids, "prompt_mask": mask}, objects=objects)
