"""Checking a sync: per-tensor checksums, compared across the two layouts, and a log-prob probe.

A checksum is (sum, sum of squares) accumulated in float64, in chunks of bounded size (no float64
copy of a whole tensor: `checksum`). Both are additive over the pieces of a
tensor, so the training side can compute, for each generation rank, the checksum of exactly
the box that rank needs, and vLLM's stacked parameters (q/k/v into qkv_proj, gate/up into
gate_up_proj) compare with the sum over their parts through the model's
`packed_modules_mapping`. A sync that silently skipped or garbled a tensor cannot pass.

The probe: each rollout rank continues `PROBE_PROMPTS` greedily and reports its log-probs; the
actor scores the same tokens. The prompts differ in length and the actor reads them as one
left-padded batch through the path its training forward takes (`probe_batch`: trimmed inputs,
position ids that count real tokens), so a model whose padding or positions the two engines
treat differently shows here, not only stale weights; the longest prompt is past one vLLM
prefix-cache block (128 tokens on the CPU), so it also reads any KV cached under the old weights.
A prompt the engine cannot hold with the new tokens (its `max_model_len`) is skipped: its
continuation comes back empty and the actor leaves it out.

The probe is a statistic, not an exact test: the mean and the 90th percentile of |log-prob gap| over
its tokens, against a tolerance of the two engines' dtypes and the model's depth
(`parity.precision_tolerance`). In bfloat16 two engines holding the same weights differ by up to
0.2 at their worst token on a 30-layer model, so a largest-gap test would call rounding a wrong
weight. Whether the engine holds the actor's weights is answered exactly by the checksums; when
the probe fails, `WeightSync.probe` runs them (if the engine can show its weights) and the error
says which question failed.
"""

from __future__ import annotations

from typing import Iterable

import torch

# Any ids below every vocabulary size will do; lengths differ so that the actor's batch is padded.
PROBE_PROMPTS = [[3 + (7 * i) % 47 for i in range(n)] for n in (6, 23, 61, 200)]
PROBE_NEW_TOKENS = 8
PROBE_TOLERANCE = 1e-3  # mean gap, both float32: kernels differ by ~1e-6; a stale or garbled weight by far more
QUANTILE_FACTOR = 4.0  # the 90th percentile may reach this many times the mean's tolerance


def probe_tolerance(model_dtype: str, rollout_dtype: str, layers: int) -> float:
    """The probe's default tolerance of the mean gap per token, for the actor's and the rollout's
    dtypes and the model's decoder layers."""
    from hybridflow.resharding.parity import precision_tolerance

    return precision_tolerance((model_dtype, rollout_dtype), layers)


def gap_statistics(gaps: torch.Tensor) -> dict[str, float]:
    """mean, 90th percentile and max of |log-prob gap| over tokens (1-D)."""
    gaps = gaps.double().abs()
    return {"mean": float(gaps.mean()), "q90": float(gaps.quantile(0.9)), "max": float(gaps.max())}


def probe_passes(stats: dict[str, float], tolerance: float) -> bool:
    return stats["mean"] <= tolerance and stats["q90"] <= QUANTILE_FACTOR * tolerance


class WeightSyncError(RuntimeError):
    """The rollout engine's weights do not match the actor's, or the sync itself failed."""


# The most elements a checksum turns to float64 at once: 4 Mi, 32 MiB of float64 and as much for their
# squares, whatever the tensor (an embedding of 152k x 3,584 would be a 4.4 GB float64 copy whole).
CHECKSUM_CHUNK_ELEMENTS = 1 << 22


def checksum(t: torch.Tensor) -> tuple[float, float]:
    """(sum, sum of squares) of `t`'s elements, accumulated in float64 on its device, chunk by chunk of at
    most `CHECKSUM_CHUNK_ELEMENTS`: no float64 copy of the whole tensor is ever made (at sync time that
    would be a second, larger copy of the largest tensor beside the weights). The same sums as one float64
    pass within float64 rounding; the actor's side and every engine's call this one function, so identical
    weights give identical checksums. Views (a box of a tensor) are read in place, never made contiguous."""
    t = t.detach()
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    squares = torch.zeros((), dtype=torch.float64, device=t.device)
    for piece in _chunks(t):
        piece = piece.to(torch.float64)  # (<= CHECKSUM_CHUNK_ELEMENTS,)
        total += piece.sum()
        squares += piece.square().sum()
    return float(total), float(squares)


def _chunks(t: torch.Tensor):
    """`t`'s elements as views of at most `CHECKSUM_CHUNK_ELEMENTS` each: a contiguous tensor flat in
    slices, a strided view slab by slab along its first dimension (a slab of one descends into it)."""
    limit = CHECKSUM_CHUNK_ELEMENTS
    if t.numel() <= limit or t.dim() == 0:
        yield t
    elif t.is_contiguous():
        yield from t.view(-1).split(limit)
    elif t.shape[0] == 1:
        yield from _chunks(t[0])
    else:
        for slab in t.split(max(1, limit // (t.numel() // t.shape[0])), dim=0):
            yield from _chunks(slab)


def weight_checksums(weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, tuple[float, float]]:
    return {name: checksum(tensor) for name, tensor in weights}


def verify_against(found: dict, expected: dict[str, tuple[float, float]], rtol: float = 1e-5) -> dict[str, float]:
    """Compare the engine's parameter checksums (`found`, from the receiver) with `expected`;
    raise `WeightSyncError` naming the first parameters that differ."""
    if found["empty"]:
        raise WeightSyncError(
            f"vLLM holds {len(found['empty'])} parameter(s) it cannot show (e.g. {found['empty'][0]}): the CPU backend "
            "repacked them. Checksums need hybridflow.patches.keep_vllm_cpu_linear_weights() applied before "
            "the engine starts (the rollout worker does this when weight_sync.checksum_every_steps > 0)")
    mismatches, checked = [], 0
    for name, (got_sum, got_sq) in found["sums"].items():
        parts = _checkpoint_names(name, found["packed"], expected)
        if not parts:
            mismatches.append(f"{name}: no training tensor maps to it")
            continue
        want_sum = sum(expected[p][0] for p in parts)
        want_sq = sum(expected[p][1] for p in parts)
        checked += 1
        if not (_close(got_sum, want_sum, rtol, scale=want_sq ** 0.5) and _close(got_sq, want_sq, rtol)):
            mismatches.append(f"{name}: vLLM sum={got_sum:.6g} sumsq={got_sq:.6g}, actor sum={want_sum:.6g} "
                              f"sumsq={want_sq:.6g}")
    if mismatches:
        raise WeightSyncError(
            f"weight sync verification failed for {len(mismatches)} of {len(found['sums'])} vLLM parameters: "
            + "; ".join(mismatches[:5]))
    return {"weight_sync/verified_tensors": float(checked)}


def _close(a: float, b: float, rtol: float, scale: float | None = None) -> bool:
    return abs(a - b) <= rtol * max(abs(b), scale or 0.0, 1e-12)


def _checkpoint_names(vllm_name: str, packed: dict[str, list[str]], expected: dict) -> list[str]:
    if vllm_name in expected:
        return [vllm_name]
    for fused, parts in packed.items():
        token = f".{fused}."
        if token in vllm_name:
            names = [vllm_name.replace(token, f".{p}.") for p in parts]
            if all(n in expected for n in names):
                return names
    return []


def probe_fits(prompt: list[int], max_len: int | None, new_tokens: int) -> bool:
    """Whether an engine holding at most `max_len` tokens per sequence (None: no limit) can run it."""
    return max_len is None or len(prompt) + new_tokens <= max_len


def probe_batch(prompts: list[list[int]], continuations: list[list[int]]):
    """The probe as the actor's training path reads it: a Batch with `prompt_ids` (B, P) left-padded,
    `response_ids` (B, R) right-padded and their masks, one row per prompt with a non-empty
    continuation. Padding ids are 0 (masked out)."""
    from hybridflow.batch import Batch

    rows = [(p, c) for p, c in zip(prompts, continuations) if c]
    width_p, width_r = max(len(p) for p, _ in rows), max(len(c) for _, c in rows)
    prompt_ids = torch.zeros((len(rows), width_p), dtype=torch.long)
    response_ids = torch.zeros((len(rows), width_r), dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids, dtype=torch.bool)
    response_mask = torch.zeros_like(response_ids, dtype=torch.bool)
    for i, (prompt, tokens) in enumerate(rows):
        prompt_ids[i, width_p - len(prompt):] = torch.tensor(prompt)
        prompt_mask[i, width_p - len(prompt):] = True
        response_ids[i, :len(tokens)] = torch.tensor(tokens)
        response_mask[i, :len(tokens)] = True
    return Batch({"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids,
                  "response_mask": response_mask})
