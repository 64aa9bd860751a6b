"""Every patch HybridFlow applies to a dependency, in one place.

Each is gated on the installed version, checks that its target still exists, and raises if
the target moved, so an upgrade fails loudly instead of silently changing behaviour.
"""

from __future__ import annotations

import functools

_applied: set[str] = set()


def keep_vllm_cpu_linear_weights() -> None:
    """Keep vLLM's unpacked linear weights readable on the CPU backend.

    vLLM's CPU backend repacks each linear weight for its GEMM kernel and replaces the
    parameter with an empty tensor, so the weights in the engine cannot be read back. Weight
    verification (`trainer.verify_weight_sync`) needs to read them, so in that mode only we ask
    the dispatcher to keep the parameter (it costs one more copy of the linear weights).
    Checked against vllm 0.32.
    """
    if "keep_vllm_cpu_linear_weights" in _applied:
        return
    import vllm
    from vllm.model_executor.layers import utils

    if not vllm.__version__.startswith("0.32"):
        raise RuntimeError(
            f"hybridflow.patches.keep_vllm_cpu_linear_weights was written for vllm 0.32, found {vllm.__version__}; "
            "re-check vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm and update the patch")
    original = getattr(utils, "dispatch_cpu_unquantized_gemm", None)
    if original is None:
        raise RuntimeError("vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm moved; update the patch")

    @functools.wraps(original)
    def dispatch_keeping_weight(layer, remove_weight: bool):
        return original(layer, remove_weight=False)

    utils.dispatch_cpu_unquantized_gemm = dispatch_keeping_weight
    assert utils.dispatch_cpu_unquantized_gemm is dispatch_keeping_weight
    _applied.add("keep_vllm_cpu_linear_weights")
