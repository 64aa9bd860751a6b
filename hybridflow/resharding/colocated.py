"""Colocated weight sync: FSDP2 shards -> the in-process vLLM engine of the same rank.

Every rank gathers one full tensor at a time from its FSDP2 shards (an all-gather over the
training group), casts it to the rollout dtype, and hands it to its own vLLM engine through
vLLM's supported update path, `collective_rpc("reload_weights", weights_iterator=...,
is_checkpoint_format=True)`. The iterator is lazy, so at most one gathered tensor exists
besides vLLM's own weights: no second full copy of the model is ever built. All ranks
consume the iterator in the same order, which keeps the all-gathers in step.

Names are Hugging Face checkpoint names: the vLLM model's own loader maps them (stacking q/k/v
and gate/up, slicing for tensor parallelism). A peft LoRA model is folded on the fly:
W + (alpha / r) * B @ A per adapted linear layer.

Verification compares, for every parameter vLLM holds, a checksum (sum and sum of squares in
float64) with the checksum of the training weights it was built from, using the vLLM model's
`packed_modules_mapping` to know which checkpoint tensors were stacked into one parameter
(sums are additive over stacking). It cannot be fooled by a sync that silently skipped
tensors, and it names the first parameters that differ.
"""

from __future__ import annotations

import re
import time
from typing import Iterator

import torch

LORA_SUFFIX = re.compile(r"\.lora_(A|B)\.[^.]+\.weight$")


class WeightSyncError(RuntimeError):
    """The rollout engine's weights do not match the actor's after a sync."""


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _lora_scale(model: torch.nn.Module, module_path: str) -> float:
    module = model.get_submodule(module_path)
    scaling = getattr(module, "scaling", None)
    if isinstance(scaling, dict):
        return float(next(iter(scaling.values())))
    raise ValueError(f"cannot find the LoRA scaling of {module_path}")


def full_weights(model: torch.nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, full tensor) for every parameter, LoRA folded, one tensor at a time."""
    params = dict(model.named_parameters())
    is_peft = any(".lora_A." in n for n in params)
    for name, param in params.items():
        if is_peft and LORA_SUFFIX.search(name):
            continue  # folded into its base weight below
        tensor = _full(param.detach())
        out_name = name
        if is_peft:
            out_name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
            if ".base_layer.weight" in name:
                module_path = name[: -len(".base_layer.weight")]
                lora_a = _full(params[f"{module_path}.lora_A.default.weight"].detach())
                lora_b = _full(params[f"{module_path}.lora_B.default.weight"].detach())
                scale = _lora_scale(model, module_path)
                tensor = tensor.float() + scale * (lora_b.float() @ lora_a.float())
        yield out_name, tensor.to(dtype) if dtype is not None else tensor


def load_into_vllm(engine, weights: Iterator[tuple[str, torch.Tensor]]) -> dict[str, float]:
    """Stream `weights` into an in-process vLLM engine; returns bytes moved and seconds."""
    moved = {"bytes": 0, "tensors": 0}

    def counted() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            moved["bytes"] += tensor.numel() * tensor.element_size()
            moved["tensors"] += 1
            yield name, tensor

    start = time.perf_counter()
    engine.collective_rpc("reload_weights", kwargs={"weights_iterator": counted(), "is_checkpoint_format": True})
    engine.collective_rpc(_refresh_cpu_kernels)
    seconds = time.perf_counter() - start
    return {"weight_sync/bytes": float(moved["bytes"]), "weight_sync/tensors": float(moved["tensors"]),
            "weight_sync/seconds": seconds}


def _refresh_cpu_kernels(worker) -> int:
    """Runs inside vLLM's worker after a reload: rebuild CPU kernels of layers that kept their weight.

    On the CPU backend a layer's GEMM kernel holds a packed copy of its weight, rebuilt when the
    layer itself is reloaded. A layer that receives no tensor of its own, such as an lm_head tied
    to the input embedding, keeps a kernel packed from the old weights although its (shared)
    parameter holds the new ones: generation would silently use stale weights. Rebuilding the
    kernel of every layer that still holds a readable weight closes that gap. No-op on GPUs.
    """
    refreshed = 0
    for module in worker.model_runner.get_model().modules():
        weight = getattr(module, "weight", None)
        method = getattr(module, "quant_method", None)
        if hasattr(module, "cpu_linear") and weight is not None and weight.numel() and method is not None:
            method.process_weights_after_loading(module)
            refreshed += 1
    return refreshed


def _checksum(t: torch.Tensor) -> tuple[float, float]:
    t64 = t.detach().to(torch.float64)
    return float(t64.sum()), float((t64 * t64).sum())


def weight_checksums(weights: Iterator[tuple[str, torch.Tensor]]) -> dict[str, tuple[float, float]]:
    return {name: _checksum(tensor) for name, tensor in weights}


def _vllm_param_checksums(worker) -> dict:
    """Runs inside vLLM's worker (via collective_rpc): checksums of every readable parameter."""
    model = worker.model_runner.get_model()
    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    sums, empty = {}, []
    for name, param in model.named_parameters():
        if param.numel() == 0:
            empty.append(name)
            continue
        t64 = param.detach().to(torch.float64)
        sums[name] = (float(t64.sum()), float((t64 * t64).sum()))
    return {"sums": sums, "packed": packed, "empty": empty}


def vllm_checksums(engine) -> dict:
    return engine.collective_rpc(_vllm_param_checksums)[0]


def verify_vllm_weights(engine, expected: dict[str, tuple[float, float]], rtol: float = 1e-5) -> dict[str, float]:
    """Compare every vLLM parameter with the training weights; raise `WeightSyncError` on a mismatch."""
    found = vllm_checksums(engine)
    if found["empty"]:
        raise WeightSyncError(
            f"vLLM holds {len(found['empty'])} parameter(s) it cannot show (e.g. {found['empty'][0]}): the CPU backend "
            "repacked them. Verification needs hybridflow.patches.keep_vllm_cpu_linear_weights() applied before "
            "the engine starts (the rollout worker does this when trainer.verify_weight_sync=true)")
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
            mismatches.append(f"{name}: vLLM sum={got_sum:.6g} sumsq={got_sq:.6g}, actor sum={want_sum:.6g} sumsq={want_sq:.6g}")
    if mismatches:
        raise WeightSyncError(
            f"weight sync verification failed for {len(mismatches)} of {len(found['sums'])} vLLM parameters: "
            + "; ".join(mismatches[:5]))
    return {"weight_sync/verified_tensors": float(checked)}


def probe_vllm_log_probs(engine, prompt_ids: list[int], new_tokens: int = 4) -> tuple[list[int], torch.Tensor]:
    """A short greedy continuation of `prompt_ids` and vLLM's log-prob of each token (float64).

    The checksums prove which numbers vLLM holds; comparing these log-probs with the actor's
    proves what it computes with them (a stale kernel or a missed tensor shows up here even
    when every readable parameter matches).
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, logprobs=0, ignore_eos=True)
    out = engine.generate([TokensPrompt(prompt_token_ids=prompt_ids)], params, use_tqdm=False)[0].outputs[0]
    tokens = list(out.token_ids)
    return tokens, torch.tensor([entry[t].logprob for t, entry in zip(tokens, out.logprobs)], dtype=torch.float64)


def _close(a: float, b: float, rtol: float, scale: float | None = None) -> bool:
    tolerance = rtol * max(abs(b), scale or 0.0, 1e-12)
    return abs(a - b) <= tolerance


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
