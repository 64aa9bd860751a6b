"""FSDP2 sharded checkpoints (torch.distributed.checkpoint, "DCP") read as Hugging Face models.

`hybridflow.checkpoint.save_training_state` writes a worker's `actor/` directory with
`dcp.save({"model": model_state, "optim": optim_state})`: every rank writes its own shards
(`__<rank>_0.distcp`) and the coordinator writes `.metadata`, which lists every tensor of the
flattened state dict (`model.<name>`, `optim.state.<name>.exp_avg`, ...) with its global shape,
dtype and the chunks each rank stored. The model's names are those of `get_state_dict`: the
module's own parameter names (FSDP2 shards in place and adds no wrapper segment).

Consolidation happens on the fly, in this process, without a process group: `read(key)`
allocates the full tensor and has DCP copy every rank's chunk into it
(`dcp.load(..., no_dist=True)` with a one-key state dict). Memory: the full tensor plus one
stored chunk (DCP unpickles a chunk before copying it). The optimizer state, the parameter
groups and the non-tensor entries are never read.

Names are made the ones `from_pretrained` expects, as `export_hf_model` does for `hf/`:
- wrapper segments (`_fsdp_wrapped_module`, `_checkpoint_wrapped_module`, `_orig_mod`) and
  peft's `base_model.model.` prefix, `.base_layer.` and `modules_to_save.<adapter>.` are removed;
- the output embedding (`lm_head.weight`) is dropped when the config ties it to the input
  embedding, so that a DCP checkpoint and an `hf/` export have the same keys.
LoRA runs are refused: `save_training_state` skips frozen parameters, so their `actor/`
holds only the adapter factors, without the base weights or the adapter's scaling.

A DCP directory holds no config.json or tokenizer. They are taken from the same step's `hf/`
directory (`step_<N>/hf`, next to `step_<N>/actor`) when it has a config.json, else from the
base model given to `open_checkpoint` (`--base`: the model the run started from); with neither,
the input is refused when opened, since the config also says whether the embeddings are tied.
Missing or truncated shard files are refused when opened (`.metadata` lists each file's items).
"""

from __future__ import annotations

import json
import pickle
import re
import warnings
from pathlib import Path
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from hybridflow.merge.checkpoints import CHECKPOINT_FORMATS, Checkpoint, is_weight_file
from hybridflow.merge.errors import MergeError
from hybridflow.merge.validate import INPUT_EMBEDDING_SUFFIXES, OUTPUT_EMBEDDING_SUFFIXES

DCP_METADATA = ".metadata"
MODEL_KEY = "model"  # save_training_state's top-level key of the model state
WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
PEFT_PREFIX = "base_model.model."
MODULES_TO_SAVE = re.compile(r"\.modules_to_save\.[^.]+\.")
LORA_SEGMENT = re.compile(r"(^|\.)lora_")
CONFIG_FIX = ("pass the model the run started from as the base (--base BASE / base=...) to take config.json and "
              "the tokenizer from it, or merge the step's hf/ export")


def hf_name(fqn: str) -> Optional[str]:
    """The Hugging Face name of a model state key; None for peft's superseded `original_module` copies."""
    name = ".".join(part for part in fqn.split(".") if part not in WRAPPER_SEGMENTS)
    name = name.removeprefix(PEFT_PREFIX)
    if ".original_module." in name:
        return None
    return MODULES_TO_SAVE.sub(".", name).replace(".base_layer.", ".")


class DcpCheckpoint(Checkpoint):
    """The model tensors of a torch.distributed.checkpoint directory, one full tensor at a time."""

    @classmethod
    def matches(cls, path: Path) -> bool:
        return path.is_dir() and (path / DCP_METADATA).is_file()

    def __init__(self, path: Path, base: Optional[Checkpoint] = None) -> None:
        self.path = path
        self._reader = _open_reader(path)
        metadata = self._reader.metadata
        self.files = [path / DCP_METADATA] + _shard_files(path, metadata)
        self.entries: dict[str, tuple[str, TensorStorageMetadata]] = {}  # HF name -> (flat DCP key, metadata)
        for flat, fqn in _model_keys(path, metadata).items():
            meta = metadata.state_dict_metadata[flat]
            name = hf_name(fqn)
            if name is None or not isinstance(meta, TensorStorageMetadata):
                continue  # peft's original_module copy, or a pickled non-tensor value (no HF weight)
            if LORA_SEGMENT.search(name):
                raise MergeError(f"{path}: holds LoRA adapter tensors ({fqn!r}); the training state of a LoRA run "
                                 "saves only the trainable tensors, not the frozen base weights nor the adapter's "
                                 "scaling, so it cannot be made a full model here; merge the step's hf/ export "
                                 "(written with the LoRA folded in) instead")
            if name in self.entries:
                raise MergeError(f"{path}: {self.entries[name][0]!r} and {flat!r} both map to the weight {name!r}")
            self.entries[name] = (flat, meta)
        if not self.entries:
            raise MergeError(f"{path}: holds no model tensors (DCP keys: {sorted(metadata.state_dict_metadata)[:5]})")
        self.config_files, self.uses_base = _config_source(path, base)  # raises when there is none
        self._drop_tied_output_embedding()

    def _drop_tied_output_embedding(self) -> None:
        config = _read_config(self.config_files)
        text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        if text_config.get("tie_word_embeddings", config.get("tie_word_embeddings")) is not True:
            return
        if any(name.endswith(INPUT_EMBEDDING_SUFFIXES) for name in self.entries):
            for name in [n for n in self.entries if n.endswith(OUTPUT_EMBEDDING_SUFFIXES)]:
                del self.entries[name]

    def keys(self) -> list[str]:
        return list(self.entries)

    def dtype(self, key: str) -> torch.dtype:
        return self.entries[key][1].properties.dtype

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.entries[key][1].size)

    def read(self, key: str) -> torch.Tensor:
        flat, meta = self.entries[key]
        full = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        # The key is already flat: DCP looks it up in .metadata as is and fills `full` in place.
        planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no_dist is meant
                dcp.load({flat: full}, storage_reader=self._reader, planner=planner, no_dist=True)
        except (Exception, CheckpointException) as exc:  # the latter, DCP's wrapper, is a BaseException
            raise MergeError(f"{self.path}: reading {flat!r} failed ({_last_line(exc)}); a shard file is truncated "
                             "or corrupt, pick another checkpoint") from None
        return full

    def source(self, key: str) -> str:
        return f"{self.path} ({self.entries[key][0]})" if key in self.entries else str(self.path)

    def weight_files(self) -> list[Path]:
        return list(self.files)

    def files_to_copy(self) -> list[Path]:
        return list(self.config_files)


CHECKPOINT_FORMATS.add("dcp", DcpCheckpoint)


class MetadataOnceReader(FileSystemReader):
    """`dcp.load` reads `.metadata` on every call; it also lists the optimizer state, so
    unpickling it once per tensor could cost more than reading the tensor."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.metadata: Metadata = super().read_metadata()

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return self.metadata


def _open_reader(path: Path) -> MetadataOnceReader:
    try:
        return MetadataOnceReader(path)
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ValueError) as exc:
        raise MergeError(f"{path / DCP_METADATA}: cannot be read ({exc}); the checkpoint's save was interrupted or "
                         "the file is corrupt, pick another checkpoint") from None


def _shard_files(path: Path, metadata: Metadata) -> list[Path]:
    """The shard files `.metadata` lists, checked to exist and to be as long as it says."""
    ends: dict[str, int] = {}  # file -> end of its last stored item
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    missing = [name for name in sorted(ends) if not (path / name).is_file()]
    if missing:
        raise MergeError(f"{path}: the shard files {missing[:5]} listed in {DCP_METADATA} are missing; copy every "
                         "rank's __<rank>_0.distcp file, or pick another checkpoint")
    short = [f"{name} ({(path / name).stat().st_size} of {end} bytes)" for name, end in sorted(ends.items())
             if (path / name).stat().st_size < end]
    if short:
        raise MergeError(f"{path}: shard files shorter than {DCP_METADATA} says: {short[:5]}; they are truncated "
                         "(an interrupted copy or save), pick another checkpoint")
    return [path / name for name in sorted(ends)]


def _model_keys(path: Path, metadata: Metadata) -> dict[str, str]:
    """{flat DCP key: model state name}. DCP's planner data maps each flat key to its path in the
    saved dict: ("model", name) under save_training_state's "model" entry; a checkpoint of a
    bare model state dict (no "model" entry) has one-element paths, all of them model tensors."""
    if not isinstance(metadata.planner_data, dict):
        raise MergeError(f"{path}: {DCP_METADATA} has no flattening map (saved with a custom planner?), so model "
                         "tensors cannot be told from the others; save with DCP's default planner")
    paths = {flat: tuple(metadata.planner_data.get(flat, (flat,))) for flat in metadata.state_dict_metadata}
    nested = {flat: ".".join(map(str, p[1:])) for flat, p in paths.items() if len(p) > 1 and p[0] == MODEL_KEY}
    if nested:
        return nested
    bare = {flat: str(p[0]) for flat, p in paths.items() if len(p) == 1}
    if len(bare) != len(paths):
        raise MergeError(f"{path}: holds no '{MODEL_KEY}' entry (top-level keys: "
                         f"{sorted({str(p[0]) for p in paths.values()})[:10]}); save the model state under "
                         f"'{MODEL_KEY}' as hybridflow.checkpoint.save_training_state does")
    return bare


def _last_line(exc: Exception) -> str:
    """The cause at the end of a CheckpointException, which carries each rank's whole traceback."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1][:300] if lines else type(exc).__name__


def _config_source(path: Path, base: Optional[Checkpoint]) -> tuple[list[Path], bool]:
    """(the config and tokenizer files to copy, whether they come from `base`). The config is
    needed to read the checkpoint (tied embeddings) as well as to write a loadable model."""
    sibling = path.parent / "hf"
    if (sibling / "config.json").is_file():
        return sorted(p for p in sibling.iterdir() if p.is_file() and not is_weight_file(p)), False
    files = base.files_to_copy() if base is not None else []
    if not any(f.name == "config.json" for f in files):
        where = f"the base model {base.path} has none" if base is not None else "no base model was given"
        raise MergeError(f"{path}: a DCP checkpoint holds no config.json or tokenizer files, there is no "
                         f"{sibling}/config.json beside it and {where}; {CONFIG_FIX}")
    return files, True


def _read_config(files: list[Path]) -> dict:
    config_file = next(f for f in files if f.name == "config.json")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MergeError(f"{config_file}: cannot read it as JSON ({exc})") from None
    return config if isinstance(config, dict) else {}
