"""Checks made before anything is written, and the per-tensor plan they produce.

Rules (docs/merge.md):
- every input has the same keys, shapes and dtypes as the newest (last) input; the base
  model, when there is one, the same keys and shapes. Errors list the first mismatches.
- integer and bool tensors, and known buffers (rotary inv_freq, position ids, BatchNorm
  counters, GPT-2's causal-mask `attn.bias`), are copied from the newest input, never merged.
- tied weights stay tied: an lm_head absent from the inputs is not invented; an
  lm_head equal to the input embedding in every input is written as a copy of the merged
  embedding (merged once), so methods with randomness (DARE) cannot untie them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from hybridflow.merge.checkpoints import Checkpoint
from hybridflow.merge.errors import MergeError

MAX_LISTED = 10
BUFFER_SUFFIXES = ("rotary_emb.inv_freq", "inv_freq", "position_ids", "num_batches_tracked",
                   "attn.bias", "attn.masked_bias")
OUTPUT_EMBEDDING_SUFFIXES = ("lm_head.weight", "embed_out.weight")
INPUT_EMBEDDING_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")


@dataclass
class MergePlan:
    """What to do with each key, in output order."""

    keys: list[str]
    copied: set[str] = field(default_factory=set)  # taken from the newest input as is
    tied: dict[str, str] = field(default_factory=dict)  # key -> the key whose merged value it repeats


def is_buffer(key: str) -> bool:
    return any(key == suffix or key.endswith("." + suffix) for suffix in BUFFER_SUFFIXES)


def check_inputs(inputs: list[Checkpoint], base: Optional[Checkpoint]) -> None:
    """Raise MergeError listing the first mismatches in keys, shapes and dtypes."""
    reference = inputs[-1]
    keys = reference.keys()
    if not keys:
        raise MergeError(f"{reference.path} holds no tensors")
    problems: list[str] = []
    others = [(c, True) for c in inputs[:-1]] + ([(base, False)] if base is not None else [])
    for other, same_dtype in others:
        problems += _compare(reference, other, keys, same_dtype)
    if problems:
        shown = "\n  ".join(problems[:MAX_LISTED])
        raise MergeError(
            f"inputs do not match the newest input {reference.path} ({len(problems)} problems, first "
            f"{min(len(problems), MAX_LISTED)}):\n  {shown}\nmerge only checkpoints of one architecture"
        )


def _compare(reference: Checkpoint, other: Checkpoint, keys: list[str], same_dtype: bool) -> list[str]:
    problems = []
    other_keys = set(other.keys())
    for key in keys:
        if key not in other_keys:
            problems.append(f"{other.path}: missing key {key!r} (present in {reference.source(key)})")
        elif other.shape(key) != reference.shape(key):
            problems.append(f"{other.source(key)}: key {key!r} has shape {list(other.shape(key))}, "
                            f"{reference.source(key)} has {list(reference.shape(key))}")
        elif same_dtype and other.dtype(key) != reference.dtype(key):
            problems.append(f"{other.source(key)}: key {key!r} has dtype {other.dtype(key)}, "
                            f"{reference.source(key)} has {reference.dtype(key)}")
    extra = sorted(other_keys - set(keys))
    problems += [f"{other.source(key)}: extra key {key!r} (absent from {reference.path})" for key in extra]
    return problems


def build_plan(inputs: list[Checkpoint], base: Optional[Checkpoint] = None) -> MergePlan:
    """Order the keys as stored in the newest input, mark copied keys and tied pairs (tied in
    every input, and in `base` when the method reads it)."""
    newest = inputs[-1]
    keys = newest.keys()
    copied = {k for k in keys if is_buffer(k) or not newest.dtype(k).is_floating_point}
    tied = find_tied(inputs + ([base] if base is not None else []), [k for k in keys if k not in copied])
    # A tied key right after its source, so the source's merged value is held only briefly.
    order = [k for k in keys if k not in tied]
    for key, source in tied.items():
        order.insert(order.index(source) + 1, key)
    return MergePlan(order, copied, tied)


def find_tied(inputs: list[Checkpoint], keys: list[str]) -> dict[str, str]:
    """{output embedding key: input embedding key} for pairs equal in every checkpoint."""
    tied = {}
    candidates = [k for k in keys if k.endswith(INPUT_EMBEDDING_SUFFIXES)]
    for key in (k for k in keys if k.endswith(OUTPUT_EMBEDDING_SUFFIXES)):
        for source in candidates:
            if all(chunks_equal(c, key, source) for c in inputs):
                tied[key] = source
                break
    return tied


def describe_non_finite(tensor: torch.Tensor) -> str:
    """How many entries are NaN/Inf and where the first is (for error messages; slow path)."""
    bad = ~torch.isfinite(tensor)
    if not bad.any():
        return "no non-finite values"
    index = int(bad.flatten().nonzero()[0])
    return f"{int(bad.sum())} non-finite values, first {tensor.flatten()[index].item()} at flat index {index}"


def chunks_equal(checkpoint: Checkpoint, key: str, other: str) -> bool:
    """Bitwise equality of two tensors of one checkpoint, compared block by block."""
    if checkpoint.shape(key) != checkpoint.shape(other) or checkpoint.dtype(key) != checkpoint.dtype(other):
        return False
    return all(torch.equal(a, b) for a, b in zip(checkpoint.read_chunks(key), checkpoint.read_chunks(other)))
