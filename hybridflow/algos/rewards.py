"""Turning per-sequence scores into per-token rewards."""

from __future__ import annotations

import torch


def place_sequence_rewards(sequence_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Token rewards (B, T): each sequence's score on its last response token, 0 elsewhere.

    sequence_rewards: (B,) float. response_mask: (B, T) bool, True on response tokens
    (right-padded). A response with no tokens gets no reward anywhere.
    """
    if sequence_rewards.shape != response_mask.shape[:1]:
        raise ValueError(f"sequence_rewards {tuple(sequence_rewards.shape)} must be (B,) for response_mask "
                         f"{tuple(response_mask.shape)}")
    token_rewards = torch.zeros(response_mask.shape, dtype=torch.float32)
    lengths = response_mask.long().sum(dim=1)
    rows = torch.nonzero(lengths > 0)[:, 0]
    token_rewards[rows, lengths[rows] - 1] = sequence_rewards[rows].float()
    return token_rewards
