"""HybridFlow: RLHF / post-training with a single controller over Ray worker groups."""

__version__ = "0.1.0"
