"""Batch: the data that flows along the edges of the dataflow.

A Batch holds
- `tensors`: torch tensors that share a leading batch dimension (token ids, masks, log-probs),
- `objects`: per-sample Python objects, one list entry per sample (prompt text, ground truth,
  data source), kept as plain lists so any picklable value fits,
- `meta`: batch-level values (temperature, the step number) that are not per sample.

Every operation returns a new Batch and leaves its inputs untouched. Tensors are kept
contiguous on the CPU when a Batch crosses Ray, so the object store ships them as buffers
(pickle protocol 5) rather than element by element.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch


@dataclass
class Batch:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    objects: dict[str, list[Any]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.objects = {k: list(v) for k, v in self.objects.items()}
        sizes = {f"tensor {k!r}": int(v.shape[0]) for k, v in self.tensors.items() if v.dim() > 0}
        sizes.update({f"object {k!r}": len(v) for k, v in self.objects.items()})
        for k, v in self.tensors.items():
            if v.dim() == 0:
                raise ValueError(f"Batch tensor {k!r} is a scalar; put batch-level values in meta")
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch entries disagree on the batch size: {sizes}")

    # ---- size and access -------------------------------------------------------------

    def __len__(self) -> int:
        for v in self.tensors.values():
            return int(v.shape[0])
        for v in self.objects.values():
            return len(v)
        return 0

    def keys(self) -> list[str]:
        return [*self.tensors, *self.objects]

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.objects

    def __getitem__(self, key: str) -> Any:
        if key in self.tensors:
            return self.tensors[key]
        if key in self.objects:
            return self.objects[key]
        raise KeyError(f"Batch has no key {key!r}; it has {self.keys()}")

    def __repr__(self) -> str:
        tensors = ", ".join(f"{k}:{tuple(v.shape)}:{str(v.dtype).removeprefix('torch.')}" for k, v in self.tensors.items())
        return f"Batch(size={len(self)}, tensors=[{tensors}], objects={list(self.objects)}, meta={list(self.meta)})"

    # ---- selection ---------------------------------------------------------------------

    def select(self, keys: Iterable[str], meta: bool = True) -> "Batch":
        """A Batch with only `keys` (tensors or objects); meta is kept unless `meta=False`."""
        keys = list(keys)
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"Batch.select: no key(s) {missing}; the batch has {self.keys()}")
        return Batch(
            tensors={k: v for k, v in self.tensors.items() if k in keys},
            objects={k: v for k, v in self.objects.items() if k in keys},
            meta=dict(self.meta) if meta else {},
        )

    def index(self, indices: Sequence[int] | torch.Tensor) -> "Batch":
        """Rows at `indices`, in that order (a permutation reorders; repeats duplicate)."""
        idx = torch.as_tensor(indices, dtype=torch.long)
        if idx.numel() and (int(idx.min()) < -len(self) or int(idx.max()) >= len(self)):
            raise IndexError(f"Batch.index: indices out of range for a batch of {len(self)}")
        rows = idx.tolist()
        on = {device: host_to_device(idx, device) for device in {v.device for v in self.tensors.values()}}
        return Batch(
            tensors={k: v.index_select(0, on[v.device]) for k, v in self.tensors.items()},  # rows may live on a GPU
            objects={k: [v[i] for i in rows] for k, v in self.objects.items()},
            meta=dict(self.meta),
        )

    def slice(self, start: int, stop: int) -> "Batch":
        return Batch(
            tensors={k: v[start:stop] for k, v in self.tensors.items()},
            objects={k: v[start:stop] for k, v in self.objects.items()},
            meta=dict(self.meta),
        )

    reorder = index

    # ---- combination ---------------------------------------------------------------------

    @staticmethod
    def concat(batches: Sequence["Batch"]) -> "Batch":
        """Rows of all `batches` in order. All must have the same keys; meta comes from the first."""
        if not batches:
            raise ValueError("Batch.concat needs at least one batch")
        first = batches[0]
        for i, b in enumerate(batches[1:], start=1):
            if set(b.tensors) != set(first.tensors) or set(b.objects) != set(first.objects):
                raise ValueError(
                    f"Batch.concat: batch {i} has keys {sorted(b.keys())}, batch 0 has {sorted(first.keys())}"
                )
        return Batch(
            tensors={k: torch.cat([b.tensors[k] for b in batches]) for k in first.tensors},
            objects={k: [x for b in batches for x in b.objects[k]] for k in first.objects},
            meta=dict(first.meta),
        )

    def union(self, other: "Batch") -> "Batch":
        """Keys of both. A key present in both must hold equal values, else this raises."""
        if len(self) and len(other) and len(self) != len(other):
            raise ValueError(f"Batch.union: sizes differ ({len(self)} vs {len(other)})")
        tensors = dict(self.tensors)
        for k, v in other.tensors.items():
            if k in tensors and not (tensors[k].shape == v.shape and torch.equal(tensors[k], v)):
                raise ValueError(f"Batch.union: tensor {k!r} differs between the two batches; rename one")
            tensors[k] = v
        objects = dict(self.objects)
        for k, v in other.objects.items():
            if k in objects and objects[k] != v:
                raise ValueError(f"Batch.union: object {k!r} differs between the two batches; rename one")
            objects[k] = v
        meta = dict(self.meta)
        for k, v in other.meta.items():
            if k in meta and not _meta_equal(meta[k], v):
                raise ValueError(f"Batch.union: meta {k!r} is {meta[k]!r} in one batch and {v!r} in the other")
            meta[k] = v
        return Batch(tensors=tensors, objects=objects, meta=meta)

    def repeat_interleave(self, repeats: int) -> "Batch":
        """Each row `repeats` times in a row: [a, b] -> [a, a, b, b] (n samples per prompt)."""
        if repeats < 1:
            raise ValueError(f"Batch.repeat_interleave: repeats must be >= 1, got {repeats}")
        return self.index(torch.arange(len(self)).repeat_interleave(repeats))

    # ---- data-parallel split -------------------------------------------------------------

    def pad_to_multiple(self, multiple: int) -> tuple["Batch", int]:
        """Append copies of the first rows until the size divides `multiple`.

        Padding repeats real rows (not zeros) so that computations on the pad rows stay
        well-defined; `unpad` drops them again. Returns (padded batch, number of pad rows).
        """
        if multiple < 1:
            raise ValueError(f"pad_to_multiple: multiple must be >= 1, got {multiple}")
        size = len(self)
        if size == 0:
            raise ValueError("pad_to_multiple: cannot pad an empty batch")
        pad = (-size) % multiple
        if pad == 0:
            return self, 0
        idx = torch.cat([torch.arange(size), torch.arange(pad) % size])
        return self.index(idx), pad

    def unpad(self, pad: int) -> "Batch":
        return self if pad == 0 else self.slice(0, len(self) - pad)

    def chunk(self, n: int) -> list["Batch"]:
        """Split into `n` equal consecutive chunks; the size must divide `n` (pad first)."""
        if n < 1 or len(self) % n:
            raise ValueError(
                f"Batch.chunk: a batch of {len(self)} does not split into {n} equal chunks; "
                "call pad_to_multiple(n) first"
            )
        step = len(self) // n
        return [self.slice(i * step, (i + 1) * step) for i in range(n)]

    def split(self, rows_per_chunk: int) -> list["Batch"]:
        """Consecutive chunks of at most `rows_per_chunk` rows (the last may be shorter)."""
        if rows_per_chunk < 1:
            raise ValueError(f"Batch.split: rows_per_chunk must be >= 1, got {rows_per_chunk}")
        return [self.slice(i, i + rows_per_chunk) for i in range(0, len(self), rows_per_chunk)]

    # ---- transport -------------------------------------------------------------------------

    def to(self, device: torch.device | str) -> "Batch":
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, self.objects, dict(self.meta))

    def __getstate__(self) -> dict:
        # Contiguous CPU tensors travel through Ray's object store as out-of-band buffers.
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.tensors.items()}
        return {"tensors": tensors, "objects": self.objects, "meta": self.meta}

    def __setstate__(self, state: dict) -> None:
        self.tensors, self.objects, self.meta = state["tensors"], state["objects"], state["meta"]


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; to a GPU through page-locked memory, without the host waiting (a
    copy from pageable memory waits for the device's queue to drain: on a GPU a per-micro-batch
    index moved that way stalls the host once per tensor)."""
    if device.type == "cuda" and host.device.type == "cpu":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def to_json(batch: Batch) -> dict:
    """A JSON-serialisable copy of `batch` that `from_json` turns back into equal tensors, bit
    for bit (floats pass through Python floats, which hold every float32/bfloat16 value
    exactly); objects and meta must be JSON values. For a checkpoint's trainer state."""
    tensors = {k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape),
                   "data": v.detach().cpu().reshape(-1).tolist()} for k, v in batch.tensors.items()}
    return {"tensors": tensors, "objects": batch.objects, "meta": batch.meta}


def from_json(state: dict) -> Batch:
    tensors = {k: torch.tensor(v["data"], dtype=getattr(torch, v["dtype"])).reshape(v["shape"])
               for k, v in state["tensors"].items()}
    return Batch(tensors, state["objects"], state["meta"])


def _meta_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    try:
        return bool(a == b)
    except Exception:
        return a is b
