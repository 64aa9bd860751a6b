"""The FLOP floor of one GRPO step, and the machine's matmul rate that turns it into seconds.

Pure arithmetic (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", sec. 2.1):
a forward pass costs about 2 x N FLOPs per token for a model of N parameters (one multiply
and one add per weight), a backward pass twice that, so

    training (forward + backward)      6 x N x trained tokens
    generation                         2 x N x (generated tokens + each distinct prompt's tokens once)
    each extra log-prob forward pass   2 x N x trained tokens (old policy, reference)

where the trained tokens are every sample's response and each distinct prompt once (its group's
samples attend to one computation of it: the work a step must do, model.share_prompts), or with
`prompts_once=False` the prompt once per sample (what a step without prompt sharing computes).

Attention's score FLOPs (2 x layers x context x width per token) are left out: at these
sequence lengths (< 30 tokens) they are under 1% of the total. N counts tied embedding and
LM-head weights once: the head's matmul is real work, the embedding lookup is not.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepTokens:
    """Token counts of one GRPO step (real tokens, padding excluded)."""

    prompt_tokens: int  # over every sample: each prompt counted once per sample of its group
    unique_prompt_tokens: int  # each distinct prompt counted once (what a prefill must read)
    response_tokens: int  # generated tokens over every sample

    @property
    def trained_tokens(self) -> int:
        """Every sample's prompt and response (each prompt once per sample)."""
        return self.prompt_tokens + self.response_tokens

    @property
    def shared_tokens(self) -> int:
        """Each distinct prompt once, and every response: what a pass with shared prompts computes."""
        return self.unique_prompt_tokens + self.response_tokens


def grpo_step_flops(params: int, tokens: StepTokens, extra_forward_passes: int = 0,
                    prompts_once: bool = True) -> dict[str, float]:
    """FLOPs of one step by part, and their `total`.

    `extra_forward_passes`: log-prob forwards over the step's samples besides the training
    one (old-policy and reference log-probs; 0 for on-policy GRPO without a KL term).
    `prompts_once`: the passes over the samples compute each distinct prompt once (the floor of the
    work a step must do); False: once per sample.
    """
    if params <= 0 or extra_forward_passes < 0:
        raise ValueError(f"params={params} must be > 0 and extra_forward_passes={extra_forward_passes} >= 0")
    trained = tokens.shared_tokens if prompts_once else tokens.trained_tokens
    parts = {
        "generation": 2.0 * params * (tokens.response_tokens + tokens.unique_prompt_tokens),
        "extra_forwards": 2.0 * params * trained * extra_forward_passes,
        "training": 6.0 * params * trained,
    }
    parts["total"] = sum(parts.values())
    return parts


def floor_seconds(flops: float, flops_per_s: float) -> float:
    """Seconds the step's FLOPs need at the measured matmul rate."""
    if flops_per_s <= 0:
        raise ValueError(f"flops_per_s={flops_per_s} must be > 0")
    return flops / flops_per_s


def matmul_flops_per_s(threads: int = 2, size: int = 2048, repeats: int = 5) -> float:
    """Best-of-`repeats` float32 rate of a (size x size) @ (size x size) matmul on `threads` threads.

    The best run, not the median: a floor should use the rate the machine can reach.
    """
    import time

    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        a @ b  # warm-up: thread pool and caches
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return 2.0 * size**3 / best
