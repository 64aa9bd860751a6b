"""A LoRA actor's adapter as a peft adapter directory (`actor.lora.save_adapter_only`).

`export_lora_adapter` writes what peft's `save_pretrained` writes, `adapter_config.json` and
`adapter_model.safetensors` (keys `base_model.model.<module>.lora_A.weight`, without the adapter
name), from an FSDP2-sharded or plain peft model: only the LoRA factors are gathered, so a
checkpoint costs megabytes instead of the model. `base_model_name_or_path` is the absolute path of
the model the actor was loaded from, so `peft.PeftModel.from_pretrained`, vLLM's LoRA loading and
`hybridflow-merge` (hybridflow/merge/lora.py, which folds W + s * B @ A in fp32) find the base.
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file

from hybridflow.checkpoint.errors import CheckpointError
from hybridflow.checkpoint.files import fsync_tree

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
LORA_PARAMETER = re.compile(r"\.lora_(A|B|embedding_A|embedding_B)\.")


def export_lora_adapter(directory: "str | os.PathLike[str]", *, model: torch.nn.Module,
                        base_model_dir: "str | os.PathLike[str]", rank: int) -> Optional[Path]:
    """Collective: every rank gathers the LoRA factors (A, B: full tensors from FSDP2 shards);
    rank 0 writes the adapter directory and returns it, the others return None."""
    from peft import get_peft_model_state_dict

    directory = Path(directory)
    if not hasattr(model, "peft_config"):
        raise CheckpointError("export_lora_adapter: the actor has no LoRA adapter; set actor.lora.rank > 0, or "
                              "actor.lora.save_adapter_only=false to export the whole model")
    if (directory / ADAPTER_WEIGHTS).exists():
        raise CheckpointError(f"export_lora_adapter: {directory} already holds an adapter; export into a new directory")
    state = {}
    for name, param in model.named_parameters():  # the same order on every rank: the gathers match
        if LORA_PARAMETER.search(name):
            tensor = param.detach()
            tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            if rank == 0:
                state[name] = tensor.cpu()
    if rank != 0:
        return None
    adapter = get_peft_model_state_dict(model, state_dict=state)  # peft's own saved names
    directory.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(model.peft_config["default"])
    config.base_model_name_or_path = str(Path(base_model_dir).expanduser().resolve())
    config.save_pretrained(directory)
    save_file({k: v.contiguous() for k, v in adapter.items()}, directory / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    fsync_tree(directory)
    return directory
