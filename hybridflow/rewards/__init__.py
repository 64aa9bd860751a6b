"""Rewards: built-in rule-based functions, user functions from config, a reward model, combined.

Importing this package does not import torch or transformers (the config classes live here
and are read before anything heavy starts).
"""

from hybridflow.rewards.builtin import REWARD_FUNCTIONS, exact_match, extract_answer, math_answer
from hybridflow.rewards.composer import (
    FALLBACK_CAUSES, RewardComposer, RewardResult, build_reward, build_reward_function, reward_metrics,
)
from hybridflow.config.reward import RewardConfig, RewardFunctionConfig, RewardModelConfig
from hybridflow.rewards.functions import RewardFunction, RewardFunctionError, batched_reward, check_result


__all__ = [
    "REWARD_FUNCTIONS", "exact_match", "extract_answer", "math_answer", "FALLBACK_CAUSES", "RewardComposer",
    "RewardResult", "build_reward", "build_reward_function", "reward_metrics", "RewardConfig",
    "RewardFunctionConfig", "RewardModelConfig", "RewardFunction", "RewardFunctionError", "check_result",
    "batched_reward",
]
