"""Loading a Hugging Face model and sharding it with FSDP2 over the group's ranks.

The framework does not know the architecture: the decoder blocks to shard are the classes the
model itself lists in `_no_split_modules` (every transformers model declares them). Each block
becomes one FSDP2 unit and the root gets the rest (embeddings, final norm, head).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from hybridflow.training.schedules import lr_factor

if TYPE_CHECKING:
    from hybridflow.config.schema import LoraConfig, OptimConfig


def load_model(path: str, dtype: str, *, value_head: bool = False, lora: LoraConfig | None = None,
               gradient_checkpointing: bool = False, trust_remote_code: bool = False) -> torch.nn.Module:
    """A causal LM (or, with `value_head`, a token-classification model with one output per token),
    with a LoRA adapter when `lora` (the `actor.lora` config node) has a rank > 0."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    torch_dtype = getattr(torch, dtype)
    if value_head:
        model = AutoModelForTokenClassification.from_pretrained(
            path, num_labels=1, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora is not None and lora.rank > 0:
        try:
            from peft import LoraConfig as PeftLoraConfig, get_peft_model
        except ImportError as exc:
            raise ImportError("actor.lora.rank > 0 needs peft: pip install peft") from exc
        model = get_peft_model(model, PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                     target_modules=list(lora.target_modules), bias="none"))
    return model


def shard_model(model: torch.nn.Module, device: str) -> torch.nn.Module:
    """FSDP2-shard every decoder block and the root over the default process group."""
    model.to(device)
    if not dist.is_initialized() or (dist.get_world_size() == 1 and device == "cpu"):
        return model  # one CPU rank: nothing to shard, plain module is identical and faster
    block_names = set(getattr(_unwrap(model), "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    if not blocks:
        raise ValueError(
            f"{type(_unwrap(model)).__name__} lists no _no_split_modules; cannot find its decoder blocks to shard")
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    base = getattr(model, "base_model", None)  # peft
    return getattr(base, "model", model) if base is not None and base is not model else model


def build_optimizer(model: torch.nn.Module, optim: OptimConfig, total_steps: int):
    """AdamW over trainable parameters; linear warmup, then constant, cosine or warmup-stable-decay
    (`hybridflow.training.schedules.lr_factor`) over `optim.schedule_steps`, or `total_steps` (the
    trainer's) when that is null. `optim` is the role's `<role>.optim` config node; the schedule
    steps once per trainer step."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    optimizer = torch.optim.AdamW(params, lr=optim.lr, weight_decay=optim.weight_decay, betas=tuple(optim.betas))
    factor = partial(lr_factor, schedule=optim.lr_schedule, warmup_steps=optim.warmup_steps,
                     total_steps=optim.schedule_steps or total_steps, min_lr_ratio=optim.min_lr_ratio,
                     decay_steps=optim.decay_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    return optimizer, scheduler


def clip_gradients(model: torch.nn.Module, max_norm: float) -> float:
    """Clip to `max_norm` (0 disables clipping); returns the total norm before clipping."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def _all_reduce_scalar(value: float | int, op) -> float:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return float(t.item())


def all_reduce_sum(value: float | int) -> float:
    return _all_reduce_scalar(value, dist.ReduceOp.SUM)


def all_reduce_max(value: float | int) -> float:
    return _all_reduce_scalar(value, dist.ReduceOp.MAX)


def all_reduce_mean_dict(stats: dict[str, float]) -> dict[str, float]:
    """Means over ranks of each value (every rank must pass the same keys in the same order)."""
    if not stats or not dist.is_initialized() or dist.get_world_size() == 1:
        return dict(stats)
    keys = sorted(stats)
    t = torch.tensor([float(stats[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    t /= dist.get_world_size()
    return dict(zip(keys, t.tolist()))
