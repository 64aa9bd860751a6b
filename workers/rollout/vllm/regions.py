"""Which region of each checkpoint tensor a vLLM rank reads, found by watching its loaders.

A tensor-parallel rank's loaders read part of each checkpoint tensor: rows of a column-parallel
layer, columns of a row-parallel one, three row ranges of a fused `qkv_proj` (Phi3), the
transposed rows or columns of GPT-2's Conv1D weights, one expert's slice of a MoE weight. How a
checkpoint name reaches a layer (a model's `hf_to_vllm_mapper`, its stacked-parameter table,
the MoE `expert_params_mapping`, a model's own transposes) differs from model to model. Rather
than restate those rules per layer type, we run the model's own `load_weights` once on
zero-storage placeholders (vLLM's `FakeRDTTensor`, which its sharded-RDT engine uses for the same
purpose): every slicing op a loader applies is recorded, and each `copy_` into a parameter says
which view of which checkpoint tensor was read. Replaying that op chain on a meta tensor of the
full shape gives the view's offset and strides, hence the box it covers.

Run inside a vLLM layerwise-reload session with the parameters on the meta device (so loaders
see checkpoint-format shapes even where the CPU backend repacked a weight) and with the original
loaders (so nothing is buffered or materialised); the session is then abandoned and every layer's
kernel tensors put back untouched.

Where the answer is not a single rectangle (a fused tensor's three row ranges), the rank asks for
the smallest box holding all of them: correct, above the minimum. A tensor whose loader does
something the placeholder cannot record (arithmetic, a dtype cast) is asked for whole.
Written against vllm 0.32's `model_loader/reload` and `weight_transfer/sharded_rdt_fake`; raises
if they moved.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import torch

from hybridflow.resharding.layout import Box


def view_box(view: torch.Tensor, base: torch.Tensor) -> Box | None:
    """The box of contiguous `base` that `view` (a strided view of it) covers, or None when the
    view is not a rectangle of `base` (a reshape across dimensions, a copy)."""
    shape = list(base.shape)
    if view is not base and view._base is not base:
        return None
    if view.numel() == 0:
        return Box(tuple((0, 0) for _ in shape))
    strides = base.stride()
    start, rest = [], view.storage_offset()
    for stride in strides:
        start.append(rest // stride)
        rest %= stride
    ranges = [(s, s + 1) for s in start]
    used = set()
    for size, stride in zip(view.shape, view.stride()):
        if size == 1:
            continue
        dims = [d for d in range(len(shape)) if strides[d] == stride and shape[d] > 1 and d not in used]
        if not dims or start[dims[0]] + size > shape[dims[0]]:
            return None
        used.add(dims[0])
        ranges[dims[0]] = (start[dims[0]], start[dims[0]] + size)
    box = Box(tuple(ranges))
    return box if box.numel == view.numel() else None


def replay(shape: Sequence[int], ops) -> Box | None:
    """The box of a full tensor of `shape` that a recorded op chain selects (None: not a box)."""
    base = torch.empty(tuple(shape), device="meta")
    current = base
    for name, args, kwargs in ops:
        if name == "contiguous":
            continue  # a copy of the same elements: the region is unchanged
        if name == "__getitem__" and isinstance(current, (tuple, list)):
            current = current[args[0]]
        else:
            current = getattr(torch.Tensor, name)(current, *args, **dict(kwargs))
    return view_box(current, base) if isinstance(current, torch.Tensor) else None


def bounding(boxes: Sequence[Box], shape: Sequence[int]) -> Box:
    """The smallest box holding every box (the whole tensor when there are none)."""
    if not boxes:
        return Box.whole(shape)
    return Box(tuple((min(b.ranges[d][0] for b in boxes), max(b.ranges[d][1] for b in boxes))
                     for d in range(len(shape))))


def union_numel(boxes: Sequence[Box]) -> int:
    """Elements in the union of boxes (loaders read disjoint regions; overlaps are counted once)."""
    boxes = list(dict.fromkeys(boxes))
    total = sum(b.numel for b in boxes)
    for i, a in enumerate(boxes):  # inclusion-exclusion to pairs: enough for the few boxes one tensor has
        total -= sum(a.intersect(b).numel for b in boxes[i + 1:])
    return total


def read_regions(model: torch.nn.Module, shapes: dict[str, list[int]], dtype: torch.dtype = torch.float32
                 ) -> dict[str, list[Box] | None]:
    """Per checkpoint name: the boxes this rank's loaders read, [] when they read none of it, None
    when a loader did something that is not a slice (ask for the whole tensor)."""
    from vllm.distributed.weight_transfer.sharded_rdt_fake import FakeRDTTensor

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    sink = _Sink()
    found: dict[str, list[Box] | None] = {}
    with _dry_run(model):
        for name, shape in shapes.items():
            sink.copies.clear()
            fake = FakeRDTTensor(name=name, shape=torch.Size(shape), dtype=dtype, device=device, sink=sink)
            try:
                model.load_weights([(name, fake)])
            except NotImplementedError:  # vLLM's "unsupported op on a placeholder"
                found[name] = None
                continue
            boxes = [replay(shape, ops) for ops in sink.copies]
            found[name] = None if any(b is None for b in boxes) else boxes
    return found


class _Sink:
    """Receives every `copy_` from a placeholder: records the op chain, copies nothing."""

    def __init__(self) -> None:
        self.copies: list = []

    def accept_copy(self, dest: torch.Tensor, src) -> torch.Tensor:
        self.copies.append(src._ops)
        return dest


class _dry_run:
    """Parameters on meta in checkpoint format, original loaders in place; afterwards the layers'
    kernel tensors are put back and the reload session reset, as if it never started."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __enter__(self):
        from vllm.model_executor.model_loader.reload import layerwise
        from vllm.model_executor.model_loader.reload.utils import get_layer_tensors
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        for needed in ("initialize_layerwise_reload", "_get_original_loader", "_place_kernel_tensors", "LAYERWISE_INFO"):
            if not hasattr(layerwise, needed):
                raise RuntimeError(f"vllm's layerwise reload has no {needed}: update workers.rollout.vllm.regions")
        layerwise.initialize_layerwise_reload(self.model)
        self.wrapped = []
        for module in self.model.modules():
            for name, tensor in get_layer_tensors(module).items():
                original = getattr(tensor, "weight_loader", None)
                inner = default_weight_loader if original is None else layerwise._get_original_loader(tensor)
                self.wrapped.append((tensor, original))
                tensor.weight_loader = inner
        return self

    def __exit__(self, *exc) -> None:
        from vllm.model_executor.model_loader.reload import layerwise

        for tensor, original in self.wrapped:
            if original is None:
                del tensor.weight_loader
            else:
                tensor.weight_loader = original
        for layer in self.model.modules():
            info = layerwise.LAYERWISE_INFO.get(layer)
            if info is not None and info.can_load():
                if info.kernel_tensors is not None:
                    layerwise._place_kernel_tensors(layer, info)
                info.reset()
        if hasattr(self.model, "_original_do_torchao_reload"):
            self.model._do_torchao_reload = self.model._original_do_torchao_reload


def needed_boxes(model: torch.nn.Module, shapes: dict[str, list[int]]) -> dict[str, Box]:
    """Per checkpoint name, the box to send this rank: the one box its loaders read, or the
    bounding box of several (with them as `parts`), or the whole tensor where a loader did not
    slice or read nothing (a name vLLM drops)."""
    boxes = {}
    for name, found in read_regions(model, shapes).items():
        shape = shapes[name]
        if not found:
            boxes[name] = Box.whole(shape)
        elif len(set(found)) == 1:
            boxes[name] = found[0]
        else:
            parts = tuple(dict.fromkeys(found))
            if union_numel(parts) != sum(p.numel for p in parts):
                boxes[name] = bounding(parts, shape)  # overlapping reads: count the box itself
            else:
                boxes[name] = Box(bounding(parts, shape).ranges, parts)
    return boxes


def describe(found: dict[str, list[Box] | None]) -> dict[str, int]:
    """How many tensors were read as one box, as several, whole (not a slice), or not at all."""
    counts: dict[str, int] = defaultdict(int)
    for boxes in found.values():
        counts["whole" if boxes is None else "unread" if not boxes else "box" if len(boxes) == 1 else "fused"] += 1
    return dict(counts)
