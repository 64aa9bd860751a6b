"""A sharded model's weights read or replaced whole, under Hugging Face names.

For the trainable workers' collective calls that see the model as one piece rather than as
shards: the full state dict the reference hooks merge (hybridflow/run/runner.py), replacing the
weights with a merge of checkpoints (the `spike_recovery` step hook), and the export as a
Hugging Face model directory or a peft adapter directory (hybridflow/checkpoint). Nothing here
knows the role; each function is collective over the model's group.
"""

from __future__ import annotations

import torch


def full_state_dict(model: torch.nn.Module, dtype: str) -> dict:
    """Collective: the full (unsharded) weights on the CPU, floating-point ones cast to `dtype`; every
    rank builds it (a RANK_ZERO call returns rank 0's)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    cast = getattr(torch, dtype)
    return {k: v.to(cast) if v.is_floating_point() else v for k, v in state.items()}


def load_full_state_dict(model: torch.nn.Module, weights: dict[str, torch.Tensor], who: str) -> None:
    """Collective: replace the weights with full tensors under Hugging Face names. Refuses a set of
    names other than the model's (an untied `lm_head.weight` may be left out where the model ties
    it), naming `who` (role and rank), a few of the unexpected and the missing."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    expected = set(model.state_dict())
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if set(weights) - expected or expected - set(weights) - tied:
        raise KeyError(f"{who}: the weights to load do not match the model: unexpected "
                       f"{sorted(set(weights) - expected)[:5]}, missing {sorted(expected - set(weights) - tied)[:5]}")
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=False))


def export_hf(directory: str, *, model: torch.nn.Module, tokenizer_source_dir: str, base_model_dir: str,
              rank: int, dtype: str, adapter_only: bool) -> str | None:
    """Collective: rank 0 writes `model` (LoRA folded) as a Hugging Face model directory in `dtype`;
    or, with `adapter_only`, its LoRA adapter as a peft adapter directory over `base_model_dir`.
    Returns the directory written (rank 0), else None."""
    from hybridflow.checkpoint import export_hf_model, export_lora_adapter

    if adapter_only:
        path = export_lora_adapter(directory, model=model, base_model_dir=base_model_dir, rank=rank)
    else:
        path = export_hf_model(directory, model=model, tokenizer_source_dir=tokenizer_source_dir,
                               rank=rank, dtype=getattr(torch, dtype))
    return str(path) if path is not None else None
