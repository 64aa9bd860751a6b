"""The generation side of a weight sync, inside vLLM: our transfer engine and what it needs.

`HybridFlowTransferEngine` is a vLLM weight-transfer engine (`vllm/distributed/weight_transfer`)
registered under the name `hybridflow`. vLLM builds it in each worker when the engine is
created with `weight_transfer_config={"backend": "hybridflow"}`, and drives it through its own
lifecycle: `init_weight_transfer_engine` (open this rank's end of the transport's route, for a
rollout on a pool of its own), `start_weight_update` (vLLM's layerwise reload), `update_weights`
once per bucket, `finish_weight_update` (process the loaded layers). Each init and update names
its `route` (a transport, hybridflow.resharding.transports), and the engine delegates to it: the
route opens its link and turns an update into tensors — handed over in the same process
(colocated, or weights staged earlier) or received from the training side's sender (broadcast: one
flat buffer per layout holding only that layout's slice of each tensor, over gloo or NCCL).

vLLM's own engines (`nccl`, `ipc`, ...) broadcast full tensors from one trainer rank to every
worker, which cannot express "each generation rank receives only the part of its slice its
own training shard lacks", and need CUDA; so the transport here is ours, while the lifecycle
(layerwise reload, the update-session guards, LoRA-state reset) is vLLM's.

`needed_boxes` tells, for this worker's tensor-parallel rank, which region of every checkpoint
tensor vLLM's loaders read — by watching the model's own loaders (`workers.rollout.vllm.regions`),
not from a table of model names or layer types.
"""

from __future__ import annotations

import torch

from hybridflow.resharding.transports.base import BucketUpdate, RouteInit
from hybridflow.resharding.verify import checksum

ENGINE_NAME = "hybridflow"


def _engine_class():
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    class HybridFlowTransferEngine(WeightTransferEngine):
        init_info_cls = RouteInit
        update_info_cls = BucketUpdate
        supports_draft_weight_update = False

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.link = None  # what the route's `open_receiving` opened (a transfer group)
            self.received_bytes = 0

        def init_transfer_engine(self, init_info: RouteInit) -> None:
            self.link = init_info.route.open_receiving(init_info)

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            self.received_bytes = 0
            initialize_layerwise_reload(self.model)

        def update_weights(self, update_info: dict) -> None:  # no device synchronize on the CPU
            self.receive_weights(self.parse_update_info(update_info))
            if torch.cuda.is_available():
                torch.cuda.synchronize()

        def receive_weights(self, info: BucketUpdate) -> None:
            if info.route is None:
                raise ValueError(f"bucket {info.bucket} names no route (hybridflow.resharding.transports)")
            self.model.load_weights(info.route.receive_bucket(self, info))

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            mark_layers_without_checkpoint_tensors(self.model)
            finalize_layerwise_reload(self.model, self.model_config)

        def shutdown(self) -> None:
            self.link = None

    return HybridFlowTransferEngine


def mark_layers_without_checkpoint_tensors(model: torch.nn.Module) -> list[str]:
    """Tell vLLM's layerwise reload which layers receive no tensor by design; returns their names.

    At the end of a reload vLLM puts back the old tensors of every layer that received none,
    and warns "<Layer>: Failed to load weights" for each one that had something to load. Two
    kinds of layer never receive anything, at every sync, and that is right:
    - a rotary embedding: its only tensor is the cos/sin cache, a non-persistent buffer that
      vLLM computes and no checkpoint holds;
    - an lm_head tied to the input embedding (`tie_word_embeddings`): its weight is the
      embedding's own Parameter, filled when `embed_tokens` loads (checkpoints carry no
      `lm_head.weight`, and the model's loader skips it).
    For those, and only those, we record that there is nothing to load (`load_numel_total = 0`):
    vLLM then puts their tensors back without the warning, exactly as before. A layer with a
    tensor of its own that received nothing still warns: that is a real failed load.
    Call it after the last bucket, before `finalize_layerwise_reload`: a layer that loaded has
    been processed and reset by then (`can_load()` is false), one that did not is still pending.
    Written against vllm 0.32's `model_loader/reload` (LayerReloadingInfo); raises if it moved.
    """
    from vllm.model_executor.model_loader.reload import layerwise

    layers = [(name, layer, layerwise.get_layerwise_info(layer)) for name, layer in model.named_modules()]
    fields = {"kernel_tensors", "kernel_non_persistent_buffers", "load_numel", "load_numel_total"}
    missing = fields - set(getattr(type(layers[0][2]), "__dataclass_fields__", {})) if layers else set()
    if missing or not hasattr(layerwise, "SKIP_LOAD_TENSORS") or not hasattr(layerwise, "is_deferred_attention_layer"):
        raise RuntimeError(f"vllm's layerwise reload moved (LayerReloadingInfo lacks {sorted(missing)}, or "
                           "SKIP_LOAD_TENSORS / is_deferred_attention_layer are gone); update "
                           "workers.rollout.vllm.transfer.mark_layers_without_checkpoint_tensors")
    skipped = layerwise.SKIP_LOAD_TENSORS
    loaded = {id(p) for _, layer, info in layers if not info.can_load() for p in layer.parameters(recurse=False)}
    marked = []
    for name, layer, info in layers:
        if not info.can_load() or info.load_numel > 0 or not info.load_numel_total or info.kernel_tensors is None \
                or layerwise.is_deferred_attention_layer(layer):
            continue
        params, buffers = info.kernel_tensors
        tied = all(id(p) in loaded for n, p in params.items() if n not in skipped)
        computed = all(n in info.kernel_non_persistent_buffers for n in buffers if n not in skipped)
        if tied and computed:
            info.load_numel_total = 0
            marked.append(name)
    return marked


def register_engine() -> None:
    """Register `hybridflow` in vLLM's WeightTransferEngineFactory (once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if ENGINE_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(ENGINE_NAME, _engine_class())


# ---- functions run inside the vLLM worker through collective_rpc --------------------------------


def seed_sampler(worker, seed: int) -> bool:
    """Seed the default generators vLLM's sampler draws from for requests without a seed of their own
    (one stream per batch: workers/rollout/vllm_rollout.py), in the worker's process."""
    torch.manual_seed(seed)
    return True


def received_bytes(worker) -> int:
    return worker.weight_transfer_engine.received_bytes


def stage_bucket(worker, update: dict) -> list[tuple[str, torch.Tensor]]:
    """Receive one bucket over the transfer group into host memory, as full-shape tensors with
    this rank's boxes filled, without touching the model (it may be generating meanwhile)."""
    engine = worker.weight_transfer_engine
    info = engine.parse_update_info(update)
    return info.route.stage_bucket(engine, info)


def needed_boxes(worker, shapes: dict[str, list[int]]) -> dict[str, tuple]:
    """Per checkpoint tensor, the ranges this tensor-parallel rank's loaders read from it: found by
    running the model's own loaders on placeholders (`workers.rollout.vllm.regions`)."""
    from workers.rollout.vllm.regions import needed_boxes as boxes_read

    return {name: box.travelling() for name, box in boxes_read(worker.model_runner.get_model(), shapes).items()}


def refresh_cpu_kernels(worker) -> int:
    """After a reload, rebuild CPU kernels of layers that kept their weight.

    On the CPU backend a layer's GEMM kernel holds a packed copy of its weight, rebuilt when the
    layer itself is reloaded. A layer that receives no tensor of its own, such as an lm_head tied
    to the input embedding, keeps a kernel packed from the old weights although its (shared)
    parameter holds the new ones: generation would silently use stale weights. Rebuilding the
    kernel of every layer that still holds a readable weight closes that gap. No-op on GPUs.
    """
    refreshed = 0
    for module in worker.model_runner.get_model().modules():
        if _repack_cpu_experts(module):
            refreshed += 1
            continue
        weight = getattr(module, "weight", None)
        method = getattr(module, "quant_method", None)
        if hasattr(module, "cpu_linear") and weight is not None and weight.numel() and method is not None:
            method.process_weights_after_loading(module)
            refreshed += 1
    return refreshed


def _repack_cpu_experts(module: torch.nn.Module) -> bool:
    """Put a reloaded MoE layer's expert weights back in the CPU kernel's packed layout.

    vLLM 0.32's unquantized MoE method, on a weight update (its kernel already built), copies the
    reloaded checkpoint-layout weights into the layer's storage but does not run the CPU experts'
    prepack again (it does only on the first load): the CPU grouped GEMM then reads unpacked
    weights as packed ones and computes another model (Qwen3-MoE's probe gap after a sync of
    unchanged weights: 0.018). Running the experts' own `process_weights_after_loading` again
    repacks them. No-op on other layers and on GPUs."""
    experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
    if experts is None or not any(c.__name__ == "CPUUnquantizedExperts" for c in type(experts).__mro__):
        return False
    experts.process_weights_after_loading(module)
    return True


def param_checksums(worker) -> dict:
    """Checksums (sum, sum of squares in float64: verify.py `checksum`, the actor's) of every readable vLLM parameter.

    MoE expert weights are left out (listed under `unchecked`): vLLM stacks every expert of a
    layer into one parameter (`w13_weight`, `w2_weight`) with no name-for-name map back to the
    checkpoint's per-expert tensors; the log-prob probe covers them."""
    model = worker.model_runner.get_model()
    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    experts = {id(p) for m in model.modules() if getattr(getattr(m, "quant_method", None), "moe_kernel", None)
               is not None for p in m.parameters(recurse=False)}
    sums, empty, unchecked = {}, [], []
    for name, param in model.named_parameters():
        if id(param) in experts:
            unchecked.append(name)
            continue
        if param.numel() == 0:
            empty.append(name)
            continue
        sums[name] = checksum(param)  # the actor's function: chunked, no float64 copy of the whole
    return {"sums": sums, "packed": packed, "empty": empty, "unchecked": unchecked}


def buffer_checksums(worker) -> dict[str, tuple[float, float]]:
    """Checksums of the model's buffers (rotary caches and other tensors no weight sync rewrites), which
    vLLM keeps in host memory across a level-2 sleep and puts back when the weights wake: compared with
    their values at start after each such reload (workers/rollout/__init__.py `loaded_whole`)."""
    return {name: checksum(b) for name, b in worker.model_runner.get_model().named_buffers()}
