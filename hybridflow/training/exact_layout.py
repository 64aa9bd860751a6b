"""The exact layout: the one decode that both the exact rollout engine (rollout.backend=exact,
workers/rollout/exact_rollout.py) and the actor's π_old pass run, so that the log-probs the engine
samples with are the ones the trainer computes, bit for bit (`rollout_mismatch/abs_diff_max` 0.0;
docs/algorithms.md "Rollout correction").

Why equal bits, not merely close ones. The engine draws response token t from log softmax(logits_t / T),
logits_t from a decode over a KV cache (hybridflow/training/kv_cache.py): the prompts' prefill, then one
forward per response column of the token each row drew last. The actor's π_old pass runs that very decode
again (`layout_decode`), feeding each row the token the engine drew where the engine fed it: the same
module (the actor's own, in its process: no copy, no weight sync), the same dtype, the same rows together
(`rows_per_forward` consecutive rows of the rank's batch, their prompts' used columns: `trimmed_prompts`),
the same cache, mask, positions and live rows at every step (a row that ended leaves both decodes after the
same step). Every operation then sees inputs of the same shape and the same values, runs the same kernels
with the same blocking and returns the same bits; no kernel need be batch-invariant, since no step is
compared with a forward of another shape. A π_old pass over the whole sequence at once (what the other
passes compute) would not do: position t's logits come from a (rows x length) product there and a
(rows x 1) one in a cached decode, and those add in another order (on this CPU the two differ in the last
bits of most log-probs: tests/unit/test_exact_rollout.py shows a counterexample).

The price: the π_old pass is a decode too — a forward of one token per live row per response column, where
the usual pass runs one forward of the whole sequence — and generation decodes as the hf engine's does (a
cache, ended rows leaving the batch), where before 2026-12-07 it ran the whole sequence's forward per
token (docs/results/rollout_mismatch.md measures both). Under FSDP over several ranks every forward is
collective, so every rank runs as many: the same number of micro-batches (the data-parallel split pads to
it), a stop agreed over the ranks (`any_rank`), and a rank whose rows all ended keeps one as padding.
What the layout does not make equal: a model whose tokens interact outside attention (a mixture of experts
with a capacity per batch), and any other forward of the actor (the update's, the reference's).

How the engine reaches the module: the host that builds the roles of one process introduces them to
each other (hybridflow/controller/context.py `introduce`); the engine keeps the worker that
`OffersModule` (the actor), and asks it for the module each time it generates or probes, so the
module goes with the actor when a stage's workers are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import torch

from hybridflow.algos import tempered_log_softmax_at
from hybridflow.batch import Batch
from hybridflow.training.fsdp import all_reduce_max
from hybridflow.training.kv_cache import LiveRowSteps
from hybridflow.training.sequences import loss_mask


@dataclass(eq=False)
class OfferedModule:
    """What the actor offers the exact engine of its process: its module and the rows of one forward
    (actor.samples_per_micro_batch, the rows the memory choice priced at full width)."""
    model: torch.nn.Module
    rows_per_forward: int


@runtime_checkable
class OffersModule(Protocol):
    """A worker that offers the exact engine of its process the module it generates with (the actor)."""

    def offered_module(self) -> OfferedModule:
        """The module and the rows of one forward; raises naming the fix when it offers none."""


def trimmed_prompts(batch: Batch) -> Batch:
    """`batch` without the leading prompt columns that are padding in every row: prompts come padded to
    data.max_prompt_tokens, and the columns dropped hold nothing any position attends to. Read from the
    prompt mask alone, which generation does not change, so the engine and the π_old pass trim a
    micro-batch alike."""
    used = batch["prompt_mask"].any(dim=0).nonzero()  # (n, 1): one read of the host
    first = int(used[0]) if len(used) else batch["prompt_mask"].shape[1] - 1  # keep one column
    if first == 0:
        return batch
    return Batch({**batch.tensors, "prompt_ids": batch["prompt_ids"][:, first:],
                  "prompt_mask": batch["prompt_mask"][:, first:]})


# pick(t, live, log_probs) -> (token, going): the tokens (L,) of response column t for the live rows (L,) (their
# indices in the micro-batch) given the step's log-probs (L, V), and which of those rows go on after it
Pick = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@torch.no_grad()
def layout_decode(model: torch.nn.Module, prompts: Batch, width: int, temperature: float, pad_token_id: int,
                  pick: Pick) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One micro-batch's decode in the exact layout: (response ids, response mask, the log-probs of the tokens
    picked, rows still going at the limit), (B, width) each or (B,). Step t's log-probs are
    log softmax(logits / temperature) of the live rows' next position, float32, reduced as
    `token_log_probs_and_entropy` reduces a position (`tempered_log_softmax_at`); `pad_token_id` fills the ids
    after a row's end. `pick` chooses column t's
    tokens from them — the engine draws them, the π_old pass replays the engine's — and the rows that go on.
    A row that stops leaves the batch and the cache after that step; where none of this rank's rows goes on
    while another rank's do, the first live row stays as padding (its tokens padding, its picks not kept),
    since every forward is collective under FSDP. Stops at `width` or when no row of any rank goes on."""
    model.eval()
    prompts = trimmed_prompts(prompts)
    prompt_ids, prompt_mask = prompts["prompt_ids"], prompts["prompt_mask"]
    rows, device = prompt_ids.shape[0], prompt_ids.device
    ids = torch.full((rows, width), pad_token_id, dtype=torch.long, device=device)  # (B, R)
    response_mask = torch.zeros((rows, width), dtype=torch.bool, device=device)
    picked = torch.zeros((rows, width), dtype=torch.float32, device=device)
    running = torch.zeros(rows, dtype=torch.bool, device=device)
    live = torch.arange(rows, device=device)  # the micro-batch's rows in the cache, in cache order
    real = torch.ones(rows, dtype=torch.bool, device=device)  # False: a row kept as padding only
    positions = (prompt_mask.long().cumsum(1) - 1).clamp(min=0)  # (B, P): left padding shifts nothing
    steps = LiveRowSteps(model, prompt_mask, prompt_mask.shape[1] + width)
    logits = steps.prefill(prompt_ids, positions)  # (B, V)
    position = positions[:, -1:] + 1
    for t in range(width):
        log_probs = tempered_log_softmax_at(logits[:, None], 0, temperature=temperature)  # (L, V)
        token, going = pick(t, live, log_probs)
        going = going & real
        kept = live[real]
        ids[kept, t], response_mask[kept, t] = token[real], True
        picked[kept, t] = log_probs.gather(-1, token[:, None])[:, 0][real]
        if t == width - 1 or not any_rank(bool(going.any())):
            running[kept] = going[real]  # cut at the limit
            break
        keep = going.nonzero()[:, 0] if going.any() else torch.zeros(1, dtype=torch.long, device=device)
        fed = torch.where(going, token, 0)[keep]  # a row kept as padding reads token 0 in both decodes
        if len(keep) < len(live):
            steps.drop(keep)
            live, position = live[keep], position[keep]
        real = going[keep]
        logits = steps.next(fed, position)
        position = position + 1
    return ids, response_mask, picked, running


@torch.no_grad()
def layout_log_probs(model: torch.nn.Module, batch: Batch, rows_per_forward: int, temperature: float = 1.0
                     ) -> torch.Tensor:
    """The actor's π_old in the exact layout: (B, R) float32, the engine's decode of each `rows_per_forward`
    consecutive rows of `batch` replayed (`layout_decode`), each row fed the response tokens it holds and going
    on while its response mask does; 0 outside `loss_mask` (the tokens the model sampled)."""
    parts = []
    for micro in batch.split(rows_per_forward):
        tokens, mask = micro["response_ids"], micro["response_mask"]
        width = tokens.shape[1]

        def replay(t: int, live: torch.Tensor, log_probs: torch.Tensor, tokens=tokens, mask=mask):
            going = mask[live, t + 1] if t + 1 < width else torch.zeros_like(live, dtype=torch.bool)
            return tokens[live, t], going

        _, _, log_probs, _ = layout_decode(model, micro, width, temperature, 0, replay)
        parts.append(log_probs * loss_mask(micro))
    return torch.cat(parts)


def any_rank(flag: bool) -> bool:
    """Whether `flag` holds on any rank of the default process group (each rank's decode stops together)."""
    return bool(all_reduce_max(int(flag)))
