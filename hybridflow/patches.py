"""Every patch HybridFlow applies to a dependency, in one place.

Each is gated on the installed version, checks that its target still exists, and raises if
the target moved, so an upgrade fails loudly instead of silently changing behaviour.
"""

from __future__ import annotations

import functools
import os

_applied: set[str] = set()


def _check_vllm_version(patch: str, target: str) -> None:
    import vllm

    if not vllm.__version__.startswith("0.32"):
        raise RuntimeError(f"hybridflow.patches.{patch} was written for vllm 0.32, found {vllm.__version__}; "
                           f"re-check {target} and update the patch")


def keep_vllm_cpu_linear_weights() -> None:
    """Keep vLLM's unpacked linear weights readable on the CPU backend.

    vLLM's CPU backend repacks each linear weight for its GEMM kernel and replaces the
    parameter with an empty tensor, so the weights in the engine cannot be read back. Weight
    checksums (`weight_sync.checksum_every_steps`) need to read them, so in that mode only we ask
    the dispatcher to keep the parameter (it costs one more copy of the linear weights).
    Checked against vllm 0.32.
    """
    if "keep_vllm_cpu_linear_weights" in _applied:
        return
    _check_vllm_version("keep_vllm_cpu_linear_weights", "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm")
    from vllm.model_executor.layers import utils

    original = getattr(utils, "dispatch_cpu_unquantized_gemm", None)
    if original is None:
        raise RuntimeError("vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm moved; update the patch")

    @functools.wraps(original)
    def dispatch_keeping_weight(layer, remove_weight: bool):
        return original(layer, remove_weight=False)

    utils.dispatch_cpu_unquantized_gemm = dispatch_keeping_weight
    assert utils.dispatch_cpu_unquantized_gemm is dispatch_keeping_weight
    _applied.add("keep_vllm_cpu_linear_weights")


SHM_IDENT_VAR = "HYBRIDFLOW_VLLM_SHM_IDENT"


def unique_vllm_cpu_shm_names() -> None:
    """Give each tensor-parallel vLLM engine on the CPU shared-memory segments of its own.

    The CPU backend's all-reduce goes through /dev/shm segments named from VLLM_DIST_IDENT,
    which the CPU worker derives from its init method; under `external_launcher` that is
    `env://`, so every TP engine on a machine gets the same names, and a second engine — or the
    next one after a process was killed — fails with "create shm in SHMManager failed. errno: 17".
    We prefix the names with `$HYBRIDFLOW_VLLM_SHM_IDENT` (set per engine by the rollout worker)
    and unlink each rank's segment once every rank has mapped it, so a killed engine leaves no
    segment behind. Checked against vllm 0.32.
    """
    if "unique_vllm_cpu_shm_names" in _applied:
        return
    _check_vllm_version("unique_vllm_cpu_shm_names", "vllm.distributed.device_communicators.cpu_communicator")
    from vllm.distributed.device_communicators import cpu_communicator

    cls = getattr(cpu_communicator, "_CPUSHMDistributed", None)
    if cls is None or not hasattr(cls, "make_group_name") or not hasattr(cls, "_init_cpu_shm"):
        raise RuntimeError("vllm's _CPUSHMDistributed.make_group_name/_init_cpu_shm moved; update the patch")
    original_name, original_init = cls.make_group_name, cls._init_cpu_shm

    def make_group_name(communicator) -> str:
        return f"{os.environ[SHM_IDENT_VAR]}-{original_name(communicator).lstrip('/')}"

    def init_then_unlink(self) -> int:
        handle = original_init(self)  # ends with a barrier: every rank has mapped every segment
        path = f"/dev/shm/{self.group_name.lstrip('/')}_{self.communicator.rank}"
        if os.path.exists(path):
            os.unlink(path)
        return handle

    cls.make_group_name = staticmethod(make_group_name)
    cls._init_cpu_shm = init_then_unlink
    assert cls._init_cpu_shm is init_then_unlink
    _applied.add("unique_vllm_cpu_shm_names")


def transformers_backend_classes_stay_callable(engine) -> list[str]:
    """Keep a colocated actor's model callable after vLLM's Transformers backend wrapped its class.

    vLLM 0.32 serves some architectures (OLMo2, ...) through its Transformers backend, which
    decorates the *transformers* model class in place with `support_torch_compile`: the class's
    `__call__` then reads `self.do_not_compile`, an attribute only instances built after the
    decoration have. An actor in the same process built its model before the engine started, so
    its forward raised `AttributeError: 'Olmo2Model' object has no attribute 'do_not_compile'`.
    A class-level `do_not_compile = True` makes such older instances run their plain `forward`;
    vLLM's own instance sets the attribute itself and is unaffected. Returns the classes patched.
    """
    from vllm.compilation import decorators

    _check_vllm_version("transformers_backend_classes_stay_callable", "vllm.compilation.decorators")
    if not hasattr(decorators, "support_torch_compile"):
        raise RuntimeError("vllm.compilation.decorators.support_torch_compile moved; update "
                           "hybridflow.patches.transformers_backend_classes_stay_callable")

    def patch(worker) -> list[str]:
        import torch

        patched = []
        for module in worker.model_runner.get_model().modules():
            cls = type(module)  # a transformers class whose __call__ vLLM replaced
            if cls.__module__.startswith("transformers.") and cls.__call__ is not torch.nn.Module.__call__ \
                    and "do_not_compile" not in cls.__dict__:
                cls.do_not_compile = True
                patched.append(cls.__name__)
        return patched

    return engine.collective_rpc(patch)[0]


def grouped_cpu_lora_ops() -> None:
    """vLLM's CPU LoRA kernels at a matrix product's speed: one GEMM per adapter in the batch.

    On the CPU vLLM applies LoRA with plain torch ops (`vllm/lora/ops/torch_ops/lora_ops.py`, used
    by `PunicaWrapperCPU`): every token gathers its own copy of its adapter's A or B
    (`weights[indices]`, tokens x out x r values) and multiplies it as a batched matrix-vector
    product. For SmolLM2-135M at rank 16 that made generation 6x slower than without LoRA (33 s
    against 5 s for a 64-sample GRPO batch), the whole gain of moving megabytes instead of the model.
    Here the tokens are grouped by adapter index and each group is one matrix product with that
    adapter's weights (one group when every request carries the same adapter, as in RL): the same
    arithmetic, read once per adapter instead of once per token. Indices are used exactly as the
    original uses them (an index of -1 reads the last slot, as `weights[-1]` does there). A call
    whose shapes the original handles differently (fewer indices than input rows) goes to the
    original. Checked against vllm 0.32; tests/unit/test_patches.py compares both on random inputs.
    """
    if "grouped_cpu_lora_ops" in _applied:
        return
    _check_vllm_version("grouped_cpu_lora_ops", "vllm.lora.ops.torch_ops.lora_ops")
    import torch
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    names = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")
    original = {n: getattr(lora_ops, n, None) for n in names}
    if None in original.values() or any(getattr(punica_cpu, n, None) is not original[n] for n in names):
        raise RuntimeError("vllm.lora.ops.torch_ops.lora_ops.bgmv_* or their use in punica_cpu moved; update "
                           "hybridflow.patches.grouped_cpu_lora_ops")

    def grouped(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
        """Row t: inputs[t] @ weights[indices[t]].T, one matrix product per distinct index."""
        inputs = inputs.to(dtype)
        if weights.dim() == 4:
            weights = weights.squeeze(1)  # (slots, out, in)
        distinct = torch.unique(indices).tolist()
        if len(distinct) == 1:
            return inputs @ weights[distinct[0]].to(dtype).T
        out = inputs.new_empty((inputs.shape[0], weights.shape[1]))
        for index in distinct:
            rows = (indices == index).nonzero().squeeze(1)
            out[rows] = inputs[rows] @ weights[index].to(dtype).T
        return out

    def fits(inputs: torch.Tensor, indices: torch.Tensor) -> bool:
        return inputs.dim() == 2 and indices.dim() == 1 and inputs.shape[0] == indices.shape[0] > 0

    def bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0):
        if not fits(inputs, lora_indices_tensor):
            return original["bgmv_shrink"](inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling)
        outputs = grouped(inputs, lora_a_weights, lora_indices_tensor, output_tensor.dtype)
        output_tensor[:, : outputs.shape[1]] = scaling * outputs

    def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs: bool = True):
        if not fits(inputs, lora_indices_tensor) or inputs.shape[0] > output_tensor.shape[0]:
            return original["bgmv_expand"](inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs)
        outputs = grouped(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
        limit = 1 if outputs.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
        common = min(outputs.shape[1], output_tensor.shape[1])
        if add_inputs:
            output_tensor[:, :common] += outputs[:limit, :common]
        else:
            output_tensor[:, :common] = outputs[:limit, :common]

    def bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset: int,
                          slice_size: int, add_inputs: bool = True):
        if not fits(inputs, lora_indices_tensor):
            return original["bgmv_expand_slice"](inputs, lora_b_weights, output_tensor, lora_indices_tensor,
                                                 slice_offset, slice_size, add_inputs)
        outputs = grouped(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
        if add_inputs:
            output_tensor[:, slice_offset: slice_offset + slice_size] += outputs
        else:
            output_tensor[:, slice_offset: slice_offset + slice_size] = outputs

    for name, fn in (("bgmv_shrink", bgmv_shrink), ("bgmv_expand", bgmv_expand),
                     ("bgmv_expand_slice", bgmv_expand_slice)):
        functools.update_wrapper(fn, original[name])
        setattr(lora_ops, name, fn)  # the sgmv_* (prefill) ops call these through the module
        setattr(punica_cpu, name, fn)  # the decode ops, imported by name there
    _applied.add("grouped_cpu_lora_ops")
