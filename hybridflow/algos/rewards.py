"""Turning per-sequence scores into per-token rewards."""

from __future__ import annotations

import torch


def place_sequence_rewards(sequence_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Token rewards (B, T): each sequence's score on its last response token, 0 elsewhere.

    sequence_rewards: (B,) float. response_mask: (B, T) bool, True on the trained response
    tokens; it may have holes (an agent rollout's loss mask is False on tool output between
    turns), so "last" is the last True position, not the count of True positions. A response
    with no tokens gets no reward anywhere.
    """
    if sequence_rewards.shape != response_mask.shape[:1]:
        raise ValueError(f"sequence_rewards {tuple(sequence_rewards.shape)} must be (B,) for response_mask "
                         f"{tuple(response_mask.shape)}")
    token_rewards = torch.zeros(response_mask.shape, dtype=torch.float32)
    width = response_mask.shape[1]
    last = width - 1 - response_mask.long().flip(dims=[1]).argmax(dim=1)  # (B,) last True column
    rows = torch.nonzero(response_mask.any(dim=1))[:, 0]
    token_rewards[rows, last[rows]] = sequence_rewards[rows].float()
    return token_rewards
