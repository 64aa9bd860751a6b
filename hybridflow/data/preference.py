"""Preference data: (prompt, chosen, rejected) rows, as TRL's DPOTrainer reads them, and their batches.

A row has `prompt` (text, or a list of chat messages) and `chosen` / `rejected` responses: text, or
(TRL's conversational form) a list of messages whose last is the assistant's turn, e.g.
`[{"role": "assistant", "content": "82"}]`. The prompt is encoded as every prompt is
(`encode_prompts`: a chat prompt through the tokenizer's chat template, with the generation
prompt); each response is its text's tokens followed by EOS, as SFT's answers are.

A pair batch has one row per pair: `prompt_ids` / `prompt_mask` (B, P), `chosen_ids` /
`chosen_mask` and `rejected_ids` / `rejected_mask` (B, R). The actor and the reference score a pair
batch as 2B sequences (`pair_sequences`: the chosen responses, then the rejected), so one forward
pass covers both halves of every pair and a micro-batch or a rank never holds half a pair.
"""

from __future__ import annotations

import random

import torch

from hybridflow.batch import Batch
from hybridflow.data.answers import encode_answers
from hybridflow.data.prompts import encode_prompts

RESPONSE_COLUMNS = ("chosen", "rejected")


def response_text(value, column: str, row: int, where: str) -> str:
    """The text of one response cell: a string, or the content of the last message of a list of
    chat messages (TRL's conversational form). Anything else raises naming the row and the fix."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and value and isinstance(value[-1], dict) and \
            isinstance(value[-1].get("content"), str):
        if value[-1].get("role", "assistant") != "assistant":
            raise ValueError(f"{where}, column {column!r}, row {row}: the last message's role is "
                             f"{value[-1].get('role')!r}; fix: end each {column} conversation with the assistant's turn")
        return value[-1]["content"]
    raise ValueError(f"{where}, column {column!r}, row {row}: {type(value).__name__} {str(value)[:60]!r} is not a "
                     f"response; fix: give text, or a list of chat messages ending with "
                     f"{{'role': 'assistant', 'content': ...}}")


def response_lengths(rows: list[dict], tokenizer, column: str, where: str) -> list[int]:
    """Tokens each row's `column` response takes with its EOS (as `encode_pairs` writes it)."""
    texts = [response_text(row.get(column), column, i, where) for i, row in enumerate(rows)]
    return [len(ids) + 1 for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []


def long_response_problems(rows: list[dict], tokenizer, limit: int, where: str) -> list[str]:
    """The problems, one per column, naming `where` and the rows, when a chosen or rejected response
    (with EOS) needs more than `limit` tokens (rollout.max_response_tokens)."""
    problems = []
    for column in RESPONSE_COLUMNS:
        long = [(i, n) for i, n in enumerate(response_lengths(rows, tokenizer, column, where)) if n > limit]
        if long:
            listed = ", ".join(str(i) for i, _ in long[:5]) + (f" and {len(long) - 5} more" if len(long) > 5 else "")
            problems.append(f"{where}, column {column!r}, row(s) {listed}: row {long[0][0]}'s response needs "
                            f"{long[0][1]} tokens with EOS, more than rollout.max_response_tokens={limit}; fix: raise "
                            f"rollout.max_response_tokens to {max(n for _, n in long)}, or shorten those responses")
    return problems


def encode_pairs(rows: list[dict], tokenizer, max_prompt_tokens: int, max_response_tokens: int,
                 where: str = "preference data", truncation: str = "error") -> Batch:
    """The pair batch of `rows` (module docstring); every column of the rows kept as objects."""
    prompts = encode_prompts(rows, tokenizer, max_prompt_tokens, source=where, truncation=truncation)
    tensors = {"prompt_ids": prompts["prompt_ids"], "prompt_mask": prompts["prompt_mask"]}
    for column in RESPONSE_COLUMNS:
        texts = [response_text(row.get(column), column, i, where) for i, row in enumerate(rows)]
        encoded = encode_answers(texts, tokenizer, max_response_tokens)
        tensors[f"{column}_ids"], tensors[f"{column}_mask"] = encoded["response_ids"], encoded["response_mask"]
    return Batch(tensors=tensors)


def pair_sequences(pairs: Batch) -> Batch:
    """2B sequences of a pair batch: rows 0..B-1 the chosen responses, B..2B-1 the rejected, each
    after its prompt (`prompt_ids`, `prompt_mask`, `response_ids`, `response_mask`)."""
    return Batch(tensors={
        "prompt_ids": torch.cat([pairs["prompt_ids"], pairs["prompt_ids"]]),
        "prompt_mask": torch.cat([pairs["prompt_mask"], pairs["prompt_mask"]]),
        "response_ids": torch.cat([pairs["chosen_ids"], pairs["rejected_ids"]]),
        "response_mask": torch.cat([pairs["chosen_mask"], pairs["rejected_mask"]]),
    })


def pair_sums(token_log_probs: torch.Tensor, response_mask: torch.Tensor, per_token: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected), (B,) each: the log-probability of each response (its tokens' sum over
    `response_mask`), or its mean per token with `per_token` (the length-normalised losses), from the
    (2B, R) token log-probs of `pair_sequences`."""
    mask = response_mask.to(token_log_probs.dtype)
    sums = (token_log_probs * mask).sum(dim=1)
    if per_token:
        sums = sums / mask.sum(dim=1).clamp(min=1)
    half = sums.shape[0] // 2
    return sums[:half], sums[half:]


def near_miss(answer: str, rng: random.Random) -> str:
    """A wrong answer close to a numeric `answer`: one digit moved by one (the slip a dropped or an
    extra carry makes), never a leading zero and never the answer itself."""
    digits = list(answer)
    positions = [i for i, c in enumerate(digits) if c.isdigit()]
    if not positions:
        raise ValueError(f"near_miss: answer {answer!r} has no digit to change")
    i = rng.choice(positions)
    value = int(digits[i])
    choices = [v for v in (value - 1, value + 1) if 0 <= v <= 9 and not (v == 0 and i == positions[0] and len(positions) > 1)]
    digits[i] = str(rng.choice(choices))
    return "".join(digits)


def synthetic_pairs(rows: list[dict], seed: int) -> list[dict]:
    """Preference rows from task rows with a numeric `ground_truth`: chosen the right answer,
    rejected a near miss of it (`near_miss`), drawn from `seed` and the row's position only."""
    rng = random.Random(seed)
    return [{**row, "chosen": str(row["ground_truth"]), "rejected": near_miss(str(row["ground_truth"]), rng)}
            for row in rows]
