"""Preference data: (prompt, chosen, rejected) rows, as TRL's DPOTrainer reads them, and their batches.

TRL's preference formats, each normalised by `preference_row` to a prompt (text or chat messages)
and two response texts:
- explicit prompt: `{"prompt": "2+2=", "chosen": "4", "rejected": "5"}`;
- implicit prompt (no prompt column): `{"chosen": "2+2=4", "rejected": "2+2=5"}`: the prompt is the
  longest shared start (a space before the first difference goes to the responses, as TRL's
  `extract_prompt` does);
- conversational: the prompt as chat messages and each response as messages ending with the
  assistant's turn, `{"prompt": [{"role": "user", ...}], "chosen": [{"role": "assistant", ...}], ...}`,
  or without a prompt column, chosen and rejected as whole conversations that share everything
  before their final assistant turn;
- multi-turn: a response of several messages trains its final assistant turn; the conversation
  before it joins the prompt, and must be the same in chosen and rejected (it is the prompt of both).
A row that fits none of them raises naming the place, row, column and fix; nothing is dropped.

The prompt is encoded as every prompt is (`encode_prompts`: a chat prompt through the tokenizer's
chat template, with the generation prompt); each response is its text's tokens followed by EOS, as
SFT's answers are. A pair longer than its limits (the prompt's data.max_prompt_tokens, the
response's rollout.max_response_tokens, the sequence's dpo.max_length) is refused, or with
dpo.truncation_mode cut as TRL cuts it (`fit_pair`).

A pair batch has one row per pair: `prompt_ids` / `prompt_mask` (B, P), `chosen_ids` /
`chosen_mask` and `rejected_ids` / `rejected_mask` (B, R). The actor and the reference score a pair
batch as 2B sequences (`pair_sequences`: the chosen responses, then the rejected), so one forward
pass covers both halves of every pair and a micro-batch or a rank never holds half a pair.
"""

from __future__ import annotations

import random

import torch

from hybridflow.batch import Batch
from hybridflow.data.prompts import encode_prompts, prompt_token_ids

RESPONSE_COLUMNS = ("chosen", "rejected")
MESSAGES_FIX = "give text, or a list of chat messages ending with {'role': 'assistant', 'content': ...}"


def _final_turn(value, column: str, row: int, where: str) -> tuple[list, str]:
    """(the messages before the final assistant turn, that turn's text) of one response cell: text
    is ([], text); a list of chat messages must end with the assistant's turn."""
    if isinstance(value, str):
        return [], value
    if isinstance(value, (list, tuple)) and value and all(isinstance(m, dict) for m in value) and \
            isinstance(value[-1].get("content"), str):
        if value[-1].get("role", "assistant") != "assistant":
            raise ValueError(f"{where}, column {column!r}, row {row}: the last message's role is "
                             f"{value[-1].get('role')!r}; fix: end each {column} conversation with the assistant's turn")
        return list(value[:-1]), value[-1]["content"]
    raise ValueError(f"{where}, column {column!r}, row {row}: {type(value).__name__} {str(value)[:60]!r} is not a "
                     f"response; fix: {MESSAGES_FIX}")


def shared_text_prefix(chosen: str, rejected: str) -> int:
    """Characters of the longest shared start of two texts, less a space just before the first
    difference (it goes to the responses: TRL's extract_prompt)."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    return n - 1 if n and chosen[n - 1] == " " else n


def _implicit(row: dict, index: int, where: str) -> tuple[object, str, str]:
    chosen, rejected = row["chosen"], row["rejected"]
    fix = "add a 'prompt' column, or give chosen and rejected the same start (the prompt) before they differ"
    if isinstance(chosen, str) and isinstance(rejected, str):
        n = shared_text_prefix(chosen, rejected)
        if n == 0 or n == len(chosen) or n == len(rejected):
            what = "share no start" if n == 0 else "are one the start of the other"
            raise ValueError(f"{where}, row {index}: no 'prompt' column, and 'chosen' and 'rejected' {what}, so no "
                             f"prompt and two responses can be taken from them; fix: {fix}")
        return chosen[:n], chosen[n:], rejected[n:]
    if isinstance(chosen, str) or isinstance(rejected, str):
        raise ValueError(f"{where}, row {index}: no 'prompt' column, and one of 'chosen' and 'rejected' is text, the "
                         f"other chat messages; fix: give both as text or both as chat messages")
    history, chosen_text = _final_turn(chosen, "chosen", index, where)
    other, rejected_text = _final_turn(rejected, "rejected", index, where)
    if not history or history != other:
        raise ValueError(f"{where}, row {index}: no 'prompt' column, and the conversations in 'chosen' and "
                         f"'rejected' {'differ' if history else 'have nothing'} before their final assistant turn "
                         f"(the turn trained; the conversation before it is the prompt of both); fix: {fix}")
    return history, chosen_text, rejected_text


def _explicit(row: dict, index: int, where: str) -> tuple[object, str, str]:
    prompt = row["prompt"]
    (chosen_history, chosen), (rejected_history, rejected) = (
        _final_turn(row[column], column, index, where) for column in RESPONSE_COLUMNS)
    if chosen_history != rejected_history:
        raise ValueError(f"{where}, row {index}: the conversations in 'chosen' and 'rejected' differ before their "
                         "final assistant turn, the turn trained (the conversation before it joins the prompt of "
                         "both); fix: make them the same before it, or move it into 'prompt'")
    if chosen_history:
        if isinstance(prompt, str):
            raise ValueError(f"{where}, row {index}: 'prompt' is text and 'chosen' is a conversation of "
                             f"{len(chosen_history) + 1} messages; fix: give 'prompt' as chat messages (the "
                             "conversation before the final assistant turn then joins it), or give 'chosen' and "
                             "'rejected' the final assistant turn only")
        prompt = list(prompt) + chosen_history
    return prompt, chosen, rejected


def preference_row(row: dict, index: int, where: str) -> dict:
    """`row` in one of TRL's preference formats (module docstring) as `{**row, "prompt": text or chat
    messages, "chosen": text, "rejected": text}`; a row that fits none raises naming `where`, the row
    and the fix."""
    missing = [c for c in RESPONSE_COLUMNS if row.get(c) is None]
    if missing:
        raise ValueError(f"{where}, row {index}: no value in column(s) {missing}; fix: {MESSAGES_FIX} in each")
    prompt, chosen, rejected = (_explicit if row.get("prompt") is not None else _implicit)(row, index, where)
    return {**row, "prompt": prompt, "chosen": chosen, "rejected": rejected}


def preference_rows(rows: list[dict], where: str) -> list[dict]:
    """Every row through `preference_row` (rows already normalised pass through unchanged)."""
    return [preference_row(row, i, where) for i, row in enumerate(rows)]


def response_text(value, column: str, row: int, where: str) -> str:
    """The text of one response cell: a string, or a single assistant message (TRL's conversational
    form). A longer conversation raises: its history belongs in the prompt (`preference_row`)."""
    history, text = _final_turn(value, column, row, where)
    if history:
        raise ValueError(f"{where}, column {column!r}, row {row}: a conversation of {len(history) + 1} messages; "
                         "fix: read the row with preference_row, which moves the conversation before the final "
                         "assistant turn into the prompt")
    return text


def fit_pair(prompt: list[int], chosen: list[int], rejected: list[int], response_tokens: int,
             max_length: int | None, mode: str) -> tuple[list[int], list[int], list[int]] | None:
    """A pair's tokens within its limits: each response (with EOS) at most `response_tokens`
    (rollout.max_response_tokens), prompt + the longer response at most `max_length` (dpo.max_length;
    None: no such limit). The prompt is within data.max_prompt_tokens already (encode_prompts).

    mode `error`: the tokens unchanged if they fit, else None (the caller refuses the pair).
    `keep_start` (TRL's): the start of each sequence: the responses keep their first tokens (the
    end, EOS included, is cut). `keep_end` (TRL's): the end of each sequence: the responses keep
    their last tokens (EOS kept), then the prompt loses its first tokens until the longer
    sequence fits (the prompt is shared, so both sequences lose the same tokens). A pair that
    cannot keep a token of prompt and of each response raises."""
    budget = max_length if max_length is not None else len(prompt) + response_tokens
    longest = max(len(chosen), len(rejected))
    if longest <= response_tokens and len(prompt) + longest <= budget:
        return prompt, chosen, rejected
    if mode == "error":
        return None
    if mode == "keep_start":
        room = min(response_tokens, budget - len(prompt))
        if room < 1:
            raise ValueError(f"the prompt's {len(prompt)} tokens leave no room for a response in dpo.max_length="
                             f"{max_length}; fix: raise dpo.max_length, or use dpo.truncation_mode=keep_end")
        return prompt, chosen[:room], rejected[:room]
    chosen, rejected = chosen[-response_tokens:], rejected[-response_tokens:]
    cut = max(0, len(prompt) + max(len(chosen), len(rejected)) - budget)
    if cut >= len(prompt):
        raise ValueError(f"a response of {max(len(chosen), len(rejected))} tokens leaves no room for the prompt in "
                         f"dpo.max_length={max_length}; fix: raise dpo.max_length, or lower rollout.max_response_tokens")
    return prompt[cut:], chosen, rejected


def _response_tokens(rows: list[dict], tokenizer, column: str) -> list[list[int]]:
    texts = [row[column] for row in rows]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    return [tokens + [tokenizer.eos_token_id] for tokens in ids]


def pair_limit_problems(rows: list[dict], tokenizer, max_prompt_tokens: int, response_tokens: int,
                        max_length: int | None, where: str) -> tuple[list[str], list[int]]:
    """(problems, rows over their limits) of normalised rows (`preference_rows`): the problems, one
    per column, name `where`, the rows and the fix, for dpo.truncation_mode=error; the rows are
    those the other modes cut (the console says how many)."""
    chosen, rejected = (_response_tokens(rows, tokenizer, column) for column in RESPONSE_COLUMNS)
    prompts = [tokens[-max_prompt_tokens:] for tokens in prompt_token_ids([row["prompt"] for row in rows], tokenizer)[1]] \
        if max_length is not None and rows else [[] for _ in rows]
    over = [i for i in range(len(rows))
            if fit_pair(prompts[i], chosen[i], rejected[i], response_tokens, max_length, "error") is None]
    problems = []
    for column, tokens in zip(RESPONSE_COLUMNS, (chosen, rejected)):
        long = [(i, len(tokens[i])) for i in over if len(tokens[i]) > response_tokens]
        if long:
            problems.append(f"{where}, column {column!r}, row(s) {_listed(long)}: row {long[0][0]}'s response needs "
                            f"{long[0][1]} tokens with EOS, more than rollout.max_response_tokens={response_tokens}; "
                            f"fix: raise rollout.max_response_tokens to {max(n for _, n in long)}, shorten those "
                            "responses, or set dpo.truncation_mode=keep_start|keep_end to cut them")
    if max_length is not None:
        long = [(i, len(prompts[i]) + max(len(chosen[i]), len(rejected[i]))) for i in over
                if max(len(chosen[i]), len(rejected[i])) <= response_tokens]
        if long:
            problems.append(f"{where}, row(s) {_listed(long)}: row {long[0][0]}'s prompt and longer response need "
                            f"{long[0][1]} tokens, more than dpo.max_length={max_length}; fix: raise dpo.max_length "
                            f"to {max(n for _, n in long)}, or set dpo.truncation_mode=keep_start|keep_end to cut them")
    return problems, over


def _listed(rows: list[tuple[int, int]]) -> str:
    return ", ".join(str(i) for i, _ in rows[:5]) + (f" and {len(rows) - 5} more" if len(rows) > 5 else "")


def _padded(sequences: list[list[int]], width: int, pad: int, left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(sequences), width), pad, dtype=torch.long)  # (B, width)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for i, tokens in enumerate(sequences):
        if tokens:
            span = slice(width - len(tokens), width) if left else slice(0, len(tokens))
            ids[i, span], mask[i, span] = torch.tensor(tokens), True
    return ids, mask


def encode_pairs(rows: list[dict], tokenizer, max_prompt_tokens: int, max_response_tokens: int,
                 where: str = "preference data", truncation: str = "error", max_length: int | None = None,
                 truncation_mode: str = "error") -> Batch:
    """The pair batch of `rows` (module docstring; rows in any of TRL's formats). `truncation` is data.prompt_truncation; `max_length` and `truncation_mode`
    are dpo.max_length and dpo.truncation_mode (`fit_pair`): with `error` a pair over its limits raises."""
    rows = preference_rows(rows, where)
    prompts = encode_prompts(rows, tokenizer, max_prompt_tokens, source=where, truncation=truncation)
    responses = {column: _response_tokens(rows, tokenizer, column) for column in RESPONSE_COLUMNS}
    fitted = []
    for i in range(len(rows)):
        prompt = prompts["prompt_ids"][i][prompts["prompt_mask"][i]].tolist()
        try:
            pair = fit_pair(prompt, responses["chosen"][i], responses["rejected"][i], max_response_tokens, max_length,
                            truncation_mode)
        except ValueError as exc:
            raise ValueError(f"{where}, row {i}: {exc}") from None
        if pair is None:
            raise ValueError(f"{where}, row {i}: the pair needs more than rollout.max_response_tokens="
                             f"{max_response_tokens} tokens per response (with EOS) or dpo.max_length={max_length} per "
                             "sequence; fix: raise them, or set dpo.truncation_mode=keep_start|keep_end")
        fitted.append(pair)
    pad = tokenizer.pad_token_id
    tensors = dict(zip(("prompt_ids", "prompt_mask"), _padded([p for p, _, _ in fitted], max_prompt_tokens, pad, left=True)))
    for k, column in enumerate(RESPONSE_COLUMNS, start=1):
        tensors[f"{column}_ids"], tensors[f"{column}_mask"] = _padded([pair[k] for pair in fitted], max_response_tokens, pad)
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
