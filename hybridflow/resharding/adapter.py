"""LoRA served as a vLLM adapter: each sync moves the LoRA factors only, not the folded model.

With a LoRA actor and the vLLM rollout (`weight_sync.lora`, decided by
`hybridflow.checks.rules.lora_sync`), the engine is started with LoRA enabled and keeps the base model it
loaded; every sync brings it the actor's current adapter as a new adapter with an id of its own,
and every request is sent with it. What moves is r x (in + out) per adapted linear layer
(megabytes) instead of the whole model with W + (alpha/r)BA folded in (gigabytes).

The trip, one sync (`hybridflow.resharding.sync.AdapterSync`):
- actor, every rank (a collective: FSDP2 shards of A and B are gathered), rank 0 returns the
  payload (`adapter_payload`): peft-named factors in the engine's dtype with each module's scaling
  folded into B (so the adapter's own scaling is 1 and what vLLM registers equals what was sent,
  bit for bit), the adapter's config, and the checksums of exactly those tensors;
- the payload goes from the actor's rank 0 to every rollout rank through Ray's object store (the
  controller never holds it); each rollout rank writes it as a peft adapter directory in its own
  temporary space (`write_adapter`), registers it with vLLM's `add_lora` under a new id (ids are
  never reused: vLLM keeps an adapter it already holds under an id and would not read the new
  files), removes the previous one, and deletes the directory, which vLLM has read into host
  memory (`VLLMReceiver.load_adapter`);
- the checks, by default at every sync: the checksums of the adapter vLLM registered under the id
  the rollout now serves (`engine_adapter_checksums`, read inside vLLM's worker) against those of the
  actor's live LoRA weights, read again by another path (`live_adapter_checksums`; not the payload's
  own, which a payload built from the wrong weights would match) (`verify_adapter`), and the log-prob probe, generated with that adapter. Every batch's
  outputs must carry the served adapter's id (`check_served`): a rollout that sends a request
  without it (the base model) or with an older one stops there. An adapter that never reaches the
  engine therefore stops the run at its first sync, naming what the engine serves instead.

Why not vLLM's weight-transfer engines for this: they move full checkpoint tensors into the loaded
model; the adapter path is vLLM's own LoRA API (`add_lora` / `remove_lora`, a `LoRARequest` per
request), which reads adapters from a directory, so the payload is written as one.

Not served as an adapter (the folded whole-model sync is used, `hybridflow.checks.rules.lora_sync` says
why): the Hugging Face rollout, staged pushes (trainer.max_staleness >= 2), LoRA on the embedding
or the output layer, ranks above vLLM's largest (512).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from hybridflow.resharding.verify import WeightSyncError, checksum
from hybridflow.resharding.weights import full_tensor

# vLLM's max_lora_rank takes these values only (vllm.config.lora.MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
UNSERVED_MODULES = ("embed_tokens", "lm_head")  # LoRA there is folded (vLLM's LoRA covers linear layers here)
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def served_rank(rank: int) -> int:
    """The engine's max_lora_rank for an adapter of `rank`: the smallest value vLLM accepts that
    holds it (an adapter of lower rank is padded by vLLM)."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"actor.lora.rank={rank} is above vLLM's largest max_lora_rank ({VLLM_LORA_RANKS[-1]}); "
                     "set weight_sync.lora=folded to sync the folded model instead")


# ---- actor side ---------------------------------------------------------------------------------


def lora_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every peft LoRA linear layer, in module order (the same on every rank)."""
    return [(name, module) for name, module in model.named_modules()
            if isinstance(getattr(module, "lora_A", None), torch.nn.ModuleDict) and "default" in module.lora_A]


def module_key(peft_module_name: str) -> str:
    """A peft module's name as the base model calls it (`model.layers.0.self_attn.q_proj`)."""
    return peft_module_name.removeprefix("base_model.model.")


def adapter_payload(model: torch.nn.Module, rank: int, dtype: str) -> dict | None:
    """Collective over the actor's ranks: every rank gathers each LoRA factor (full tensors from
    FSDP2 shards), rank 0 returns the payload, the others None.

    Payload: `tensors` (peft's saved names, `base_model.model.<module>.lora_A.weight`, in `dtype`,
    B multiplied by the module's scaling in float32 first), `config` (adapter_config.json's fields,
    lora_alpha = r so vLLM's scaling is 1), `checksums` ({module: (sum, sum of squares) of A and of
    B as sent}) and `bytes`."""
    target = getattr(torch, dtype)
    tensors, sums, config = {}, {}, None
    for name, module in lora_modules(model):
        a = full_tensor(module.lora_A["default"].weight.detach())
        b = full_tensor(module.lora_B["default"].weight.detach())
        if rank != 0:
            continue
        scale = float(module.scaling["default"])
        a = a.detach().to("cpu", target).contiguous()
        b = (b.detach().float().cpu() * scale).to(target).contiguous()
        key = module_key(name)
        tensors[f"base_model.model.{key}.lora_A.weight"] = a
        tensors[f"base_model.model.{key}.lora_B.weight"] = b
        sums[key] = {"A": checksum(a), "B": checksum(b)}
        if config is None:
            config = _adapter_config(model, a.shape[0])
    if rank != 0:
        return None
    if not tensors:
        raise WeightSyncError("adapter sync: the actor has no LoRA layers (actor.lora.rank is 0?); set "
                              "weight_sync.lora=folded or give actor.lora.rank")
    return {"tensors": tensors, "config": config, "checksums": sums,
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}


def live_adapter_checksums(model: torch.nn.Module, rank: int, dtype: str) -> dict | None:
    """Collective over the actor's ranks: the checksums the engine's adapter must match, taken from the
    actor's live LoRA weights as peft's own state dict names them (`get_peft_model_state_dict`), cast
    and scaled as the payload sends them, by a path that shares nothing with `adapter_payload` but the
    arithmetic: a payload built from other weights (another version, a wrong module, a wrong scaling)
    is caught even though it matches its own checksums. Rank 0 returns {module: {"A": .., "B": ..}}."""
    from peft import get_peft_model_state_dict

    config = model.peft_config["default"]
    if config.rank_pattern or config.alpha_pattern:
        raise WeightSyncError("adapter sync: per-module LoRA ranks or alphas (rank_pattern / alpha_pattern) are not "
                              "served as an adapter; set weight_sync.lora=folded")
    scale = config.lora_alpha / (config.r ** 0.5 if config.use_rslora else config.r)
    target, sums = getattr(torch, dtype), {}
    for name, tensor in get_peft_model_state_dict(model).items():  # the same order on every rank
        value = full_tensor(tensor.detach())
        if rank != 0 or not name.endswith((".lora_A.weight", ".lora_B.weight")):
            continue
        key, factor = module_key(name.rsplit(".lora_", 1)[0]), name.rsplit(".lora_", 1)[1][0]
        value = value.to("cpu", target) if factor == "A" else (value.float().cpu() * scale).to(target)
        sums.setdefault(key, {})[factor] = checksum(value.contiguous())
    return sums if rank == 0 else None


def _adapter_config(model: torch.nn.Module, r: int) -> dict:
    peft_config = model.peft_config["default"]
    if getattr(peft_config, "use_dora", False):
        raise WeightSyncError("adapter sync: a DoRA adapter is not served by vLLM; set weight_sync.lora=folded")
    targets = peft_config.target_modules
    return {"peft_type": "LORA", "r": r, "lora_alpha": r, "use_rslora": False, "bias": "none",
            "target_modules": sorted(targets) if isinstance(targets, (set, list, tuple)) else targets,
            "modules_to_save": None, "task_type": "CAUSAL_LM"}


# ---- rollout side -------------------------------------------------------------------------------


def write_adapter(directory: Path, payload: dict) -> Path:
    """The payload as a peft adapter directory (adapter_config.json, adapter_model.safetensors),
    written under a temporary name and renamed: vLLM never reads a half-written adapter."""
    from safetensors.torch import save_file

    directory = Path(directory)
    partial = directory.with_name(directory.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    (partial / ADAPTER_CONFIG).write_text(json.dumps(payload["config"]))
    save_file(payload["tensors"], partial / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    shutil.rmtree(directory, ignore_errors=True)
    partial.rename(directory)
    return directory


def engine_adapter_checksums(worker, lora_id: int) -> dict | None:
    """Inside vLLM's worker: per module of the adapter registered under `lora_id`, (sum, sum of
    squares) of its A and of its B as vLLM holds them, parts of a stacked module (q/k/v into
    qkv_proj) summed; None when no adapter has that id. Written against vllm 0.32's LoRA manager."""
    manager = getattr(getattr(worker.model_runner, "lora_manager", None), "_adapter_manager", None)
    if manager is None or not hasattr(manager, "_registered_adapters"):
        raise RuntimeError("vllm's LoRA manager moved (model_runner.lora_manager._adapter_manager."
                           "_registered_adapters): update hybridflow.resharding.adapter.engine_adapter_checksums")
    adapter = manager._registered_adapters.get(lora_id)
    if adapter is None:
        return None
    sums = {}
    for name, weights in adapter.loras.items():
        entry = {}
        for factor, tensors in (("A", weights.lora_a), ("B", weights.lora_b)):
            parts = [t for t in (tensors if isinstance(tensors, list) else [tensors]) if t is not None]
            pair = [checksum(t) for t in parts]
            entry[factor] = (sum(p[0] for p in pair), sum(p[1] for p in pair))
        entry["scaling"] = [s for s in (weights.scaling if isinstance(weights.scaling, list) else [weights.scaling])
                            if s is not None]
        sums[name] = entry
    return {"sums": sums, "packed": {k: list(v) for k, v in (getattr(manager, "packed_modules_mapping", {})
                                                              or {}).items()}}


def verify_adapter(found: dict | None, expected: dict[str, dict], served: str, version: int,
                   rank: int, rtol: float = 1e-6) -> dict[str, float]:
    """Compare the engine's adapter (`found`, `engine_adapter_checksums` of the id it serves,
    `served` naming it) with the actor's checksums of policy `version`; raise WeightSyncError
    naming what the engine serves instead. Returns `weight_sync/verified_tensors` (A and B per
    module)."""
    where = f"rollout rank {rank} after the adapter sync of policy version {version}"
    if found is None:
        raise WeightSyncError(f"{where}: the engine serves {served}, not the actor's adapter: the adapter never "
                              "reached it, so generation would sample the base model (or an old adapter) while the "
                              "actor trains another (weight_sync.lora=adapter)")
    mismatches, covered = [], set()
    for name, entry in found["sums"].items():
        parts = _parts(name, found["packed"], expected)
        if not parts:
            mismatches.append(f"{name}: the engine's adapter has a module the actor's has not")
            continue
        covered.update(parts)
        if any(s != 1 for s in entry["scaling"]):
            mismatches.append(f"{name}: vLLM scales it by {entry['scaling']}, the sent adapter by 1")
        for factor in ("A", "B"):
            want = (sum(expected[p][factor][0] for p in parts), sum(expected[p][factor][1] for p in parts))
            got = entry[factor]
            if not (_close(got[0], want[0], rtol, want[1] ** 0.5) and _close(got[1], want[1], rtol)):
                mismatches.append(f"{name}.lora_{factor}: engine sum={got[0]:.6g} sumsq={got[1]:.6g}, actor "
                                  f"sum={want[0]:.6g} sumsq={want[1]:.6g}")
    missing = sorted(set(expected) - covered)
    if missing:
        mismatches.append(f"{len(missing)} of the actor's adapted modules are not in the engine's adapter "
                          f"(e.g. {missing[0]})")
    if mismatches:
        raise WeightSyncError(f"{where}: the adapter the engine serves ({served}) is not the actor's: "
                              f"{len(mismatches)} difference(s): " + "; ".join(mismatches[:5]))
    return {"weight_sync/verified_tensors": float(2 * len(covered))}


def _parts(name: str, packed: dict[str, list[str]], expected: dict) -> list[str]:
    if name in expected:
        return [name]
    for fused, parts in packed.items():
        if name.endswith(f".{fused}"):
            names = [name[: -len(fused)] + p for p in parts]
            return [n for n in names if n in expected]
    return []


def _close(a: float, b: float, rtol: float, scale: float = 0.0) -> bool:
    return abs(a - b) <= rtol * max(abs(b), scale, 1e-12)


def check_served(outputs, adapter, rank: int) -> None:
    """Every vLLM output was generated with `adapter` (the LoRARequest the rollout serves; None
    before the first sync); raise WeightSyncError naming the request that was not."""
    want = None if adapter is None else adapter.lora_int_id
    for out in outputs:
        got = None if out.lora_request is None else out.lora_request.lora_int_id
        if got != want:
            have = "the base model (no adapter)" if got is None else f"adapter id {got} ({out.lora_request.lora_name})"
            raise WeightSyncError(f"rollout rank {rank}: request {out.request_id} was generated with {have}, while "
                                  f"the engine serves {describe(adapter)}: its samples are not the actor's policy")


def describe(adapter) -> str:
    return "no adapter" if adapter is None else f"adapter {adapter.lora_name} (id {adapter.lora_int_id})"
