"""Rollout workers: generation backends returning token ids, masks and sampler log-probs."""
