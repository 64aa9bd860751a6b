import pytest
import torch

from hybridflow.algos.rewards import place_sequence_rewards


def test_reward_lands_on_last_response_token():
    # rows: 3 tokens, 1 token, 0 tokens
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    out = place_sequence_rewards(torch.tensor([2.0, -1.0, 5.0]), mask)
    assert out.tolist() == [[0, 0, 2.0, 0], [-1.0, 0, 0, 0], [0, 0, 0, 0]]


def test_shape_mismatch_is_named():
    with pytest.raises(ValueError, match="must be \\(B,\\)"):
        place_sequence_rewards(torch.zeros(2), torch.ones(3, 4, dtype=torch.bool))


def test_reward_lands_on_the_last_sampled_token_of_a_mask_with_holes():
    # An agent rollout's loss mask: model turn (cols 0-1), tool output (cols 2-3, False), final
    # model turn (col 4), padding (col 5). The count of True is 3, but the last True is col 4.
    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    out = place_sequence_rewards(torch.tensor([1.0, 3.0]), mask)
    assert out.tolist() == [[0, 0, 0, 0, 1.0, 0], [3.0, 0, 0, 0, 0, 0]]
