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


def encode_demonstrations(demonstrations: list[list[str]], tokenizer, max_response_tokens: int) -> Batch:
    """SFT targets of multi-turn demonstrations: each a list of texts alternating model turn,
    observation, model turn, ... (hybridflow/agents). `response_ids` (B, R): every turn's tokens
    then EOS; `response_mask` True on all of them (attention); `loss_mask` True on the model
    turns and EOS only: the model learns to write calls and answers, not the tools' outputs."""
    ids = torch.full((len(demonstrations), max_response_tokens), tokenizer.pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((len(demonstrations), max_response_tokens), dtype=torch.bool)
    loss_mask = torch.zeros_like(response_mask)
    for i, turns in enumerate(demonstrations):
        tokens, trained = [], []
        for k, text in enumerate(turns):
            part = tokenizer(str(text), add_special_tokens=False)["input_ids"]
            tokens += part
            trained += [k % 2 == 0] * len(part)  # even turns are the model's
        tokens.append(tokenizer.eos_token_id)
        trained.append(True)
        if len(tokens) > max_response_tokens:
            raise ValueError(f"SFT demonstration of sample {i} ({''.join(map(str, turns))[:40]!r}) needs {len(tokens)} "
                             f"tokens with EOS, more than rollout.max_response_tokens={max_response_tokens}; raise it")
        ids[i, : len(tokens)] = torch.tensor(tokens)
        response_mask[i, : len(tokens)] = True
        loss_mask[i, : len(tokens)] = torch.tensor(trained)
    return Batch(tensors={"response_ids": ids, "response_mask": response_mask, "loss_mask": loss_mask})


def encode_sft_targets(rows: list[dict], tokenizer, max_response_tokens: int) -> Batch:
    """A row's `demonstration` (multi-turn, tool output left out of the loss) when the rows have
    one, else its `ground_truth` answer."""
    if all(row.get("demonstration") is not None for row in rows):
        return encode_demonstrations([list(row["demonstration"]) for row in rows], tokenizer, max_response_tokens)
    return encode_answers([row["ground_truth"] for row in rows], tokenizer, max_response_tokens)


def sft_target_lengths(rows: list[dict], tokenizer) -> list[int]:
    """Tokens each row's SFT target takes with its EOS (as `encode_sft_targets` writes it)."""
    if rows and all(row.get("demonstration") is not None for row in rows):
        texts = [[str(text) for text in row["demonstration"]] for row in rows]
    else:
        texts = [[str(row.get("ground_truth"))] for row in rows]
    flat = [text for turns in texts for text in turns]
    counts = iter(len(ids) for ids in tokenizer(flat, add_special_tokens=False)["input_ids"]) if flat else iter(())
    return [sum(next(counts) for _ in turns) + 1 for turns in texts]


def long_sft_targets(rows: list[dict], tokenizer, limit: int, where: str,
                     indices: list[int] | None = None) -> str | None:
    """The problem, naming `where` (file and key) and the rows (`indices`: the file's row numbers
    of `rows`, default 0, 1, ...), when SFT targets (answer or demonstration, with EOS) need more
    than `limit` tokens (rollout.max_response_tokens)."""
    indices = indices if indices is not None else list(range(len(rows)))
    long = [(indices[i], n) for i, n in enumerate(sft_target_lengths(rows, tokenizer)) if n > limit]
    if not long:
        return None
    column = "demonstration" if rows and all(row.get("demonstration") is not None for row in rows) else "ground_truth"
    listed = ", ".join(str(i) for i, _ in long[:5]) + (f" and {len(long) - 5} more" if len(long) > 5 else "")
    return (f"{where}, column {column!r}, row(s) {listed}: the SFT target of row {long[0][0]} needs {long[0][1]} "
            f"tokens with EOS, more than rollout.max_response_tokens={limit}; fix: raise rollout.max_response_tokens "
            f"to {max(n for _, n in long)}, or shorten those answers")
