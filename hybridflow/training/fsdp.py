"""Loading a Hugging Face model and sharding it with FSDP2 over the group's ranks.

The framework does not know the architecture: the decoder blocks to shard are the classes the
model itself lists in `_no_split_modules` (every transformers model declares them). Each block
becomes one FSDP2 unit and the root gets the rest (embeddings, final norm, head).

Precision. A trained role keeps its parameters, gradients' reduction and optimizer state in
`model.master_dtype` (float32 by default) and computes in `model.dtype` through FSDP2's
`MixedPrecisionPolicy`: each unit's parameters are cast to the compute dtype as they are
gathered for forward and backward, gradients are reduced in float32 into the float32 shards,
and AdamW steps those. An Adam step of about lr is below half a bfloat16 ulp of a typical
weight, so with bfloat16 parameters most updates would round away (docs/recipes.md). With one
CPU rank FSDP2 is skipped when there is nothing to cast (a plain module is identical and
faster); under mixed precision it is kept there too, so every rank count computes the same way.

Dropout. RL needs the policy's log-probs to be a function of the weights: the sampler has no
dropout, so an actor forward with dropout gives a noisy PPO ratio, and a reference or critic
with it noisy targets. `load_model` zeroes every dropout probability of the model (config
fields before the modules are built, and `nn.Dropout` modules after) unless told to keep them.
Putting the model in eval mode instead would also switch off what `training` gates besides
dropout, such as transformers' gradient checkpointing.
"""

from __future__ import annotations

import re
from functools import partial
from typing import TYPE_CHECKING, Iterable, Iterator

import torch
import torch.distributed as dist

from hybridflow.training.schedules import lr_factor

if TYPE_CHECKING:
    from hybridflow.config.schema import LoraConfig, OptimConfig


def load_model(path: str, dtype: str, *, value_head: bool = False, lora: LoraConfig | None = None,
               gradient_checkpointing: bool = False, trust_remote_code: bool = False,
               keep_dropout: bool = False, on_meta: bool = False) -> torch.nn.Module:
    """A causal LM (or, with `value_head`, a token-classification model with one output per token),
    with a LoRA adapter when `lora` (the `actor.lora` config node) has a rank > 0. Parameters are
    in `dtype` (a trained role's master dtype; the compute dtype is `shard_model`'s). Dropout is
    off unless `keep_dropout` (see the module docstring). `on_meta`: built from the config on the
    meta device, the checkpoint not read (every rank but 0 of a group: `shard_model` fills its
    shards from rank 0's copy)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    torch_dtype = getattr(torch, dtype)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    if not keep_dropout:
        zero_dropout_config(config)
    if value_head:
        config.num_labels = 1
    auto = AutoModelForTokenClassification if value_head else AutoModelForCausalLM
    if on_meta:
        with torch.device("meta"):
            model = auto.from_config(config, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    else:
        model = auto.from_pretrained(path, config=config, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    if not keep_dropout:
        zero_dropout_modules(model)
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


DROPOUT_FIELD = re.compile(r"(dropout|pdrop|layerdrop)", re.IGNORECASE)


def zero_dropout_config(config) -> list[str]:
    """Set every dropout probability of a transformers config (and its sub-configs, e.g. a
    multimodal model's `text_config`) to 0, before the model is built; returns the fields changed.
    Attention modules copy these floats at construction (`attention_dropout`), so zeroing the
    modules afterwards would miss them."""
    from transformers import PretrainedConfig

    changed = []
    for name, value in vars(config).items():
        if isinstance(value, PretrainedConfig):  # a nested one, e.g. text_config
            changed += [f"{name}.{c}" for c in zero_dropout_config(value)]
        elif DROPOUT_FIELD.search(name) and isinstance(value, float) and value > 0:
            setattr(config, name, 0.0)
            changed.append(name)
    return changed


def zero_dropout_modules(model: torch.nn.Module) -> int:
    """p = 0 in every dropout module (some heads default to 0.1 when the config says nothing, e.g.
    GPT-2's token-classification head); returns how many were changed."""
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            module.p = 0.0
            changed += 1
    return changed


def fp32_output_head(model: torch.nn.Module) -> torch.nn.Module:
    """The model's output head (`get_output_embeddings`) made to compute in float32: its input and
    weight upcast, its logits float32 (actor.fp32_lm_head, rollout.fp32_lm_head). In bf16 the logits'
    rounding adds to the gap between two engines' log-probs for the same weights (one report: 8% of
    tokens outside the trust band in bf16, 1.5% with a float32 head; docs/algorithms.md "Rollout
    correction"); the weight stays as the compute dtype holds it (FSDP2's mixed precision casts it),
    the matmul and the logits are float32. Returns `model`."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"actor.fp32_lm_head / rollout.fp32_lm_head: the model's output head is a "
                         f"{type(head).__name__}, not a linear layer; set them to false for this model")

    def forward(hidden: torch.Tensor) -> torch.Tensor:  # (..., H) -> (..., V) float32
        bias = None if head.bias is None else head.bias.float()
        return torch.nn.functional.linear(hidden.float(), head.weight.float(), bias)

    head.forward = forward
    return model


def shard_model(model: torch.nn.Module, device: str, compute_dtype: str | None = None) -> torch.nn.Module:
    """FSDP2-shard every decoder block and the root over the default process group.

    `compute_dtype` (`model.dtype`) different from the parameters' dtype turns on FSDP2's mixed
    precision: forward and backward in `compute_dtype`, gradients reduced in float32 into the
    parameters' (master) dtype. That needs FSDP2 even on one rank; a worker built in-process
    without a process group (a test) gets a one-rank gloo group of its own."""
    # imported here: FSDP pulls in DTensor and sympy (1.7 s on a 2-core CPU), which the driver, importing
    # the worker classes to start them, never uses
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    on_meta = any(p.is_meta for p in model.parameters())
    from_rank0 = dist.is_initialized() and dist.get_world_size() > 1  # every rank rank 0's weights (a random head too)
    full, kept_buffers = {}, {}
    if from_rank0 and not on_meta:  # rank 0: its weights stay in host memory and reach the ranks tensor by tensor
        full = model.state_dict()
        kept_buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
        _to_meta_keeping_ties(model)  # so it starts like every other rank: no whole model on its device
    elif not on_meta:
        model.to(device)
    if device == "cuda":
        attention_for_changing_shapes()
    param_dtype = next(model.parameters()).dtype
    compute = getattr(torch, compute_dtype) if compute_dtype else param_dtype
    mixed = compute != param_dtype
    if not mixed and (not dist.is_initialized() or (dist.get_world_size() == 1 and device == "cpu")):
        return model  # one CPU rank: nothing to shard, plain module is identical and faster
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    block_names = set(getattr(_unwrap(model), "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    if not blocks:
        raise ValueError(
            f"{type(_unwrap(model)).__name__} lists no _no_split_modules; cannot find its decoder blocks to shard")
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32) if mixed else MixedPrecisionPolicy()
    reshard = dist.get_world_size() > 1  # one rank: the gathered copy is the whole model either way
    for block in blocks:
        fully_shard(block, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mp_policy=policy, reshard_after_forward=reshard)
    if from_rank0:
        _fill_from_rank0(model, full, kept_buffers, device)
    elif on_meta:
        raise ValueError("shard_model: a model built on the meta device needs a group whose rank 0 holds the weights")
    return model


def _to_meta_keeping_ties(model: torch.nn.Module) -> None:
    """`model.to("meta")` with its tied parameters (a tied input embedding and output head) still one
    parameter: moving to the meta device makes a new parameter per slot, so ranks built on the meta
    device from the config (tied by transformers) would count one parameter fewer than rank 0."""
    first, ties = {}, []
    for module in model.modules():
        for attr, param in module._parameters.items():
            if param is None:
                continue
            if id(param) in first:
                ties.append((module, attr, first[id(param)]))
            else:
                first[id(param)] = (module, attr)
    model.to("meta")
    for module, attr, (owner, owner_attr) in ties:
        module._parameters[attr] = owner._parameters[owner_attr]


def _fill_from_rank0(model: torch.nn.Module, full: dict, kept_buffers: dict, device: str) -> None:
    """Every rank's shards from rank 0's full weights (`full`, in rank 0's host memory; empty elsewhere:
    those ranks built the model on the meta device and read no checkpoint), tensor by tensor through
    torch.distributed's state-dict API, and the buffers (rotary tables and the like, not in a state
    dict when not persistent; `kept_buffers`, rank 0's) broadcast as they are. Every rank, rank 0
    too, starts from the meta device, so no device ever holds more than its shards and one tensor in
    flight (torchtune's loading), and a node's host memory holds one copy of the checkpoint, not one
    per rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device=device)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for name, buffer in model.named_buffers():
        if name in kept_buffers:
            buffer.data.copy_(kept_buffers[name])
        dist.broadcast(buffer.data, src=0)


def accumulating(model: torch.nn.Module, micro_batches: Iterable) -> Iterator:
    """`micro_batches` as they are, with FSDP2's gradient reduction held back until the last one when
    the group has one rank (a plain module: nothing to hold back).

    On one rank FSDP2's reduce-scatter of each micro-batch's gradients is a copy into the float32
    shard and an addition, and the shard is the whole model: accumulating the unsharded gradients
    (in float32, FSDP2 upcasts them for it) and reducing once costs no memory. On several ranks each
    would then hold a whole unsharded float32 gradient, so every micro-batch is reduced as it comes.
    Measured on an H200 at Qwen2.5-0.5B shapes together with `reshard_after_forward` off on one rank
    (`shard_model`): a third fewer copies in the update, its time unchanged within the runs' noise
    (docs/results/gpu.md "On a GPU")."""
    items = list(micro_batches)
    hold = hasattr(model, "set_requires_gradient_sync") and dist.is_initialized() and dist.get_world_size() == 1
    for i, item in enumerate(items):
        if hold:
            model.set_requires_gradient_sync(i == len(items) - 1)
        yield item


def attention_for_changing_shapes() -> None:
    """Leave cuDNN out of `scaled_dot_product_attention` in this process (a training worker's).

    On Hopper, PyTorch 2.11 picks cuDNN's attention for a padded batch, and cuDNN builds an execution
    plan for every new shape. Training-side shapes change with every micro-batch (trimmed to its
    longest prompt and response, rows shuffled anew each update), so a run builds plans all the
    time: on an H200 the policy update at Qwen2.5-0.5B shapes took 4.43 s with cuDNN and 1.82 s
    without it, against 1.33-1.46 s for a plain loop (bench/gpu_check.py, docs/results/gpu.md
    "On a GPU"). PyTorch then takes its flash or memory-efficient kernels, which need no plan."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    base = getattr(model, "base_model", None)  # peft
    return getattr(base, "model", model) if base is not None and base is not model else model


def build_optimizer(model: torch.nn.Module, optim: OptimConfig, total_steps: int):
    """AdamW over trainable parameters; linear warmup, then constant, cosine or warmup-stable-decay
    (`hybridflow.training.schedules.lr_factor`) over `optim.schedule_steps`, or `total_steps` (the
    trainer's) when that is null. `optim` is the role's `<role>.optim` config node; the schedule
    steps once per trainer step. PyTorch's fused AdamW (one kernel over all parameters, FSDP2's sharded
    ones included) on CUDA, and on the CPU where `optim.fused` asks for it: on an H200 at Qwen2.5-0.5B it
    took the policy update from 1.54 to 1.38 s (docs/results/gpu.md "On a GPU"); on a 2-core EPYC,
    SmolLM2's step 1.23 -> 0.18 s (docs/results/performance.md "The optimizer step"). The CPU's default
    stays PyTorch's (a loop of per-tensor operations) until the documented CPU runs are remeasured: the
    default pipeline's seed 0 trains to other numbers with the fused kernel's rounding."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    on_cuda = all(p.device.type == "cuda" for p in params)
    fused = (on_cuda if optim.fused is None else optim.fused) or None
    optimizer = torch.optim.AdamW(params, lr=optim.lr, weight_decay=optim.weight_decay, betas=tuple(optim.betas),
                                  fused=fused)
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


def read_floats(stats: dict) -> None:
    """Replace the 0-dim tensors among `stats`' values with floats, in place, reading them from their
    device together: a `float()` of a GPU tensor makes the host wait for the GPU's queue to drain, so a
    mini-batch's statistics are read at once, after its last micro-batch (one wait, not one per value
    and micro-batch)."""
    by_device: dict[torch.device, list[str]] = {}
    for k, v in stats.items():
        if isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append(k)
    for keys in by_device.values():
        values = torch.stack([stats[k].detach().reshape(()).to(torch.float64) for k in keys]).tolist()
        stats.update(zip(keys, values))


def _all_reduce_scalar(value: float | int, op, group=None) -> float:
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=op, group=group)
    return float(t.item())


def all_reduce_sum(value: float | int, group=None) -> float:
    """The sum over `group`'s ranks (None: the default group). A sum of the data (tokens, a loss) is taken
    over the data-parallel group: the ranks of a sequence-parallel group hold the same micro-batches
    (hybridflow/training/ulysses.py `data_parallel`)."""
    return _all_reduce_scalar(value, dist.ReduceOp.SUM, group)


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
