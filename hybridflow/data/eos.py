"""The end-of-sequence guard: every supervised target ends in an EOS token the loss trains.

A model never shown a trained EOS does not learn to stop: TRL PR #7230 found 79.7% against 100%
strict-JSON outputs after a 2-hour SFT run whose collator masked EOS (pad = EOS), with a warning that
was missed. Here the SFT and DPO targets append EOS and train it (hybridflow/data/answers.py,
hybridflow/data/preference.py); this guard checks each step's batch as the actor receives it, so a
change that masks or drops it stops the run at its first step instead of training on.
"""

from __future__ import annotations

import torch


class UntrainedEOSError(RuntimeError):
    """A supervised batch has rows whose trained tokens hold no EOS."""


def rows_without_trained_eos(response_ids: torch.Tensor, trained_mask: torch.Tensor, eos_token_id: int) -> list[int]:
    """The rows (B,) of `response_ids` (B, R) with a trained token but no trained EOS; `trained_mask`
    (B, R) is True on the tokens the loss trains."""
    has_trained = trained_mask.any(dim=1)
    has_eos = ((response_ids == eos_token_id) & trained_mask).any(dim=1)
    return torch.nonzero(has_trained & ~has_eos).flatten().tolist()


def check_eos_trained(response_ids: torch.Tensor, trained_mask: torch.Tensor, eos_token_id: int, where: str) -> None:
    """Raises UntrainedEOSError naming `where`, the rows and the EOS id when a row lacks a trained EOS."""
    rows = rows_without_trained_eos(response_ids, trained_mask, eos_token_id)
    if rows:
        raise UntrainedEOSError(
            f"{where}: {len(rows)} of {len(response_ids)} targets (rows {rows[:5]}) train no end-of-sequence token "
            f"(EOS id {eos_token_id}): the model would not learn to stop (TRL PR #7230). The targets must end in "
            "EOS inside the loss mask; check a custom collator or tokenizer whose pad token is its EOS")
