"""Checking a sync: per-tensor checksums, compared across the two layouts.

A checksum is (sum, sum of squares) in float64. Both are additive over the pieces of a
tensor, so the training side can compute, for each generation rank, the checksum of exactly
the box that rank needs, and vLLM's stacked parameters (q/k/v into qkv_proj, gate/up into
gate_up_proj) compare with the sum over their parts through the model's
`packed_modules_mapping`. A sync that silently skipped or garbled a tensor cannot pass.
"""

from __future__ import annotations

from typing import Iterable

import torch

PROBE_PROMPT_IDS = [3, 4, 5, 6, 7, 8]  # any ids below every vocabulary size will do
PROBE_NEW_TOKENS = 4
PROBE_TOLERANCE = 1e-2  # float32 kernels differ by ~1e-5; a stale or garbled weight by far more


class WeightSyncError(RuntimeError):
    """The rollout engine's weights do not match the actor's, or the sync itself failed."""


def checksum(t: torch.Tensor) -> tuple[float, float]:
    t64 = t.detach().to(torch.float64)
    return float(t64.sum()), float((t64 * t64).sum())


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
