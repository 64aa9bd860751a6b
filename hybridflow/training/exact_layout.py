"""The exact layout: the one forward that both the exact rollout engine (rollout.backend=exact,
workers/rollout/exact_rollout.py) and the actor's π_old pass compute, so that the log-probs the engine
samples with are the ones the trainer computes, bit for bit (`rollout_mismatch/abs_diff_max` 0.0;
docs/algorithms.md "Rollout correction").

Why equal bits, not merely close ones. The trainer's log-prob of response token t is
log softmax(logits_t / T)[token_t], logits_t from a forward over the whole sequence. The engine draws
token t from that very distribution when, at decode step t, it runs the same forward itself: the same
module (the actor's own, in its process: no copy, no weight sync), the same dtype, an input of the same
shape — `rows_per_forward` consecutive rows of the rank's batch, their prompts' used columns and every
response column (`trimmed_prompts`) — with the tokens not generated yet as masked padding. Causal
attention keeps every later column out of position t's computation, linear layers and norms work row
by row, and an input of the same shape runs the same kernels with the same blocking, so position t's
logits are the bits the trainer computes later from the whole response; the log-softmax is reduced
over the same (rows, response, vocabulary) tensor in both (`tempered_log_softmax_at` against
`token_log_probs_and_entropy`). What the other passes do for speed (response columns trimmed to the
longest response, packing, token budgets) depends on the finished responses, so neither pass here does it.

Two details keep the two inputs alike beyond causality:
- the last response column is masked in every row: nothing after it is predicted, so it is no input
  of any log-prob, and the mask then always has a padded column. With none (full prompts and every
  response at the limit) transformers would swap the explicit mask for SDPA's `is_causal` kernel,
  another computation than the engine's, whose mask always pads the columns not generated yet (on the
  CPU here the two agreed bit for bit at the shapes tried; on a GPU only `is_causal` reaches the flash kernel);
- the response's position ids count on from the prompt whatever the mask says, so a model whose
  rotary embedding reads the largest position (dynamic scaling) sees the same one at every step.
What the layout does not make equal: a model whose tokens interact outside attention (a mixture of
experts with a capacity per batch), and any other forward of the actor (the update's, the reference's).

The price: no KV cache. The engine runs this whole forward once per response token, where a cached
decoder runs one token's (docs/results/rollout_mismatch.md measures it). Under FSDP over several
ranks every forward is collective, so every rank runs as many: the same number of rows (the
data-parallel split pads to it) and a stop agreed over the ranks (`any_rank`).

How the engine reaches the module: the host that builds the roles of one process introduces them to
each other (hybridflow/controller/context.py `introduce`); the engine keeps the worker that
`OffersModule` (the actor), and asks it for the module each time it generates or probes, so the
module goes with the actor when a stage's workers are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from hybridflow.algos import tempered_log_softmax_at, token_log_probs_and_entropy
from hybridflow.batch import Batch
from hybridflow.training.fsdp import all_reduce_max
from hybridflow.training.sequences import loss_mask, takes_logits_to_keep


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


def layout_inputs(batch: Batch) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask and position_ids, (B, P + R) each, of a left-padded prompt and a
    right-padded response batch: the last response column masked in every row, the response's
    positions counted on from each prompt's last (module docstring)."""
    prompt_mask, response_mask = batch["prompt_mask"], batch["response_mask"].clone()
    response_mask[:, -1] = False  # no input of any log-prob: the mask always pads a column
    width = response_mask.shape[1]
    prompt_positions = (prompt_mask.long().cumsum(dim=1) - 1).clamp(min=0)  # (B, P): left padding shifts nothing
    response_positions = prompt_mask.long().sum(dim=1, keepdim=True) + torch.arange(width, device=prompt_mask.device)
    return {"input_ids": torch.cat([batch["prompt_ids"], batch["response_ids"]], dim=1),
            "attention_mask": torch.cat([prompt_mask, response_mask], dim=1).long(),
            "position_ids": torch.cat([prompt_positions, response_positions], dim=1)}


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


def layout_logits(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """(B, R, V) logits at the positions that predict each response column: one forward of the
    prompts' used columns and every response column, in the model's compute dtype."""
    batch = trimmed_prompts(batch)
    width = batch["response_ids"].shape[1]
    inputs = layout_inputs(batch)
    if takes_logits_to_keep(model):  # the last R + 1 positions: the last prompt token's ... the last column's
        return model(**inputs, use_cache=False, logits_to_keep=width + 1).logits[:, :width]
    prompt_width = batch["prompt_ids"].shape[1]
    return model(**inputs, use_cache=False).logits[:, prompt_width - 1: prompt_width - 1 + width]


@torch.no_grad()
def layout_log_probs(model: torch.nn.Module, batch: Batch, rows_per_forward: int,
                     temperature: float = 1.0) -> torch.Tensor:
    """The actor's π_old in the exact layout: (B, R) float32, log softmax(logits / temperature) at
    each response token, 0 outside `loss_mask`; `rows_per_forward` consecutive rows a forward, in
    the batch's order, as the engine generated them."""
    model.eval()
    parts = []
    for micro in batch.split(rows_per_forward):
        log_probs, _ = token_log_probs_and_entropy(layout_logits(model, micro), micro["response_ids"],
                                                   temperature=temperature, with_entropy=False)
        parts.append(log_probs * loss_mask(micro))
    return torch.cat(parts)


@torch.no_grad()
def next_token_log_probs(model: torch.nn.Module, batch: Batch, position: int, temperature: float = 1.0
                         ) -> torch.Tensor:
    """The engine's decode step: (B, V) float32, the log-probs of response column `position` from the
    layout's forward of `batch` (its responses generated up to `position`, masked after), reduced as
    `layout_log_probs` reduces them."""
    model.eval()
    return tempered_log_softmax_at(layout_logits(model, batch), position, temperature=temperature)


def any_rank(flag: bool) -> bool:
    """Whether `flag` holds on any rank of the default process group (each rank's decode stops together)."""
    return bool(all_reduce_max(int(flag)))
