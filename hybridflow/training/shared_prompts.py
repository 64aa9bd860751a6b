"""Shared prompts: a group's prompt computed once in a packed row, its responses attending to it.

A GRPO batch holds G samples of each prompt. Packed one row per sample (hybridflow/training/packing.py),
every pass over the batch computes each prompt G times: G·(P + R) tokens where P + G·R carry
information. Shared, a micro-batch's rows with equal prompt tokens (compared token by token, not by
index: any batch, any order) are packed as one group,

    [prompt] [response 1] [response 2] ... [response k]

positions continuing from the prompt's length in every response (each response sits where it sat
after its own prompt), and attention that reproduces k separate sequences: the prompt causal within
itself; response j's tokens attend to the whole prompt and causally to response j's earlier tokens,
never to another response. The prompt's last logit predicts the first token of every response
(`PackedSequences.predicting` repeats that position), and the gradient into the prompt's hidden
states is the sum over the group, by autograd, as k separate copies would have summed it. The
projections, the MLP and the output head run once per real token; only attention reads the prompt's
keys and values once per response. verl's PrefixGrouper and Unsloth's shared-prefix GRPO compute
the same thing on padded batches; here it combines with packing and token-budget micro-batches.

Attention for this layout, as "virtual sequences" in the packed row's order: each group's prompt
(queries = keys, causal), each response (its queries; keys = the prompt's then its own, causal
aligned at the bottom right: query t sees the prompt and its response's tokens 0..t), and every
unshared row as before (its prompt and response, causal). `SharedPrompts.key_index` lays out every
virtual sequence's keys (prompt keys gathered once per response: a copy of K/V only).
On CUDA in 16 bits that is one call of PyTorch's variable-length flash attention with
`cu_seq_q != cu_seq_k` and `window_size=(-1, 0)`: flash attention's causal window is aligned to the
bottom right when the key sequence is longer (the flash-attention 2 convention; a release that
names only `is_causal` takes the SDPA path below instead). Elsewhere (the CPU, float32): the square
sequences in one causal `scaled_dot_product_attention` call, right-padded (packing.py's layout), and
the responses in a second call, right-padded, with a boolean mask (key k is visible to query t of a
response after a p-token prompt when k <= p + t). tests/unit/test_shared_prompts.py checks both
against unshared packing, the varlen layout through a CPU stand-in for the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SHARED_PROMPTS = "shared_prompts"  # the forward's keyword argument that carries the layout to attention


@dataclass(frozen=True)
class SharedPrompts:
    """The attention layout of a packed row with shared prompts (device tensors, sizes as ints so that
    nothing reads the device). Virtual sequences: n of them, `cu_seq_lens_q` / `cu_seq_lens_k` (n + 1,)
    their query and key boundaries (the queries are the packed row in order), `key_index` (Tk,) the
    packed position of each key. The CPU path's two calls: `square` (tokens, row, column) lays out the
    prompts and unshared rows (`square_rows` x `square_longest`), `suffix` lays out the responses'
    queries (`suffix_rows` x `suffix_longest`) and `suffix_keys` their keys (x `suffix_keys_longest`),
    `suffix_prompt` (suffix_rows,) each response's prompt length; `order` (T,) puts the two calls'
    outputs (square tokens then suffix tokens) back in packed order."""
    cu_seq_lens_q: torch.Tensor
    cu_seq_lens_k: torch.Tensor
    max_length_q: int
    max_length_k: int
    key_index: torch.Tensor
    square: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    square_rows: int
    square_longest: int
    suffix: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    suffix_rows: int
    suffix_longest: int
    suffix_keys: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    suffix_keys_longest: int
    suffix_prompt: torch.Tensor
    order: torch.Tensor


def prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[int]:
    """A group id per row (host tensors, (B, P) left-padded): rows whose real prompt tokens are equal
    get the same id, numbered by first appearance; rows without a prompt token get ids of their own.
    Left padding puts every row's real tokens at the end, so rows with padding marked -1 are equal
    exactly when their prompts are (one `unique` over the rows, no per-token Python)."""
    mask = prompt_mask.bool()
    marked = torch.where(mask, prompt_ids.long(), torch.full_like(prompt_ids, -1, dtype=torch.long))
    _, inverse = torch.unique(marked, dim=0, return_inverse=True)
    ids: dict[int, int] = {}
    groups = []
    for row, (key, has_prompt) in enumerate(zip(inverse.tolist(), mask.any(dim=1).tolist())):
        groups.append(ids.setdefault(key if has_prompt else -1 - row, len(ids)))
    return groups


def shared_tokens(prompt_lengths: list[int], response_lengths: list[int], groups: list[int] | None) -> int:
    """Tokens a packed row of these rows holds: every row's prompt and response, or with `groups`
    (`prompt_groups`) each group's prompt once. What `pack` builds and micro-batching budgets."""
    if groups is None:
        return sum(prompt_lengths) + sum(response_lengths)
    prompts = {}
    for group, p in zip(groups, prompt_lengths):
        prompts[group] = p
    return sum(prompts.values()) + sum(response_lengths)


def shared_layout(host_prompt: torch.Tensor, host_response: torch.Tensor, groups: list[int]):
    """The packed row of a micro-batch whose rows share prompts, from host masks (B, P) and (B, R) and
    `prompt_groups`. Returns None where no group has two responses (plain packing serves), else the
    host tensors (tokens, positions, predicting, layout parts): `tokens` where each packed token sits
    in the flattened (B, P + R), `positions` its position id, `predicting` (N,) the packed position
    whose logit predicts each response token in row-major order, and the `SharedPrompts` parts."""
    prompt_width = host_prompt.shape[1]
    width = prompt_width + host_response.shape[1]
    plen, rlen = host_prompt.sum(dim=1).tolist(), host_response.sum(dim=1).tolist()
    members: dict[int, list[int]] = {}
    for row, group in enumerate(groups):
        members.setdefault(group, []).append(row)
    if not any(sum(rlen[i] > 0 for i in rows) > 1 for rows in members.values()):
        return None
    tokens, positions, keys = [], [], []
    square, suffix, predicting = [], [], {}  # (start, length) / (start, length, prompt start, prompt length)
    q_lengths, k_lengths = [], []
    cursor = 0

    def emit(row: int, first: int, count: int, position: int) -> None:
        tokens.append(row * width + torch.arange(first, first + count))
        positions.append(torch.arange(position, position + count))

    for rows in members.values():
        p = plen[rows[0]]
        responding = [i for i in rows if rlen[i] > 0]
        if len(responding) <= 1:  # one sequence, as unshared packing lays it out
            i = responding[0] if responding else rows[0]
            length = p + rlen[i]
            if length == 0:
                continue
            emit(i, prompt_width - p, length, 0)
            square.append((cursor, length))
            keys.append(torch.arange(cursor, cursor + length))
            q_lengths.append(length), k_lengths.append(length)
            predicting[i] = torch.arange(cursor + p - 1, cursor + length - 1)
            cursor += length
            continue
        prompt_start = cursor
        emit(rows[0], prompt_width - p, p, 0)
        square.append((cursor, p))
        keys.append(torch.arange(cursor, cursor + p))
        q_lengths.append(p), k_lengths.append(p)
        cursor += p
        for i in responding:
            r = rlen[i]
            emit(i, prompt_width, r, p)
            suffix.append((cursor, r, prompt_start, p))
            keys += [torch.arange(prompt_start, prompt_start + p), torch.arange(cursor, cursor + r)]
            q_lengths.append(r), k_lengths.append(p + r)
            predicting[i] = torch.cat([torch.tensor([prompt_start + p - 1]), torch.arange(cursor, cursor + r - 1)])
            cursor += r
    rows_out = [predicting[i] for i in range(len(rlen)) if rlen[i] > 0]
    parts = _layout_parts(square, suffix, keys, q_lengths, k_lengths, cursor)
    return torch.cat(tokens), torch.cat(positions), torch.cat(rows_out) if rows_out else torch.zeros(0, dtype=torch.long), parts


def _cumulative(lengths: list[int]) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.long)
    cu[1:] = torch.tensor(lengths, dtype=torch.long).cumsum(dim=0)
    return cu


def _laid_out(segments: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed position, row, column) of every token of `segments` ((start, length) each, a row each)."""
    if not segments:
        empty = torch.zeros(0, dtype=torch.long)
        return empty, empty, empty
    starts = torch.tensor([s for s, _ in segments])
    lengths = torch.tensor([n for _, n in segments])
    row = torch.repeat_interleave(torch.arange(len(segments)), lengths)
    column = torch.arange(int(lengths.sum())) - (lengths.cumsum(dim=0) - lengths)[row]
    return starts[row] + column, row, column


def _layout_parts(square, suffix, keys, q_lengths, k_lengths, total: int) -> dict:
    """The host tensors and sizes of `SharedPrompts` (without its device copy)."""
    square_tokens, square_row, square_column = _laid_out(square)
    suffix_tokens, suffix_row, suffix_column = _laid_out([(s, r) for s, r, _, _ in suffix])
    key_tokens, key_row, key_column = [], [], []
    for row, (start, r, prompt_start, p) in enumerate(suffix):
        key_tokens += [torch.arange(prompt_start, prompt_start + p), torch.arange(start, start + r)]
        key_row.append(torch.full((p + r,), row))
        key_column.append(torch.arange(p + r))
    order = torch.empty(total, dtype=torch.long)
    order[torch.cat([square_tokens, suffix_tokens])] = torch.arange(total)  # packed position -> output row
    return {"cu_seq_lens_q": _cumulative(q_lengths), "cu_seq_lens_k": _cumulative(k_lengths),
            "max_length_q": max(q_lengths), "max_length_k": max(k_lengths), "key_index": torch.cat(keys),
            "square": (square_tokens, square_row, square_column), "square_rows": len(square),
            "square_longest": max(n for _, n in square),
            "suffix": (suffix_tokens, suffix_row, suffix_column), "suffix_rows": len(suffix),
            "suffix_longest": max(r for _, r, _, _ in suffix),
            "suffix_keys": (torch.cat(key_tokens), torch.cat(key_row), torch.cat(key_column)),
            "suffix_keys_longest": max(p + r for _, r, _, p in suffix),
            "suffix_prompt": torch.tensor([p for *_, p in suffix]), "order": order}


def on_device(parts: dict, device: torch.device) -> SharedPrompts:
    """`SharedPrompts` from `_layout_parts`'s host tensors, sent to `device` in one copy."""
    from hybridflow.batch import host_to_device

    names = ["cu_seq_lens_q", "cu_seq_lens_k", "key_index", "suffix_prompt", "order"]
    triples = ["square", "suffix", "suffix_keys"]
    flat = [parts[n] for n in names] + [t for n in triples for t in parts[n]]
    moved = host_to_device(torch.cat(flat), device).split([len(t) for t in flat])
    tensors = dict(zip(names, moved[:len(names)]))
    for k, name in enumerate(triples):
        tensors[name] = tuple(moved[len(names) + 3 * k: len(names) + 3 * k + 3])
    tensors["cu_seq_lens_q"] = tensors["cu_seq_lens_q"].to(torch.int32)
    tensors["cu_seq_lens_k"] = tensors["cu_seq_lens_k"].to(torch.int32)
    sizes = {k: v for k, v in parts.items() if isinstance(v, int)}
    return SharedPrompts(**tensors, **sizes)


# ---- attention ---------------------------------------------------------------------------------


def shared_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, shared: SharedPrompts,
                     scaling: float | None, dropout: float) -> torch.Tensor:
    """The CPU / float32 path: packed (1, H, T, D) query, key and value (key/value heads already
    repeated to the query's) -> (1, T, H, D), as two `scaled_dot_product_attention` calls (module
    docstring). Right padding changes no real query's output: under the causal mask (square) and the
    prompt-plus-own-prefix mask (suffix) a real query sees no padded key."""
    functional = torch.nn.functional
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)

    def lay_out(x: torch.Tensor, where: tuple, rows: int, longest: int) -> torch.Tensor:
        tokens, row, column = where
        out = x.new_zeros(rows, longest, *x.shape[1:])
        out[row, column] = x.index_select(0, tokens)
        return out.transpose(1, 2)  # (rows, H, longest, D)

    square = functional.scaled_dot_product_attention(
        *(lay_out(x, shared.square, shared.square_rows, shared.square_longest) for x in (q, k, v)),
        dropout_p=dropout, scale=scaling, is_causal=True)
    keys = [lay_out(x, shared.suffix_keys, shared.suffix_rows, shared.suffix_keys_longest) for x in (k, v)]
    visible = (torch.arange(shared.suffix_keys_longest, device=q.device)[None, None, :]
               <= shared.suffix_prompt[:, None, None] + torch.arange(shared.suffix_longest, device=q.device)[None, :, None])
    suffix = functional.scaled_dot_product_attention(
        lay_out(q, shared.suffix, shared.suffix_rows, shared.suffix_longest), *keys, attn_mask=visible[:, None],
        dropout_p=dropout, scale=scaling)  # (m, H, r, D)
    square_out = square.transpose(1, 2)[shared.square[1], shared.square[2]]  # (Ts, H, D)
    suffix_out = suffix.transpose(1, 2)[shared.suffix[1], shared.suffix[2]]  # (Tr, H, D)
    return torch.cat([square_out, suffix_out]).index_select(0, shared.order)[None]


def shared_varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, shared: SharedPrompts,
                            scaling: float | None, kernel) -> torch.Tensor:
    """The CUDA 16-bit path: (1, H, T, D) tensors -> (1, T, H, D) by one call of `kernel`
    (packing's `_varlen` with separate query and key boundaries, causal at the bottom right) over
    the virtual sequences: queries in packed order, keys gathered by `shared.key_index`."""
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)
    k, v = k.index_select(0, shared.key_index), v.index_select(0, shared.key_index)  # (Tk, H, D)
    out = kernel(q.contiguous(), k.contiguous(), v.contiguous(), shared.cu_seq_lens_q, shared.cu_seq_lens_k,
                 shared.max_length_q, shared.max_length_k, scaling)
    return out[None]


# ---- the setting ---------------------------------------------------------------------------------


def sharing_unsupported(model: torch.nn.Module, packed: bool) -> str | None:
    """Why `model` cannot share prompts (None: it can): sharing is a layout of packed rows."""
    if not packed:
        return "the model does not run packed (model.pack_sequences=false, or its attention cannot pack)"
    return None


def choose_sharing(model: torch.nn.Module, setting: bool | None, packed: bool) -> bool:
    """`model.share_prompts` for a loaded model that `packed` or not: None (auto) shares wherever the
    model runs packed, True insists (an error naming why it cannot), False keeps one row per sample.
    Marks the model when it shares (`shares_prompts`); returns whether it does."""
    reason = sharing_unsupported(model, packed)
    if setting is True and reason:
        raise ValueError(f"model.share_prompts=true, but this model cannot share prompts: {reason}; "
                         "set model.share_prompts=false (or null: shared where packing runs)")
    shares = setting is not False and reason is None
    _base(model)._hybridflow_shares_prompts = shares
    return shares


def shares_prompts(model: torch.nn.Module) -> bool:
    """Whether `choose_sharing` switched `model` to shared prompts."""
    return bool(getattr(_base(model), "_hybridflow_shares_prompts", False))


def _base(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model
