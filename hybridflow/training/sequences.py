"""Sequences as the model sees them: left-padded prompt + right-padded response.

Every batch that reaches a model has `prompt_ids` (B, P) left-padded with `prompt_mask`, and
`response_ids` (B, R) right-padded with `response_mask` (True on every real response token).
The model input is their concatenation (B, P+R); position ids count real tokens only, so left
padding does not shift positions. The logits that predict response token t sit at position P-1+t.

Two masks, two jobs. `response_mask` is what attention sees: every real token after the prompt.
`loss_mask` (optional, (B, R)) is what is trained: the tokens the model sampled. They differ in
multi-turn agent rollouts (hybridflow/agents), where tool output sits between the model's turns:
the model must attend to it, but it was not sampled, so it has no log-prob, advantage or loss.
A batch without `loss_mask` (single-turn generation, plain SFT) trains every response token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from hybridflow.batch import Batch, host_to_device
from hybridflow.training.packing import PackedSequences, pack, runs_packed
from hybridflow.training.shared_prompts import prompt_groups, shared_tokens, shares_prompts
from hybridflow.training.ulysses import SequenceShard, logits_of, sequence_parallel


def loss_mask(batch: Batch) -> torch.Tensor:
    """(B, R) True on the response tokens that are trained (sampled by the model): the batch's
    `loss_mask`, or `response_mask` when every response token was sampled (single turn)."""
    return batch["loss_mask"] if "loss_mask" in batch else batch["response_mask"]


def model_inputs(batch: Batch) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask and position_ids (each (B, P+R)) for a prompt+response batch."""
    input_ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1)
    position_ids = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)
    return {"input_ids": input_ids, "attention_mask": attention_mask.long(), "position_ids": position_ids}


def trimmed_inputs(batch: Batch) -> tuple[dict[str, torch.Tensor], int, int]:
    """`model_inputs` without the columns that are padding in every row: the leading prompt
    columns and the trailing response columns. Returns (inputs, prompt_len, response_len) of the
    trimmed sequences.

    Prompts are padded to `data.max_prompt_tokens` and responses to
    `rollout.max_response_tokens`, which for short tasks is several times the real length; the
    forward pass costs in proportion to the width, so this is the main cost saved. The result
    is the same: left padding is masked and positions count real tokens only, and causal
    attention never looks at the trailing columns.
    """
    prompt_width, response_width = batch["prompt_ids"].shape[1], batch["response_ids"].shape[1]
    used = torch.cat([batch["prompt_mask"].any(dim=0), batch["response_mask"].any(dim=0)]).cpu()  # one read
    prompt_used = used[:prompt_width].nonzero()  # (n, 1) columns with a real token
    response_used = used[prompt_width:].nonzero()
    first = int(prompt_used[0]) if len(prompt_used) else prompt_width - 1  # keep >= 1 prompt column
    end = int(response_used[-1]) + 1 if len(response_used) else 1
    trimmed = Batch({"prompt_ids": batch["prompt_ids"][:, first:], "prompt_mask": batch["prompt_mask"][:, first:],
                     "response_ids": batch["response_ids"][:, :end], "response_mask": batch["response_mask"][:, :end]})
    return model_inputs(trimmed), prompt_width - first, min(end, response_width)


def pad_response_width(values: torch.Tensor, width: int) -> torch.Tensor:
    """Pad dim 1 of (B, r, ...) with zeros to (B, width, ...): back to the batch's response width."""
    missing = width - values.shape[1]
    if missing <= 0:
        return values
    return torch.cat([values, values.new_zeros((values.shape[0], missing, *values.shape[2:]))], dim=1)


def response_log_probs(model: torch.nn.Module, batch: Batch, temperature: float = 1.0, with_entropy: bool = True,
                       entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the response tokens and the entropy at each response position, (B, R) float32
    each, at the sampling temperature; 0 past every row's response (outside `response_mask`), and
    the entropy all 0 when `with_entropy` is False (SFT's loss), without a gradient when
    `entropy_grad` is False (a loss with no entropy term reports it as a metric).

    A model switched to packed attention (`hybridflow.training.packing`) computes the micro-batch's
    real tokens as one packed row; the others compute the padded batch, trimmed of all-padding
    columns. Both give the same log-probs at the response tokens; past them the packed path gives 0
    and the padded one whatever the padding predicts (callers mask).

    Memory: the model computes logits at the response positions only (transformers'
    `logits_to_keep`, where the model takes it) and the vocabulary is reduced a chunk of rows at a
    time, recomputed in the backward pass when there are several (`algos.token_log_probs_and_entropy`),
    so a large micro-batch's (B, r, V) logits exist once, in the compute dtype."""
    from hybridflow.algos import token_log_probs_and_entropy

    logits, layout = response_logits(model, batch)
    if layout.packed:  # (N, V): a token a row, chunked by rows
        log_probs, entropy = token_log_probs_and_entropy(
            logits[:, None], layout.from_rows(batch["response_ids"])[:, None], temperature=temperature,
            with_entropy=with_entropy, entropy_grad=entropy_grad)
        return layout.to_rows(log_probs[:, 0]), layout.to_rows(entropy[:, 0])
    log_probs, entropy = token_log_probs_and_entropy(logits, layout.from_rows(batch["response_ids"]).contiguous(),
                                                     temperature=temperature, with_entropy=with_entropy,
                                                     entropy_grad=entropy_grad)
    return layout.to_rows(log_probs), layout.to_rows(entropy)


class ResponseLayout:
    """Where `response_logits` put each response position: packed (N real tokens in one row), packed and split
    over a sequence-parallel group (`shard`: this rank's n of the N, hybridflow/training/ulysses.py) or the
    padded batch trimmed to its `width` longest response; `to_rows` maps values of that layout to (B, R, ...)
    with zeros past every response (a shard's gathered from the whole group first: every rank of it reads
    the whole micro-batch), `from_rows` maps (B, R, ...) values to it."""

    def __init__(self, packed: PackedSequences | None, width: int, full_width: int,
                 shard: SequenceShard | None = None) -> None:
        self.packed, self.width, self.full_width, self.shard = packed, width, full_width, shard

    def to_rows(self, values: torch.Tensor) -> torch.Tensor:
        if self.shard is not None:
            values = self.shard.gather(values)
        if self.packed is not None:
            return self.packed.scatter(values)
        return pad_response_width(values, self.full_width)

    def from_rows(self, values: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            values = self.packed.gather(values)
            return self.shard.local(values) if self.shard is not None else values
        return values[:, :self.width]


def response_logits(model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, ResponseLayout]:
    """The logits predicting each response token, in the compute dtype, and their layout: (N, V) at the real
    tokens of a model switched to packed attention (one packed row; split over a sequence-parallel group,
    this rank's (n, V): the layout's `to_rows` gathers values computed on them), else (B, r, V) of the padded
    batch trimmed of all-padding columns (r its longest response); only those positions' logits are
    computed where the model takes `logits_to_keep`."""
    packed = pack(batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"], batch["response_mask"],
                  share=shares_prompts(model)) if runs_packed(model) else None
    full_width = batch["response_ids"].shape[1]
    shard = sequence_shard(model, packed)
    if shard is not None:
        return logits_of(model, shard, takes_logits_to_keep(model)), ResponseLayout(packed, full_width, full_width,
                                                                                   shard)
    if packed is not None:
        return packed_logits(model, packed), ResponseLayout(packed, full_width, full_width)
    inputs, prompt_len, width = trimmed_inputs(batch)
    if takes_logits_to_keep(model):  # the last width + 1 positions: prompt_len - 1 ... prompt_len + width - 1
        logits = model(**inputs, use_cache=False, logits_to_keep=width + 1).logits[:, :width]  # (B, r, V)
    else:
        logits = model(**inputs, use_cache=False).logits[:, prompt_len - 1: prompt_len - 1 + width]
    return logits, ResponseLayout(None, width, full_width)


def sequence_shard(model: torch.nn.Module, packed: PackedSequences | None) -> SequenceShard | None:
    """This rank's shard of the packed micro-batch where `model` splits sequences (ulysses.py), else None."""
    sp = sequence_parallel(model)
    if sp is None:
        return None
    if packed is None:
        raise ValueError("sequence parallelism splits packed rows, and this micro-batch did not pack (a row with "
                         "response tokens but no prompt token); the padded path runs at sequence_parallel_size=1 only")
    return sp.shard(packed)


def response_topk(model: torch.nn.Module, batch: Batch, k: int, temperature: float = 1.0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's k likeliest tokens at each response position and their log-probs at `temperature`,
    (B, R, k) each (ids 0 and log-probs 0 past every response); the log-softmax in float32."""
    logits, layout = response_logits(model, batch)
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    top = log_probs.topk(k, dim=-1)
    return layout.to_rows(top.indices), layout.to_rows(top.values)


def response_log_probs_at(model: torch.nn.Module, batch: Batch, token_ids: torch.Tensor, temperature: float = 1.0
                          ) -> torch.Tensor:
    """The model's log-probs at `temperature` of the tokens `token_ids` (B, R, k) names at each response
    position, (B, R, k) float32 with the gradient; 0 past every response. The log-softmax over the
    vocabulary in float32 at once (B, r, V): a top-k distillation's micro-batch pays that copy."""
    logits, layout = response_logits(model, batch)
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    return layout.to_rows(log_probs.gather(-1, layout.from_rows(token_ids)))


def response_values(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """A value-head model's values (B, R) float32, read where the logits predicting each response token
    sit: the state before token t is generated. 0 past every response; packed (and split over a
    sequence-parallel group) or trimmed of all-padding columns as `response_log_probs` computes."""
    packed = pack(batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"], batch["response_mask"],
                  share=shares_prompts(model)) if runs_packed(model) else None
    shard = sequence_shard(model, packed)
    if shard is not None:  # this rank's n values of the row's N, gathered from the group as log-probs are
        values = model(**shard.model_kwargs()).logits[0, shard.local_predicting, 0].float()  # (n,)
        return packed.scatter(shard.gather(values))
    if packed is not None:  # real tokens only (hybridflow.training.packing)
        return packed.scatter(model(**packed.model_kwargs()).logits[0, packed.predicting, 0].float())
    inputs, prompt_len, width = trimmed_inputs(batch)  # all-padding columns cost compute and change nothing
    logits = model(**inputs).logits  # (B, p+r, 1)
    values = logits[:, prompt_len - 1 : prompt_len - 1 + width, 0].float()
    return pad_response_width(values, batch["response_ids"].shape[1])


def packed_logits(model: torch.nn.Module, packed: PackedSequences) -> torch.Tensor:
    """(N, V) logits at `packed.predicting`, from one forward over the packed row."""
    if takes_logits_to_keep(model):
        return model(**packed.model_kwargs(), use_cache=False, logits_to_keep=packed.predicting).logits[0]
    return model(**packed.model_kwargs(), use_cache=False).logits[0, packed.predicting]


def takes_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether the causal LM under any wrapper (peft) names `logits_to_keep` in its forward."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cls = type(base)
    if cls not in _LOGITS_TO_KEEP:
        _LOGITS_TO_KEEP[cls] = "logits_to_keep" in inspect.signature(cls.forward).parameters
    return _LOGITS_TO_KEEP[cls]


_LOGITS_TO_KEEP: dict[type, bool] = {}


def row_lengths(batch: Batch) -> tuple[list[int], list[int]]:
    """Each row's real prompt tokens and real response tokens."""
    return batch["prompt_mask"].sum(dim=1).tolist(), batch["response_mask"].sum(dim=1).tolist()


def rank_balanced_order(lengths: list[int], ranks: int) -> list[int]:
    """A permutation of the rows after which the data-parallel split (`WorkerGroup`'s DP_SPLIT: padded
    to a multiple of `ranks`, then consecutive chunks of equal row counts) gives every rank about the
    same number of tokens (`lengths`, each row's): the longest rows first, each to the rank with the
    fewest tokens so far that still has room for a real row; each rank's rows in their original
    order. verl's `balance_batch` does this job; a rank with more tokens than the others makes every
    other rank wait at each collective of the update."""
    n = len(lengths)
    if ranks <= 1 or n <= 1:
        return list(range(n))
    per = -(-n // ranks)  # rows per chunk, pad rows included (they go last)
    room = [min(per, max(0, n - per * k)) for k in range(ranks)]
    rows: list[list[int]] = [[] for _ in range(ranks)]
    loads = [0] * ranks
    for i in sorted(range(n), key=lambda i: -lengths[i]):
        k = min((k for k in range(ranks) if len(rows[k]) < room[k]), key=lambda k: loads[k])
        rows[k].append(i)
        loads[k] += lengths[i]
    return [i for chunk in rows for i in sorted(chunk)]


def balanced_over_ranks(batch: Batch, ranks: int) -> Batch:
    """`batch` in `rank_balanced_order` by each row's real tokens (prompt and response)."""
    prompts, responses = row_lengths(batch)
    order = rank_balanced_order([p + r for p, r in zip(prompts, responses)], ranks)
    return batch if order == list(range(len(batch))) else batch.index(order)


def token_budget_groups(prompt_lengths: list[int], response_lengths: list[int], budget: int, packed: bool,
                        groups_at_least: int = 1, prompt_groups: list[int] | None = None) -> list[list[int]]:
    """Rows (indices) in micro-batches of at most `budget` tokens each, as few as that allows and at
    least `groups_at_least` (every rank of a group must run as many). Packed, a micro-batch costs its
    rows' real tokens: the fewest micro-batches for which the longest rows first, each into the
    lightest micro-batch, stay within the budget, so they hold about the same number of tokens.
    Padded, it costs its rows x (its longest prompt + its longest response), the width it is trimmed
    to: rows sorted by length fill one micro-batch after another, so rows of like length pad each
    other. A row longer than the budget is a micro-batch of its own. Each micro-batch's rows in
    their original order.

    Packed with `prompt_groups` (a group id per row, `shared_prompts.prompt_groups`), the rows of a
    group travel together and cost their prompt once (`shared_tokens`), so that a micro-batch shares
    it; a group over the budget goes row by row, its prompt no longer shared across micro-batches."""
    lengths = [p + r for p, r in zip(prompt_lengths, response_lengths)]
    groups: list[list[int]] = []
    if packed:
        items = _budget_items(prompt_lengths, response_lengths, budget, prompt_groups)
        cost = {tuple(rows): c for rows, c in items}
        order = sorted(cost, key=lambda rows: -cost[rows])
        filled_items = [[rows] for rows in order if cost[rows] > budget]
        rest = [rows for rows in order if cost[rows] <= budget]
        bins = max(1, -(-sum(cost[rows] for rows in rest) // budget), groups_at_least - len(filled_items))
        while rest:  # the fewest micro-batches whose longest-first, lightest-first filling fits the budget
            filled: list[list[tuple]] = [[] for _ in range(min(bins, len(rest)))]
            loads = [0] * len(filled)
            for rows in rest:
                lightest = loads.index(min(loads))
                filled[lightest].append(rows)
                loads[lightest] += cost[rows]
            if max(loads) <= budget:
                filled_items += filled
                break
            bins += 1
        while len(filled_items) < min(groups_at_least, len(lengths)):  # split the one with the most rows
            largest = max(range(len(filled_items)), key=lambda g: sum(len(rows) for rows in filled_items[g]))
            held = filled_items.pop(largest)
            if len(held) == 1:  # one group of rows: its rows go apart
                held = [(i,) for i in held[0]]
            filled_items += [held[0::2], held[1::2]]
        return [sorted(i for rows in g for i in rows) for g in filled_items]
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    widest = (0, 0)  # the open micro-batch's longest prompt and longest response
    for i in order:
        grown = (max(widest[0], prompt_lengths[i]), max(widest[1], response_lengths[i]))
        if groups and (len(groups[-1]) + 1) * sum(grown) <= budget:
            groups[-1].append(i)
            widest = grown
        else:
            groups.append([i])
            widest = (prompt_lengths[i], response_lengths[i])
    while len(groups) < min(groups_at_least, len(lengths)):  # split the group with the most rows
        largest = max(range(len(groups)), key=lambda g: len(groups[g]))
        rows = groups.pop(largest)
        groups += [rows[0::2], rows[1::2]]
    return [sorted(g) for g in groups]


def _budget_items(prompt_lengths: list[int], response_lengths: list[int], budget: int,
                  prompt_groups: list[int] | None) -> list[tuple[list[int], int]]:
    """What packed micro-batching places: (rows, tokens) for each row, or with `prompt_groups` for each
    group of rows sharing a prompt whose shared tokens fit the budget (the rest row by row)."""
    if prompt_groups is None:
        return [([i], p + r) for i, (p, r) in enumerate(zip(prompt_lengths, response_lengths))]
    members: dict[int, list[int]] = {}
    for i, group in enumerate(prompt_groups):
        members.setdefault(group, []).append(i)
    items = []
    for rows in members.values():
        shared = shared_tokens([prompt_lengths[i] for i in rows], [response_lengths[i] for i in rows],
                               [0] * len(rows))
        if shared <= budget:
            items.append((rows, shared))
        else:
            items += [([i], prompt_lengths[i] + response_lengths[i]) for i in rows]
    return items


@dataclass(frozen=True)
class RowFacts:
    """A batch's rows as micro-batching reads them, from one read of the host: real prompt and response
    tokens per row, and each row's prompt group (`shared_prompts.prompt_groups`) when prompts are shared."""
    prompt_lengths: list[int]
    response_lengths: list[int]
    prompt_groups: list[int] | None
    width: int  # the batch's padded prompt + response width


def row_facts(batch: Batch, share: bool = False) -> RowFacts:
    prompt_width = batch["prompt_ids"].shape[1]
    parts = [batch["prompt_mask"].long(), batch["response_mask"].long(), *([batch["prompt_ids"]] if share else [])]
    host = torch.cat(parts, dim=1).cpu()  # one read
    width = prompt_width + batch["response_ids"].shape[1]
    groups = prompt_groups(host[:, width:], host[:, :prompt_width]) if share else None
    return RowFacts(host[:, :prompt_width].sum(dim=1).tolist(), host[:, prompt_width:width].sum(dim=1).tolist(),
                    groups, width)


def micro_batch_rows(batch: Batch, rows_per_micro_batch: int, tokens_per_micro_batch: int | None = None,
                     packed: bool = False, share: bool = False, facts: RowFacts | None = None) -> list[list[int]]:
    """The rows of each micro-batch of `batch` on this rank: by token budget (`token_budget_groups`),
    `tokens_per_micro_batch`, or when None as many tokens as `rows_per_micro_batch` rows of the
    batch's full width hold (the rows the memory choice priced at full length, so the peak stays
    within it while shorter rows share a micro-batch). Every rank of the process group gets as many
    micro-batches as the rank that needs the most: FSDP2 gathers in every forward, collectively.
    Packed with `share` (the model shares prompts), a group's rows stay together where they fit."""
    from hybridflow.training.fsdp import all_reduce_max

    facts = facts or row_facts(batch, share=packed and share)
    budget = tokens_per_micro_batch or rows_per_micro_batch * facts.width
    prompts, responses = facts.prompt_lengths, facts.response_lengths
    groups = token_budget_groups(prompts, responses, budget, packed, prompt_groups=facts.prompt_groups)
    most = int(all_reduce_max(len(groups)))
    if most > len(groups):
        groups = token_budget_groups(prompts, responses, budget, packed, groups_at_least=most,
                                     prompt_groups=facts.prompt_groups)
    return groups


def computed_tokens(facts: RowFacts, micro_rows: list[list[int]], packed: bool) -> dict[str, int]:
    """Tokens the model runs on for these micro-batches, and what the padded batch would have held
    beyond them (`TOKEN_COUNTS`): `perf/computed_tokens` (a packed micro-batch's packed row,
    `shared_tokens`; a padded one's rows x its trimmed width, `trimmed_inputs`),
    `perf/sharing_saved_tokens` (prompts computed once per group instead of once per row) and
    `perf/padding_saved_tokens` (the rest of the rows x the batch's full width). The three add up to
    rows x full width."""
    computed = sharing_saved = 0
    for rows in micro_rows:
        p = [facts.prompt_lengths[i] for i in rows]
        r = [facts.response_lengths[i] for i in rows]
        if not packed:
            computed += len(rows) * (max(max(p), 1) + max(max(r), 1))
            continue
        groups = [facts.prompt_groups[i] for i in rows] if facts.prompt_groups is not None else None
        tokens = shared_tokens(p, r, _sharing(groups, r))
        computed += tokens
        sharing_saved += sum(p) + sum(r) - tokens
    full = sum(len(rows) for rows in micro_rows) * facts.width
    return {"perf/computed_tokens": computed, "perf/sharing_saved_tokens": sharing_saved,
            "perf/padding_saved_tokens": full - computed - sharing_saved}


TOKEN_COUNTS = ("perf/computed_tokens", "perf/sharing_saved_tokens", "perf/padding_saved_tokens")


def _sharing(groups: list[int] | None, response_lengths: list[int]) -> list[int] | None:
    """`groups` as `pack` shares them: None when no group has two responses (it packs unshared)."""
    if groups is None:
        return None
    responding: dict[int, int] = {}
    for group, r in zip(groups, response_lengths):
        responding[group] = responding.get(group, 0) + (r > 0)
    return groups if max(responding.values(), default=0) > 1 else None


def micro_batches(batch: Batch, rows_per_micro_batch: int, tokens_per_micro_batch: int | None = None,
                  packed: bool = False, share: bool = False) -> Iterator[Batch]:
    """`batch`'s micro-batches (`micro_batch_rows`), each a Batch of its rows."""
    for rows in micro_batch_rows(batch, rows_per_micro_batch, tokens_per_micro_batch, packed, share):
        yield batch.index(rows)


def mini_batches(batch: Batch, rows_per_mini_batch: int, generator: torch.Generator | None = None,
                 share: bool = False) -> list[Batch]:
    """Shuffled mini-batches of equal size (the caller checks divisibility). With `share` (the model
    shares prompts) and more than one mini-batch, whole prompt groups are shuffled, each group's rows
    kept next to each other, so that a mini-batch holds whole groups (where the size allows) and its
    micro-batches have prompts to share; a row-by-row shuffle would scatter each group of G samples
    over the mini-batches. Another draw of the same distribution over groups' samples, not the same
    mini-batches as unshared."""
    if generator is None:
        return batch.split(rows_per_mini_batch)
    if not share or rows_per_mini_batch >= len(batch):
        return batch.reorder(torch.randperm(len(batch), generator=generator)).split(rows_per_mini_batch)
    groups = row_facts(batch, share=True).prompt_groups
    members: dict[int, list[int]] = {}
    for row, group in enumerate(groups):
        members.setdefault(group, []).append(row)
    listed = list(members.values())
    order = [row for g in torch.randperm(len(listed), generator=generator).tolist() for row in listed[g]]
    return batch.reorder(torch.tensor(order)).split(rows_per_mini_batch)


@torch.no_grad()
def log_probs_and_entropy(model: torch.nn.Module, batch: Batch, rows_per_micro_batch: int,
                          temperature: float = 1.0, tokens_per_micro_batch: int | None = None,
                          with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the trained response tokens and the entropy at each position, (B, R) each,
    in the batch's row order, 0 outside `loss_mask` (padding, and tool output in agent rollouts);
    the entropy all 0 without `with_entropy` (a pass over the vocabulary saved)."""
    model.eval()
    shape = batch["response_ids"].shape
    device = batch["response_ids"].device
    log_probs_out = torch.zeros(shape, dtype=torch.float32, device=device)
    entropy_out = torch.zeros(shape, dtype=torch.float32, device=device)
    for rows in micro_batch_rows(batch, rows_per_micro_batch, tokens_per_micro_batch, runs_packed(model),
                                 shares_prompts(model)):
        micro = batch.index(rows)
        log_probs, entropy = response_log_probs(model, micro, temperature, with_entropy=with_entropy)
        mask = loss_mask(micro)
        index = host_to_device(torch.tensor(rows), device)
        log_probs_out[index] = log_probs * mask
        entropy_out[index] = entropy * mask
    return log_probs_out, entropy_out


@torch.no_grad()
def pair_log_probs(model: torch.nn.Module, pairs: Batch, rows_per_micro_batch: int,
                   tokens_per_micro_batch: int | None = None, per_token: bool = False, prefix: str = "") -> Batch:
    """`<prefix>chosen_log_probs` / `<prefix>rejected_log_probs`, (B,) each on the host, of a pair
    batch (hybridflow.data.preference) under `model` at temperature 1: each response's summed
    log-probability, or its mean per token with `per_token`. Its 2B sequences are scored in
    micro-batches as any log-prob pass."""
    from hybridflow.data.preference import pair_sequences, pair_sums

    sequences = pair_sequences(pairs)
    log_probs, _ = log_probs_and_entropy(model, sequences, rows_per_micro_batch, 1.0, tokens_per_micro_batch,
                                         with_entropy=False)
    chosen, rejected = pair_sums(log_probs, sequences["response_mask"], per_token=per_token)
    return Batch(tensors={f"{prefix}chosen_log_probs": chosen.cpu(), f"{prefix}rejected_log_probs": rejected.cpu()})
