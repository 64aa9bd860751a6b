"""The training side's weights as checkpoint-named tensors: names, shapes, local shards, full tensors.

Names are Hugging Face checkpoint names: the vLLM model's own loader maps them (stacking q/k/v
and gate/up, slicing for tensor parallelism). A peft LoRA model is folded on the fly,
W + (alpha / r) * B @ A per adapted linear layer, so its names are the base model's.
"""

from __future__ import annotations

import re
from typing import Iterator

import torch

LORA_SUFFIX = re.compile(r"\.lora_(A|B)\.[^.]+\.weight$")


def is_peft(model: torch.nn.Module) -> bool:
    return any(".lora_A." in n for n, _ in model.named_parameters())


def checkpoint_name(name: str, peft: bool) -> str:
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".") if peft else name


def checkpoint_shapes(model: torch.nn.Module) -> dict[str, list[int]]:
    """Checkpoint name -> full shape of every weight the rollout receives, in parameter order.
    Reading a DTensor's shape gathers nothing."""
    peft = is_peft(model)
    return {checkpoint_name(n, peft): list(p.shape) for n, p in model.named_parameters()
            if not (peft and LORA_SUFFIX.search(n))}


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """This rank's FSDP2 shard of a parameter (the whole tensor when it is not sharded)."""
    t = param.detach()
    return t.to_local() if hasattr(t, "to_local") else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _lora_scale(model: torch.nn.Module, module_path: str) -> float:
    module = model.get_submodule(module_path)
    scaling = getattr(module, "scaling", None)
    if isinstance(scaling, dict):
        return float(next(iter(scaling.values())))
    raise ValueError(f"cannot find the LoRA scaling of {module_path}")


def full_weights(model: torch.nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, full tensor) for every parameter, LoRA folded, one tensor at a time.

    Gathering a sharded tensor is a collective: every rank of the training group must consume
    this iterator in the same order."""
    params = dict(model.named_parameters())
    peft = is_peft(model)
    for name, param in params.items():
        if peft and LORA_SUFFIX.search(name):
            continue  # folded into its base weight below
        tensor = full_tensor(param.detach())
        if peft and ".base_layer.weight" in name:
            module_path = name[: -len(".base_layer.weight")]
            lora_a = full_tensor(params[f"{module_path}.lora_A.default.weight"].detach())
            lora_b = full_tensor(params[f"{module_path}.lora_B.default.weight"].detach())
            tensor = tensor.float() + _lora_scale(model, module_path) * (lora_b.float() @ lora_a.float())
        yield checkpoint_name(name, peft), tensor.to(dtype) if dtype is not None else tensor
