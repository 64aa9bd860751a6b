"""Reward functions: built-in rule-based scores."""

from hybridflow.rewards.builtin import exact_match, extract_answer

__all__ = ["exact_match", "extract_answer"]
