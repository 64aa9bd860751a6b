"""The streaming merge loop: one output tensor at a time, in plan order.

Memory per key (T = the tensor's size in fp32):
- linear methods (SMA, EMA, WMA, linear): the fp32 accumulator, plus one 2 MiB block of
  the input being added (inputs are streamed block by block): about 1 T, whatever the
  number of inputs. Task arithmetic also holds the base tensor: about 2 T.
- TIES, DARE, SLERP and registered custom methods: all N inputs of the key at once in fp32,
  plus the method's temporaries (TIES/DARE: about N + 4 T). This is inherent to them: sign
  election and SLERP's angle need every input's value of the same entries.
- the writer converts to the output dtype block by block, so no converted copy is held.

NaN/Inf: a linear combination is non-finite wherever one of its inputs is (0 * inf is NaN),
so for linear methods only the result is scanned and the inputs are re-read to name the
culprit when it is bad. Other methods scan every input. The writer scans each converted
block, which catches overflow when writing float16.
"""

from __future__ import annotations

import math
from typing import Iterator, Optional

import torch

from hybridflow.merge.checkpoints import Checkpoint
from hybridflow.merge.errors import MergeError
from hybridflow.merge.methods import (
    MERGE_METHODS,
    METHODS_WITHOUT_BASE,
    LinearForm,
    MergeParams,
    accumulate,
    linear_form,
)
from hybridflow.merge.safetensors_io import all_finite, one_thread
from hybridflow.merge.validate import MergePlan, describe_non_finite


class StreamingMerger:
    """Yields (key, merged tensor) for every key of `plan`: fp32 for merged keys (the consumer
    converts to `out_dtypes[key]`, the writer block by block), the stored dtype for copied ones."""

    def __init__(self, inputs: list[Checkpoint], base: Optional[Checkpoint], method: str,
                 params: MergeParams, plan: MergePlan, out_dtypes: dict[str, torch.dtype],
                 reuse_output: bool = False) -> None:
        self.inputs = inputs
        self.base = None if method in METHODS_WITHOUT_BASE else base
        self.method = method
        self.fn = MERGE_METHODS.get(method)
        self.params = params
        self.form: Optional[LinearForm] = linear_form(method, len(inputs), params) if method in MERGE_METHODS else None
        self.plan = plan
        self.out_dtypes = out_dtypes
        # With reuse_output the linear path accumulates into one buffer sized for the largest
        # tensor, reused for every key: fresh memory costs a page fault per 4 KiB page, which
        # was a third of the merge's time. The consumer must use each yielded tensor before
        # asking for the next (the writer does).
        self.reuse_output = reuse_output
        self._scratch = torch.empty(0, dtype=torch.float32)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        sources = set(self.plan.tied.values())
        held: dict[str, torch.Tensor] = {}
        for key in self.plan.keys:
            if key in self.plan.tied:
                merged = held.pop(self.plan.tied[key])
            else:
                merged = self.merge_key(key)
                if key in sources:
                    held[key] = merged.clone() if self.reuse_output else merged
            yield key, merged

    def merge_key(self, key: str) -> torch.Tensor:
        if key in self.plan.copied:
            merged = self.inputs[-1].read(key)
            if not all_finite(merged):
                self._refuse(self.inputs[-1], key, merged)
            return merged
        if self.form is not None:
            with one_thread():
                merged = self._merge_linear(key)
                finite = all_finite(merged)
        else:
            merged = self._merge_all(key)
            finite = all_finite(merged)
        if not finite:
            self._diagnose(key)  # raises naming the input if one is bad
            raise MergeError(f"merged tensor {key!r} has {describe_non_finite(merged)} although every input "
                             "is finite (fp32 overflow?); check the method's weights and lambda")
        return merged

    def _merge_linear(self, key: str) -> torch.Tensor:
        """acc = Σ_i w_i * theta_i streamed block by block from each input in turn: the input
        tensor is never held whole, only one cache-sized block of it. Runs under one_thread()."""
        base = self.base.read(key).to(torch.float32).reshape(-1) if self.form.relative_to_base else None
        acc = self._accumulator(math.prod(self.inputs[-1].shape(key)))  # (numel,) fp32
        for index, (checkpoint, weight) in enumerate(zip(self.inputs, self.form.weights)):
            position = 0
            for block in checkpoint.read_chunks(key):
                end = position + block.numel()
                accumulate(acc[position:end], block, weight, base[position:end] if base is not None else None,
                           first=index == 0)
                position = end
        if base is not None:
            acc.add_(base)
        return acc.view(self.inputs[-1].shape(key))

    def _accumulator(self, numel: int) -> torch.Tensor:
        if not self.reuse_output:
            return torch.empty(numel, dtype=torch.float32)
        if self._scratch.numel() < numel:
            self._scratch = torch.empty(0)  # free the old buffer before allocating the new one
            self._scratch = torch.empty(max(numel, self._largest()), dtype=torch.float32)
        return self._scratch[:numel]

    def _largest(self) -> int:
        return max(math.prod(self.inputs[-1].shape(k)) for k in self.plan.keys if k not in self.plan.copied)

    def _merge_all(self, key: str) -> torch.Tensor:
        tensors = []
        for checkpoint in self.inputs:
            tensor = checkpoint.read(key).to(torch.float32)
            if not all_finite(tensor):
                self._refuse(checkpoint, key, tensor)
            tensors.append(tensor)
        base = None
        if self.base is not None:
            base = self.base.read(key).to(torch.float32)
            if not all_finite(base):
                self._refuse(self.base, key, base)
        return self.fn(tensors, base=base, params=self.params, name=key)

    def _diagnose(self, key: str) -> None:
        for checkpoint in self.inputs + ([self.base] if self.base is not None else []):
            tensor = checkpoint.read(key)
            if not all_finite(tensor):
                self._refuse(checkpoint, key, tensor)

    @staticmethod
    def _refuse(checkpoint: Checkpoint, key: str, tensor: torch.Tensor) -> None:
        raise MergeError(f"{checkpoint.source(key)}: tensor {key!r} has {describe_non_finite(tensor)}; "
                         "refusing to merge a checkpoint with NaN/Inf (drop it from the inputs)")
