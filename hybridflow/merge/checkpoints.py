"""Checkpoint readers: one interface over every input format, and the run layout.

A reader (`Checkpoint`) lists its tensors with dtype and shape from the headers alone and
reads one tensor at a time. `open_checkpoint(path)` picks the reader from what the path
contains, through the `CHECKPOINT_FORMATS` registry: each entry is a class with a
`matches(path) -> bool` classmethod and a constructor `cls(path, base=None)`. Formats
registered here: a Hugging Face safetensors directory (one file or shards with
`model.safetensors.index.json`), a single `.safetensors` file, a peft LoRA adapter
directory (in `hybridflow.merge.lora`) and an FSDP2 / torch.distributed.checkpoint directory,
consolidated on the fly (in `hybridflow.merge.dcp`).

Run layout (fixed by the trainer, `hybridflow.checkpoint`): `RUN_DIR/checkpoints/step_<8-digit
step>/` is complete only once its `COMPLETE` file exists; inside it `hf/` is a Hugging Face model
directory and `actor/` the actor's sharded training state (DCP). A step directory given as an
input stands for its `hf/`, or its `actor/` when it has no `hf/`.
"""

from __future__ import annotations

import json
import os
import re
from functools import partial
from pathlib import Path
from typing import Iterator, Optional, Protocol

import torch

from hybridflow.merge.errors import MergeError
from hybridflow.merge.safetensors_io import CHUNK_BYTES, TensorEntry, read_chunks, read_header, read_tensor
from hybridflow.registry import Registry

CHECKPOINT_FORMATS: Registry[type] = Registry(
    "checkpoint format",
    "class with classmethod matches(path: Path) -> bool and constructor cls(path: Path, base: Checkpoint | None)",
)

INDEX_FILE = "model.safetensors.index.json"


class ReadHasher(Protocol):
    """What a reader reports its reads to (`hybridflow.merge.provenance.InputHasher` is the one the merge uses)."""

    def feed(self, file: Path, offset: int, data: torch.Tensor) -> None:
        """`data` (contiguous uint8) was just read from byte `offset` of `file`."""


class Checkpoint:
    """What the merge engine needs from an input: names, dtypes and shapes without reading
    data, one tensor at a time, the files that hold the weights (hashed for provenance) and
    the directory holding config and tokenizer files."""

    path: Path
    uses_base = False  # True when the reader takes weights or files from the `base` it was given

    def keys(self) -> list[str]:
        raise NotImplementedError

    def dtype(self, key: str) -> torch.dtype:
        raise NotImplementedError

    def shape(self, key: str) -> tuple[int, ...]:
        raise NotImplementedError

    def read(self, key: str) -> torch.Tensor:
        """The tensor in its stored dtype (fp32 where it was computed in fp32, e.g. LoRA folding)."""
        raise NotImplementedError

    def read_chunks(self, key: str) -> Iterator[torch.Tensor]:
        """The tensor's elements, flattened, as consecutive 1-D blocks. A block may be
        overwritten when the next is produced: use it before advancing. Readers that can
        stream (safetensors) yield small blocks, so a caller that accumulates never holds
        the whole input tensor; the default yields the whole tensor as one block."""
        yield self.read(key).reshape(-1)

    def source(self, key: str) -> str:
        """The file that holds `key`, for error messages."""
        return str(self.path)

    def attach_hasher(self, hasher: ReadHasher) -> None:
        """Report every read to `hasher.feed(file, offset, raw bytes)` (provenance hashes)."""

    def weight_files(self) -> list[Path]:
        return []

    def files_to_copy(self) -> list[Path]:
        """Non-weight files (config, tokenizer, generation config, ...) to copy to the output."""
        return []

    def close(self) -> None:
        pass


class SafetensorsCheckpoint(Checkpoint):
    """A safetensors file, or a directory of them (sharded with an index, or not)."""

    @classmethod
    def matches(cls, path: Path) -> bool:
        if path.is_file():
            return path.suffix == ".safetensors"
        return (path / INDEX_FILE).is_file() or (
            not (path / "adapter_config.json").exists() and any(path.glob("*.safetensors"))
        )

    def __init__(self, path: Path, base: Optional[Checkpoint] = None) -> None:
        self.path = path
        self.entries: dict[str, TensorEntry] = {}
        self.files = _weight_files(path)
        self._fds: dict[Path, int] = {}
        self._buffers: list[torch.Tensor] = []  # reusable CHUNK_BYTES read buffers
        self._hasher: Optional[ReadHasher] = None
        for file in self.files:
            entries, _ = read_header(file)
            for key, entry in entries.items():
                if key in self.entries:
                    raise MergeError(f"{path}: tensor {key!r} is stored in both {self.entries[key].file.name} "
                                     f"and {file.name}; a checkpoint must store each tensor once")
                self.entries[key] = entry
        if path.is_dir() and (path / INDEX_FILE).is_file():
            self._check_index(path / INDEX_FILE)

    def _check_index(self, index_path: Path) -> None:
        weight_map = _load_json(index_path).get("weight_map", {})
        for key, file_name in weight_map.items():
            entry = self.entries.get(key)
            if entry is None or entry.file.name != file_name:
                raise MergeError(f"{index_path}: maps {key!r} to {file_name}, but that file does not hold it; "
                                 "the index and the shards disagree (re-save the checkpoint)")
        extra = sorted(set(self.entries) - set(weight_map))
        if extra:
            raise MergeError(f"{index_path}: tensors {extra[:5]} are in the shards but not in the index")

    def keys(self) -> list[str]:
        # Ordered as stored (file, then offset): reads go through each file front to back.
        return sorted(self.entries, key=lambda k: (str(self.entries[k].file), self.entries[k].offset))

    def dtype(self, key: str) -> torch.dtype:
        return self.entries[key].dtype

    def shape(self, key: str) -> tuple[int, ...]:
        return self.entries[key].shape

    def read(self, key: str) -> torch.Tensor:
        entry = self.entries[key]
        tensor = read_tensor(entry, self._fd(entry.file))
        if self._hasher is not None:
            self._hasher.feed(entry.file, entry.offset, tensor.reshape(-1).view(torch.uint8))
        return tensor

    def read_chunks(self, key: str) -> Iterator[torch.Tensor]:
        # Buffers are pooled, not allocated per call: fresh memory costs a page fault per
        # page, and two streams may be open at once (comparing tied tensors).
        entry = self.entries[key]
        buffer = self._buffers.pop() if self._buffers else torch.empty(CHUNK_BYTES, dtype=torch.uint8)
        try:
            on_read = partial(self._hasher.feed, entry.file) if self._hasher is not None else None
            yield from read_chunks(entry, self._fd(entry.file), buffer, on_read)
        finally:
            self._buffers.append(buffer)

    def _fd(self, file: Path) -> int:
        if file not in self._fds:
            self._fds[file] = os.open(file, os.O_RDONLY)
        return self._fds[file]

    def source(self, key: str) -> str:
        entry = self.entries.get(key)
        return str(entry.file) if entry else str(self.path)

    def attach_hasher(self, hasher: ReadHasher) -> None:
        self._hasher = hasher

    def weight_files(self) -> list[Path]:
        return list(self.files)

    def files_to_copy(self) -> list[Path]:
        if not self.path.is_dir():
            return []
        return sorted(p for p in self.path.iterdir() if p.is_file() and not is_weight_file(p))

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._buffers.clear()


CHECKPOINT_FORMATS.add("safetensors", SafetensorsCheckpoint)


def _weight_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = _load_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise MergeError(f"{index}: has no 'weight_map'; the index is corrupt (re-save the checkpoint)")
        files = sorted({path / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise MergeError(f"{index}: lists shard files that do not exist: {missing[:5]}; copy them or re-save")
        return files
    return sorted(path.glob("*.safetensors"))


def _load_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MergeError(f"{path}: cannot read it as JSON ({exc})") from None
    if not isinstance(data, dict):
        raise MergeError(f"{path}: expected a JSON object")
    return data


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".distcp")
WEIGHT_INDEXES = (INDEX_FILE, "pytorch_model.bin.index.json")


def is_weight_file(path: Path) -> bool:
    """Files the merge replaces rather than copies (weights, their indexes, old provenance)."""
    return (path.suffix in WEIGHT_SUFFIXES or path.name in WEIGHT_INDEXES
            or path.name == "merge_provenance.json")


def open_checkpoint(path: "str | os.PathLike[str]", *, base: Optional[Checkpoint] = None) -> Checkpoint:
    """Open `path` with the one registered format that recognises it.

    `base` is given to formats that are relative to a base model (LoRA adapters).
    """
    path = resolve_step_dir(Path(path).expanduser())
    if not path.exists():
        raise MergeError(f"checkpoint {path} does not exist")
    found = [name for name in CHECKPOINT_FORMATS.names() if CHECKPOINT_FORMATS.get(name).matches(path)]
    if len(found) > 1:
        raise MergeError(f"{path}: matches several checkpoint formats {found}; keep one checkpoint per directory")
    if not found:
        raise MergeError(f"{path}: {_describe_unknown(path)}; readable formats: "
                         f"{', '.join(CHECKPOINT_FORMATS.names())} (add one to CHECKPOINT_FORMATS)")
    return CHECKPOINT_FORMATS.get(found[0])(path, base=base)


def _describe_unknown(path: Path) -> str:
    if path.is_file():
        return "is not a .safetensors file (convert it with safetensors.torch.save_file)"
    names = sorted(p.name for p in path.iterdir())
    if any(n.endswith(".distcp") for n in names):
        return ("looks like a torch.distributed.checkpoint (FSDP2) directory but has no .metadata file (its save "
                "was interrupted, or it is one rank's part of a checkpoint: give the directory all ranks wrote)")
    if any(n.endswith(".bin") for n in names):
        return "holds .bin (pickle) weights; re-save it with save_pretrained(..., safe_serialization=True)"
    return f"holds no safetensors weights (it contains {names[:10]})"


# ------------------------------------------------------------------------------ run layout

STEP_DIR = re.compile(r"^step_(\d+)$")
COMPLETE = "COMPLETE"
MODEL_SUBDIRS = ("hf", "actor")  # what a step directory stands for, in order of preference


def resolve_step_dir(path: Path) -> Path:
    """A run's step directory stands for its `hf/` model, else its `actor/` DCP checkpoint;
    any other path is returned unchanged. An incomplete step directory is refused."""
    if not path.is_dir() or not any((path / sub).is_dir() for sub in MODEL_SUBDIRS):
        return path
    if STEP_DIR.match(path.name) and not (path / COMPLETE).exists():
        raise MergeError(f"checkpoint {path} has no {COMPLETE} file: its save was interrupted; pick a complete "
                         "checkpoint of the run")
    return next(path / sub for sub in MODEL_SUBDIRS if (path / sub).is_dir())


def last_checkpoints(run_dir: "str | os.PathLike[str]", n: int) -> list[Path]:
    """The model directories of the last `n` complete checkpoints of a run, oldest first: each
    checkpoint's `hf/`, or its `actor/` (DCP, consolidated when read) when it has no `hf/`."""
    run_dir = Path(run_dir).expanduser()
    if n < 1:
        raise MergeError(f"--last {n}: the number of checkpoints must be at least 1")
    root = run_dir / "checkpoints"
    if not root.is_dir():
        raise MergeError(f"{run_dir} has no checkpoints/ directory; is it a HybridFlow run directory?")
    steps = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir())
    complete = [p for _, p in steps if (p / COMPLETE).exists()]
    incomplete = [p.name for _, p in steps if not (p / COMPLETE).exists()]
    if len(complete) < n:
        names = ", ".join(p.name for p in complete) or "none"
        unfinished = f"; incomplete (no COMPLETE file): {', '.join(incomplete)}" if incomplete else ""
        raise MergeError(f"{root} has {len(complete)} complete checkpoints ({names}) but {n} were asked for{unfinished}")
    missing = [str(p) for p in complete[-n:] if not any((p / sub).is_dir() for sub in MODEL_SUBDIRS)]
    if missing:
        raise MergeError(f"complete checkpoints with neither an hf/ model directory nor an actor/ training state: "
                         f"{missing}")
    return [resolve_step_dir(p) for p in complete[-n:]]


# -------------------------------------------------------------------------- in memory


class StateDictCheckpoint(Checkpoint):
    """An in-memory state dict seen as a checkpoint (for merges inside a training process)."""

    def __init__(self, state_dict: dict[str, torch.Tensor], label: str) -> None:
        self.state_dict = state_dict
        self.path = Path(label)

    def keys(self) -> list[str]:
        return list(self.state_dict)

    def dtype(self, key: str) -> torch.dtype:
        return self.state_dict[key].dtype

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.state_dict[key].shape)

    def read(self, key: str) -> torch.Tensor:
        return self.state_dict[key].detach().cpu()
