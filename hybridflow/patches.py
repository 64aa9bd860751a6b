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
