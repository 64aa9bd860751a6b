"""Streaming reads and writes of safetensors files, one tensor at a time.

Why not `safetensors.safe_open(...).get_tensor`: it memory-maps the file and copies the
tensor out of the map; every page it touches stays mapped and is counted in the process's
RSS until the handle closes, so merging N large files would show an RSS of all the bytes
read. Here the header (8-byte little-endian length + JSON) is parsed once and each tensor is
read with `os.preadv` straight into a freshly allocated tensor: one copy, no mapping, and
memory that is freed as soon as the caller drops the tensor.

The writer knows every tensor's name, dtype and shape before the first byte is written (the
inputs were validated first), so it writes each shard's header up front and then each
tensor's bytes as they are produced: only the tensor being written is held, never a whole
shard. The header reserves room for the metadata, which is rewritten at the end once values
computed during the merge (the input hashes) are known.
"""

from __future__ import annotations

import json
import math
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from hybridflow.merge.errors import MergeError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"),
                     ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
# Tensors are streamed in blocks of this size: small enough to stay in the CPU cache between
# the read (or cast) and its use, large enough that per-block Python overhead is negligible.
CHUNK_BYTES = 2 * 1024 * 1024
HEADER_SLACK_BYTES = 1024  # room for the final metadata to differ in length from the placeholder

if sys.byteorder != "little":  # safetensors stores little-endian bytes; tensors are read raw
    raise ImportError("hybridflow.merge reads safetensors bytes directly and needs a little-endian machine")


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: `file`, absolute byte `offset`, `nbytes`, dtype and shape."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def read_header(path: Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """Parse and check a safetensors header: entries by name, and `__metadata__`.

    A truncated or corrupt file raises MergeError naming the file and what is wrong.
    """
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise MergeError(f"{path}: {size} bytes is too short for a safetensors file (truncated or empty)")
        header_len = int.from_bytes(prefix, "little")
        if header_len > min(MAX_HEADER_BYTES, size - 8):
            raise MergeError(
                f"{path}: header length field says {header_len} bytes but the file has {size} bytes; "
                "the file is truncated or not a safetensors file"
            )
        raw = handle.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MergeError(f"{path}: the safetensors header is not valid JSON ({exc}); the file is corrupt") from None
    if not isinstance(header, dict):
        raise MergeError(f"{path}: the safetensors header is not a JSON object; the file is corrupt")
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + header_len
    entries = {name: _entry(path, name, spec, data_start) for name, spec in header.items()}
    _check_layout(path, entries, data_start, size - data_start)
    return entries, metadata


def _entry(path: Path, name: str, spec: object, data_start: int) -> TensorEntry:
    try:
        dtype = DTYPES[spec["dtype"]]
        shape = tuple(int(d) for d in spec["shape"])
        begin, end = (int(x) for x in spec["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise MergeError(f"{path}: header entry for {name!r} is malformed or has an unknown dtype: {spec!r}") from None
    nbytes = math.prod(shape) * dtype.itemsize
    if end - begin != nbytes or begin < 0:
        raise MergeError(
            f"{path}: tensor {name!r} of shape {list(shape)} and dtype {spec['dtype']} needs {nbytes} bytes "
            f"but its data_offsets {[begin, end]} span {end - begin}; the file is corrupt"
        )
    return TensorEntry(path, dtype, shape, data_start + begin, nbytes)


def _check_layout(path: Path, entries: dict[str, TensorEntry], data_start: int, data_bytes: int) -> None:
    """Tensors must tile the data region exactly, as the safetensors library requires."""
    position = data_start
    for name, entry in sorted(entries.items(), key=lambda item: item[1].offset):
        if entry.offset != position:
            raise MergeError(f"{path}: tensor {name!r} starts at byte {entry.offset}, expected {position}; "
                             "the header is corrupt")
        position += entry.nbytes
    expected = position - data_start
    if expected > data_bytes:
        raise MergeError(
            f"{path}: the header describes {expected} bytes of tensor data but only {data_bytes} follow it; "
            "the file is truncated (an interrupted copy or save?) - copy or save it again"
        )
    if expected < data_bytes:
        raise MergeError(f"{path}: {data_bytes - expected} unexpected bytes after the tensor data; the file is corrupt")


def read_tensor(entry: TensorEntry, fd: Optional[int] = None) -> torch.Tensor:
    """Read one tensor into new memory (one copy, no memory map). `fd` is an open file of
    `entry.file`, or None to open it for this read."""
    buffer = torch.empty(entry.nbytes, dtype=torch.uint8)  # (nbytes,) raw little-endian bytes
    own = fd is None
    if own:
        fd = os.open(entry.file, os.O_RDONLY)
    try:
        pread_into(fd, buffer, entry.offset, entry.file)
    finally:
        if own:
            os.close(fd)
    return buffer.view(entry.dtype).reshape(entry.shape)


def read_chunks(entry: TensorEntry, fd: int, buffer: torch.Tensor,
                on_read: Optional[Callable[[int, torch.Tensor], None]] = None) -> Iterator[torch.Tensor]:
    """The tensor's elements, flattened, in consecutive 1-D blocks read into `buffer` (a
    uint8 tensor of CHUNK_BYTES): each block is overwritten by the next, so use it first.
    `on_read(file offset, raw bytes)` sees each block as it is read."""
    step = buffer.numel() - buffer.numel() % entry.dtype.itemsize
    for start in range(0, entry.nbytes, step):
        block = buffer[: min(step, entry.nbytes - start)]
        pread_into(fd, block, entry.offset + start, entry.file)
        if on_read is not None:
            on_read(entry.offset + start, block)
        yield block.view(entry.dtype)


def pread_into(fd: int, buffer: torch.Tensor, offset: int, path: Path) -> None:
    """Fill the contiguous uint8 tensor `buffer` from byte `offset` of the open file `fd`."""
    view = memoryview(buffer.numpy())
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise MergeError(f"{path}: file ended while reading at byte {offset + done}; "
                             "it was truncated after the merge started")
        done += got


@contextmanager
def one_thread() -> Iterator[None]:
    """Run block-wise tensor ops on one intra-op thread, restoring the setting after.

    The ops on 2 MiB blocks are memory-bound and short; with several threads each one pays
    a thread-pool barrier, and on a shared machine a descheduled worker stalls every barrier
    (measured on 2 busy cores: 64 MiB added in 2 MiB blocks, 0.18 s with 2 threads, 0.006 s
    with 1). One thread already runs near the memory bandwidth.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def all_finite(tensor: torch.Tensor) -> bool:
    """True when no entry is NaN or +-Inf; min and max are NaN/Inf whenever any entry is, and
    aminmax is one pass with no temporaries (torch.isfinite makes several)."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) and torch.isfinite(high))


@dataclass(frozen=True)
class OutputTensor:
    """One planned output tensor: its name, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def plan_shards(tensors: list[OutputTensor], max_shard_bytes: int) -> list[list[OutputTensor]]:
    """Split tensors, in order, into shards of at most `max_shard_bytes` (a bigger tensor gets
    a shard of its own)."""
    if max_shard_bytes <= 0:
        raise MergeError(f"max_shard_bytes={max_shard_bytes} must be positive, e.g. 2_000_000_000")
    shards: list[list[OutputTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return shards


def shard_file_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _header_bytes(tensors: list[OutputTensor], metadata: dict[str, str], length: Optional[int]) -> bytes:
    """Header JSON padded with spaces to `length` bytes, or to a multiple of 8 plus slack."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for tensor in tensors:
        header[tensor.name] = {"dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                               "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    if length is None:
        length = (len(raw) + HEADER_SLACK_BYTES + 7) // 8 * 8
    if len(raw) > length:
        raise MergeError(f"safetensors metadata grew by {len(raw) - length} bytes beyond the space reserved for it")
    return raw + b" " * (length - len(raw))


class ShardedWriter:
    """Writes planned tensors, in plan order, to `directory` as sharded safetensors + index."""

    def __init__(self, directory: Path, tensors: list[OutputTensor], max_shard_bytes: int,
                 metadata: dict[str, str]) -> None:
        self.directory = directory
        self.shards = plan_shards(tensors, max_shard_bytes)
        self.files = [directory / name for name in shard_file_names(len(self.shards))]
        self.header_lengths: list[int] = []
        self.metadata = metadata
        self._order = [(i, t) for i, shard in enumerate(self.shards) for t in shard]
        self._next = 0
        self._handle = None
        self._open_shard = -1

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the next tensor of the plan: the planned name and shape, in the planned dtype
        or in a float dtype that is converted block by block (no full-size converted copy);
        a value that overflows the planned dtype raises MergeError."""
        shard, planned = self._order[self._next]
        convert = tensor.dtype != planned.dtype
        if name != planned.name or tuple(tensor.shape) != planned.shape or (
                convert and not (tensor.is_floating_point() and planned.dtype.is_floating_point)):
            raise RuntimeError(f"writer expected {planned} next, got {name!r} {tensor.dtype} {tuple(tensor.shape)}")
        if shard != self._open_shard:
            self._start_shard(shard)
        flat = tensor.contiguous().reshape(-1)
        blocks = flat.split(CHUNK_BYTES // planned.dtype.itemsize) if convert and flat.numel() else [flat]
        with one_thread():
            for block in blocks:
                if convert:
                    block = block.to(planned.dtype)
                    if not all_finite(block):
                        raise MergeError(f"merged tensor {name!r} has values beyond the range of {planned.dtype} "
                                         f"(largest |value| {flat.abs().max().item():.4g}); write a wider --dtype")
                self._handle.write(memoryview(block.view(torch.uint8).numpy()))  # (nbytes,) no copy
        self._next += 1

    def _start_shard(self, shard: int) -> None:
        if self._handle is not None:
            self._handle.close()
        header = _header_bytes(self.shards[shard], self.metadata, None)
        self.header_lengths.append(len(header))
        self._handle = open(self.files[shard], "wb")
        self._handle.write(len(header).to_bytes(8, "little"))
        self._handle.write(header)
        self._open_shard = shard

    def finish(self, metadata: dict[str, str]) -> list[Path]:
        """Close the last shard, rewrite every header with the final `metadata`, write the
        index when there are several shards; returns the files written."""
        if self._next != len(self._order):
            raise RuntimeError(f"writer finished after {self._next} of {len(self._order)} tensors")
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        for shard, path in enumerate(self.files):
            with open(path, "r+b") as handle:
                handle.seek(8)
                handle.write(_header_bytes(self.shards[shard], metadata, self.header_lengths[shard]))
        if len(self.files) > 1:
            self._write_index()
        return self.files

    def _write_index(self) -> None:
        weight_map = {t.name: path.name for shard, path in zip(self.shards, self.files) for t in shard}
        total = sum(t.nbytes for shard in self.shards for t in shard)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
