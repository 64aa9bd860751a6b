"""The actor as a Hugging Face model directory that transformers and vLLM load.

`export_hf_model` gathers the full (unsharded) state dict on CPU, collectively, and rank 0
writes: `config.json` from the model's own config, the weights as safetensors (one file, or
shards with `model.safetensors.index.json` above `max_shard_bytes`), and every non-weight
file of `tokenizer_source_dir` (tokenizer files, generation_config.json, chat template).

Key names are made to match what `from_pretrained` expects:
- wrapper segments (`_fsdp_wrapped_module`, `_checkpoint_wrapped_module`, `_orig_mod`)
  are removed;
- a peft LoRA model is exported merged: for every active adapter not already merged,
  W' = W + s * B @ A (s is peft's own per-module scaling, so rank/alpha patterns and
  rsLoRA hold; Embedding and fan_in_fan_out layers add (B @ A)^T), computed in fp32 and
  cast back to W's dtype; then `base_model.model.`, `.base_layer` and `modules_to_save`
  wrappers are removed. DoRA and LoRA biases are refused rather than folded wrongly;
- with `tie_word_embeddings` the output embedding (lm_head) is not written, because
  transformers ties it to the input embedding on load.

Memory: rank 0 holds the whole model on CPU once (plus one fp32 LoRA delta at a time).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule

from hybridflow.checkpoint.errors import CheckpointError
from hybridflow.checkpoint.files import fsync_tree

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".distcp", ".gguf", ".h5", ".msgpack")
MODEL_FILE_NAMES = ("config.json", INDEX, "pytorch_model.bin.index.json", "adapter_config.json")
TOKENIZER_MARKERS = ("tokenizer_config.json", "tokenizer.json")
WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
PEFT_PREFIX = "base_model.model."
LORA_KEY = re.compile(r"\.lora_(A|B|embedding_A|embedding_B|magnitude_vector)(\.|$)")
PEFT_LEFTOVER = re.compile(r"lora_|\.base_layer\.|modules_to_save|original_module")


def export_hf_model(directory: "str | os.PathLike[str]", *, model: torch.nn.Module,
                    tokenizer_source_dir: "str | os.PathLike[str]", rank: int,
                    dtype: Optional[torch.dtype] = None, max_shard_bytes: int = 5 * 2**30) -> Optional[Path]:
    """Write `model` (FSDP2-sharded or not, peft LoRA or not) as a Hugging Face directory.

    Collective: every rank calls it; rank 0 writes and returns `directory`, the others return
    None. `dtype` casts floating weights (e.g. torch.bfloat16 for serving); None keeps the
    training dtype. `directory` must hold no weights yet.
    """
    directory, source = Path(directory), Path(tokenizer_source_dir)
    _check_paths(source, directory)  # on every rank, before the collective, so all ranks fail together
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return None
    tensors = hf_state_dict(model, full)
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    directory.mkdir(parents=True, exist_ok=True)
    _write_config(unwrap(model), directory, dtype or _weights_dtype(tensors))
    _write_weights(directory, tensors, max_shard_bytes)
    _copy_non_weight_files(source, directory, unwrap(model))
    fsync_tree(directory)
    return directory


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a peft wrapper (FSDP2 wraps in place: nothing to undo)."""
    return model.get_base_model() if _is_peft(model) else model


def hf_state_dict(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`full` (the model's full state dict) under the names `from_pretrained` expects."""
    state = {_clean(k): v for k, v in full.items()}
    if _is_peft(model):
        state = _strip_peft(model, _merge_lora(model, state))
    _drop_tied_output_embedding(unwrap(model), state)
    return state


# ------------------------------------------------------------------------------ peft


def _is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _clean(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


def _merge_lora(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    for adapter, config in model.peft_config.items():
        if str(getattr(config.peft_type, "value", config.peft_type)) != "LORA":
            raise CheckpointError(f"export_hf_model: peft adapter {adapter!r} is {config.peft_type}; only LoRA "
                                  "adapters are merged into an exported model")
    for name, module in model.named_modules():
        if not (hasattr(module, "lora_A") and hasattr(module, "scaling") and hasattr(module, "base_layer")):
            continue
        prefix = _clean(name)
        for adapter in module.active_adapters:
            if adapter not in module.scaling or adapter in module.merged_adapters:
                continue  # not on this layer, or peft already folded it into the base weight
            if module.use_dora.get(adapter) or getattr(module, "lora_bias", {}).get(adapter):
                raise CheckpointError(f"export_hf_model: {prefix} uses DoRA or a LoRA bias (adapter {adapter!r}), "
                                      "which this export does not merge; merge with peft's merge_and_unload() "
                                      "and export the merged model")
            if adapter in module.lora_A:
                a_key, b_key = f"{prefix}.lora_A.{adapter}.weight", f"{prefix}.lora_B.{adapter}.weight"
                transposed = bool(getattr(module, "fan_in_fan_out", False))  # Conv1D stores W as (in, out)
            else:
                a_key, b_key = f"{prefix}.lora_embedding_A.{adapter}", f"{prefix}.lora_embedding_B.{adapter}"
                transposed = True  # peft's Embedding update is (B @ A)^T
            weight_key = f"{prefix}.base_layer.weight"
            state[weight_key] = _fold(weight_key, state[weight_key], state[a_key], state[b_key],
                                      module.scaling[adapter], transposed)
    return {k: v for k, v in state.items() if not LORA_KEY.search(k)}


def _fold(key: str, weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float,
          transposed: bool) -> torch.Tensor:
    if lora_a.dim() != 2 or lora_b.dim() != 2:
        raise CheckpointError(f"export_hf_model: LoRA on {key} is not a Linear or Embedding layer "
                              f"(A has shape {list(lora_a.shape)}); merge with peft's merge_and_unload()")
    delta = lora_b.float() @ lora_a.float()  # (out, r) @ (r, in) -> (out, in)
    if transposed:
        delta = delta.T
    if delta.shape != weight.shape:
        raise CheckpointError(f"export_hf_model: LoRA update for {key} has shape {list(delta.shape)} but the "
                              f"weight is {list(weight.shape)}")
    return (weight.float() + scale * delta).to(weight.dtype)


def _strip_peft(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    active = "|".join(re.escape(a) for a in model.active_adapters)
    saved_copy = re.compile(rf"\.modules_to_save\.({active})\.")
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if ".original_module." in key or (".modules_to_save." in key and not saved_copy.search(key)):
            continue  # superseded by the active adapter's trained copy
        name = saved_copy.sub(".", key).replace(".base_layer.", ".")
        name = name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name
        if PEFT_LEFTOVER.search(name):
            raise CheckpointError(f"export_hf_model: cannot map peft tensor {key!r} to a base model weight; "
                                  "merge with peft's merge_and_unload() and export the merged model")
        if name in out:
            raise CheckpointError(f"export_hf_model: peft tensors {key!r} and another both map to {name!r}")
        out[name] = value
    return out


# ---------------------------------------------------------------------- model files


def _drop_tied_output_embedding(hf_model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    text_config = hf_model.config.get_text_config() if hasattr(hf_model.config, "get_text_config") else hf_model.config
    output, inputs = hf_model.get_output_embeddings(), hf_model.get_input_embeddings()
    if not getattr(text_config, "tie_word_embeddings", False) or output is None:
        return
    names = {id(module): _clean(name) for name, module in hf_model.named_modules()}
    out_key, in_key = names[id(output)] + ".weight", names[id(inputs)] + ".weight"
    if out_key not in state:
        return
    if in_key in state and not torch.equal(state[out_key], state[in_key]):
        raise CheckpointError(f"export_hf_model: the config ties word embeddings but {out_key} differs from "
                              f"{in_key}; set config.tie_word_embeddings=False before training, or tie them")
    del state[out_key]


def _model_class(hf_model: torch.nn.Module) -> type:
    # fully_shard swaps the instance's class for a generated `FSDP<Name>` subclass.
    return next(c for c in type(hf_model).__mro__ if not issubclass(c, FSDPModule))


def _weights_dtype(tensors: dict[str, torch.Tensor]) -> torch.dtype:
    return next((t.dtype for t in tensors.values() if t.is_floating_point()), torch.float32)


def _write_config(hf_model: torch.nn.Module, directory: Path, dtype: torch.dtype) -> None:
    config = copy.deepcopy(hf_model.config)
    config.architectures = [_model_class(hf_model).__name__]
    config.dtype = dtype
    config.save_pretrained(directory)


def _write_weights(directory: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, seen = 0, set()
    for key in sorted(tensors):
        tensor = tensors[key].detach().contiguous()
        if tensor.data_ptr() in seen:  # safetensors refuses tensors that share memory
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], directory / WEIGHTS, metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, directory / name, metadata={"format": "pt"})
        weight_map.update({key: name for key in shard})
        total += sum(t.numel() * t.element_size() for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _is_model_file(path: Path) -> bool:
    return path.suffix in MODEL_FILE_SUFFIXES or path.name in MODEL_FILE_NAMES


def _check_paths(source: Path, directory: Path) -> None:
    if not source.is_dir() or not any((source / name).is_file() for name in TOKENIZER_MARKERS):
        raise CheckpointError(f"export_hf_model: tokenizer_source_dir {source} holds no "
                              f"{' or '.join(TOKENIZER_MARKERS)}; point it at the Hugging Face directory the "
                              "actor was loaded from")
    if directory.is_dir() and any(_is_model_file(p) for p in directory.iterdir()):
        raise CheckpointError(f"export_hf_model: {directory} already holds model files; export into a new directory")


def _copy_non_weight_files(source: Path, directory: Path, hf_model: torch.nn.Module) -> None:
    for path in sorted(source.iterdir()):
        if path.is_file() and not path.name.startswith(".") and not _is_model_file(path):
            shutil.copy2(path, directory / path.name)
    if not (directory / "generation_config.json").exists() and getattr(hf_model, "generation_config", None):
        hf_model.generation_config.save_pretrained(directory)
