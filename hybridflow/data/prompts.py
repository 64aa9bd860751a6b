"""Turning data rows into a prompt Batch of fixed-width, left-padded token ids, and fitting a
data set's prompts to `data.max_prompt_tokens` before the run starts.

`data.prompt_truncation` says what a prompt longer than the limit means, for every row of the
training and validation data, checked in one pass before Ray starts (`fit_prompt_lengths`):
`error` (the default) stops naming the rows, `left` keeps the prompt's last tokens (its BOS
kept), `filter` leaves the row out and the count is reported. Text prompts start with the BOS
token where the model's tokenizer adds one (hybridflow/data/tokenizer.py).
"""

from __future__ import annotations

import torch

from hybridflow.batch import Batch
from hybridflow.data.chat import is_chat, render_prompt
from hybridflow.data.tokenizer import say_once, text_prefix

TRUNCATIONS = ("error", "left", "filter")


def prompt_token_ids(prompts: list, tokenizer, first_index: int = 0) -> tuple[list[str], list[list[int]]]:
    """(texts, token ids) of prompts as the model sees them: chat messages rendered with the chat
    template (which writes its own BOS), text with the tokenizer's BOS when it adds one. An error
    names the sample (numbered from `first_index`)."""
    texts = []
    for i, prompt in enumerate(prompts):
        try:
            texts.append(render_prompt(prompt, tokenizer))
        except ValueError as exc:
            raise ValueError(f"sample {first_index + i}: {exc}") from None
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    prefix = text_prefix(tokenizer)
    if prefix:
        ids = [tokens if is_chat(prompt) else prefix + tokens for prompt, tokens in zip(prompts, ids)]
    return texts, ids


def truncate_left(tokens: list[int], limit: int, bos_token_id: int | None) -> list[int]:
    """The last `limit` tokens, keeping a leading BOS."""
    if len(tokens) <= limit:
        return tokens
    keep = 1 if bos_token_id is not None and tokens[:1] == [bos_token_id] and limit > 1 else 0
    return tokens[:keep] + tokens[len(tokens) - (limit - keep):]


def encode_prompts(rows: list[dict], tokenizer, max_prompt_tokens: int, source: str = "data",
                   truncation: str = "error") -> Batch:
    """A Batch with `prompt_ids` (B, P) left-padded, `prompt_mask` (B, P) True on real tokens,
    and every column of the rows as per-sample objects. P is `max_prompt_tokens` for every
    batch, so batches from different ranks concatenate. A longer prompt is cut on the left with
    `truncation="left"` (data.prompt_truncation), else an error.

    A chat prompt (a list of {role, content} messages, verl's layout) is rendered with the
    tokenizer's chat template: the `prompt` object is then the rendered text, the text the model
    saw and reward functions receive, and `prompt_messages` keeps the messages.
    """
    pad = tokenizer.pad_token_id
    if pad is None:
        raise ValueError("tokenizer of the model has no pad token; load it with hybridflow.data.tokenizer."
                         "load_tokenizer (the EOS token then serves as pad)")
    ids = torch.full((len(rows), max_prompt_tokens), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), max_prompt_tokens), dtype=torch.bool)
    try:
        texts, token_ids = prompt_token_ids([row["prompt"] for row in rows], tokenizer)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    for i, tokens in enumerate(token_ids):
        if len(tokens) > max_prompt_tokens:
            if truncation != "left":
                raise ValueError(
                    f"{source}: prompt of sample {i} ({texts[i][:60]!r}...) has {len(tokens)} tokens, more than "
                    f"data.max_prompt_tokens={max_prompt_tokens}; raise data.max_prompt_tokens, shorten the prompt, "
                    "or set data.prompt_truncation=left|filter")
            tokens = truncate_left(tokens, max_prompt_tokens, tokenizer.bos_token_id)
        if tokens:
            ids[i, -len(tokens):] = torch.tensor(tokens)
            mask[i, -len(tokens):] = True
    columns = sorted({k for row in rows for k in row})
    objects = {k: [row.get(k) for row in rows] for k in columns}
    if any(is_chat(row["prompt"]) for row in rows):
        objects["prompt_messages"] = [row["prompt"] if is_chat(row["prompt"]) else None for row in rows]
    objects["prompt"] = texts
    return Batch(tensors={"prompt_ids": ids, "prompt_mask": mask}, objects=objects)


def over_long_prompts(rows: list[dict], tokenizer, limit: int, chunk_rows: int = 4096) -> list[tuple[int, int]]:
    """(row index, token count) of every row whose prompt has more than `limit` tokens."""
    long = []
    for start in range(0, len(rows), chunk_rows):
        _, token_ids = prompt_token_ids([row["prompt"] for row in rows[start:start + chunk_rows]], tokenizer, start)
        long += [(start + i, len(tokens)) for i, tokens in enumerate(token_ids) if len(tokens) > limit]
    return long


def fit_prompt_lengths(rows: list[dict], tokenizer, limit: int, truncation: str, where: str) -> list[dict]:
    """Every row's prompt checked against `limit` tokens (data.max_prompt_tokens) before the run
    starts. `where` names the file and key. Returns the rows to use: all of them (`error`, `left`)
    or those that fit (`filter`, the count said on the console). With `error`, over-long rows raise
    `InputError` naming them."""
    from hybridflow.data.checks import InputError

    long = over_long_prompts(rows, tokenizer, limit)
    if not long:
        return rows
    listed = ", ".join(str(row) for row, _ in long[:5]) + (f" and {len(long) - 5} more" if len(long) > 5 else "")
    counted = f"{len(long)} of {len(rows)} rows of {where} have prompts longer than data.max_prompt_tokens={limit}"
    if truncation == "error":
        raise InputError(f"{where}, column 'prompt', row(s) {listed}: row {long[0][0]} has {long[0][1]} tokens, more "
                         f"than data.max_prompt_tokens={limit}; fix: raise data.max_prompt_tokens to "
                         f"{max(n for _, n in long)}, shorten the prompts, or set data.prompt_truncation=left "
                         "(keep their last tokens) or filter (leave those rows out)")
    if truncation == "left":
        say_once(f"hybridflow: {counted}: their first tokens are cut (data.prompt_truncation=left; rows {listed})")
        return rows
    dropped = {row for row, _ in long}
    say_once(f"hybridflow: {counted}: left out (data.prompt_truncation=filter; rows {listed}); "
             f"{len(rows) - len(dropped)} rows remain")
    return [row for i, row in enumerate(rows) if i not in dropped]
