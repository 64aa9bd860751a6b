"""Checkpoint merging: SMA / EMA / WMA / linear averaging, task arithmetic, TIES, DARE,
SLERP; LoRA folding; FSDP2 (DCP) checkpoints consolidated on the fly; streaming safetensors
I/O; validation; provenance; stage and training hooks.

Python use:

    from hybridflow.merge import merge_checkpoints, last_checkpoints
    merge_checkpoints(last_checkpoints("runs/sft", 5), "runs/sft/merged", "sma")

See docs/merge.md for the formulas, conventions and validation rules.
"""

from hybridflow.merge.api import merge_checkpoints, merge_state_dicts
from hybridflow.merge.checkpoints import CHECKPOINT_FORMATS, Checkpoint, last_checkpoints, open_checkpoint
from hybridflow.merge.dcp import DcpCheckpoint
from hybridflow.merge.errors import MergeError
from hybridflow.merge.hooks import (
    STAGE_HOOKS,
    TRAINING_HOOKS,
    HookConfig,
    run_stage_hook,
    run_training_hook,
)
from hybridflow.merge.methods import MERGE_METHODS, MergeParams

__all__ = [
    "CHECKPOINT_FORMATS",
    "Checkpoint",
    "DcpCheckpoint",
    "HookConfig",
    "MERGE_METHODS",
    "MergeError",
    "MergeParams",
    "STAGE_HOOKS",
    "TRAINING_HOOKS",
    "last_checkpoints",
    "merge_checkpoints",
    "merge_state_dicts",
    "open_checkpoint",
    "run_stage_hook",
    "run_training_hook",
]
