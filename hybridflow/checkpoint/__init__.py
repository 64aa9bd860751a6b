"""Checkpointing: atomic, resumable checkpoints of a run, and the actor as a Hugging Face model.

Driver side: `CheckpointManager` (begin / commit / abort / latest / resumable / verify /
prune to weights-only snapshots) and `read_trainer_state`; every checkpoint records the
sha256 of its files in `MANIFEST.json` (`hybridflow.checkpoint.integrity`). Worker side, called collectively on every rank of a group:
`save_training_state` / `load_training_state` (FSDP2 shards via torch.distributed.checkpoint,
LR scheduler, per-rank RNG; loadable on another rank count), `export_hf_model` and
`export_lora_adapter` (a LoRA actor's peft adapter, `actor.lora.save_adapter_only`). See docs/checkpoints.md.
"""

import importlib

from hybridflow.checkpoint.errors import CheckpointCorrupt, CheckpointError
from hybridflow.checkpoint.manager import CheckpointManager, config_hash, read_trainer_state, step_dir_name
from hybridflow.checkpoint.rng import capture_rng_state, restore_rng_state
from hybridflow.checkpoint.training_state import (load_training_state, rank_change_note, save_training_state,
                                                 saved_world_size, verify_training_state)

# The worker side's exports, imported on first use: they import torch.distributed.checkpoint's state-dict
# API (1.9 s on a 2-core CPU), which the driver, importing this package for CheckpointManager, never calls.
_WORKER_SIDE = {"export_hf_model": "hf_export", "hf_state_dict": "hf_export", "export_lora_adapter": "adapter"}


def __getattr__(name: str):
    module = _WORKER_SIDE.get(name)
    if module is None:
        raise AttributeError(f"module 'hybridflow.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hybridflow.checkpoint.{module}"), name)

__all__ = [
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointManager",
    "capture_rng_state",
    "config_hash",
    "export_hf_model",
    "export_lora_adapter",
    "hf_state_dict",
    "load_training_state",
    "rank_change_note",
    "read_trainer_state",
    "restore_rng_state",
    "save_training_state",
    "saved_world_size",
    "step_dir_name",
    "verify_training_state",
]
