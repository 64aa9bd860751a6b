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


def informative_groups(sequence_rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """The ids of the groups whose samples' rewards are not all equal, in order of first appearance.

    Under a group baseline (GRPO, RLOO, Dr. GRPO) a group whose samples all scored the same has an
    advantage of 0 everywhere and adds nothing to the policy gradient: DAPO's dynamic sampling (Yu et
    al. 2025, section 3.2) drops such groups and fills the batch with others. A group of one sample has
    nothing to compare with and is never informative."""
    if sequence_rewards.shape != group_ids.shape or sequence_rewards.dim() != 1:
        raise ValueError(f"sequence_rewards {tuple(sequence_rewards.shape)} and group_ids {tuple(group_ids.shape)} "
                         "must be the same (B,)")
    order, seen = [], set()
    for g in group_ids.tolist():
        if g not in seen:
            seen.add(g)
            order.append(g)
    rewards = sequence_rewards.float()
    return torch.tensor([g for g in order if (rewards[group_ids == g].max() > rewards[group_ids == g].min())],
                        dtype=torch.long)


def overlong_penalty(response_lengths: torch.Tensor, max_tokens: int, buffer_tokens: int,
                     factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), times `factor`, per response (B,):
    0 up to `max_tokens - buffer_tokens` tokens, then falling linearly to `-factor` at `max_tokens`
    (a response the length limit cut), so a response that runs long is told so before it is cut."""
    if not 0 < buffer_tokens <= max_tokens:
        raise ValueError(f"buffer_tokens={buffer_tokens} must be in 1..max_tokens ({max_tokens})")
    over = (response_lengths.float() - (max_tokens - buffer_tokens)).clamp(min=0, max=buffer_tokens)
    return -factor * over / buffer_tokens
