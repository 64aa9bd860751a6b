"""A peft LoRA adapter directory read as the full model it makes: base weights with the
low-rank updates folded in, in fp32.

    W' = W + s * B @ A,   s = lora_alpha / r   (or lora_alpha / sqrt(r) with use_rslora)

`A` is (r, in) and `B` is (out, r) for a Linear `W` of shape (out, in). For an Embedding
(`lora_embedding_A` (r, num_embeddings), `lora_embedding_B` (dim, r)) and for
`fan_in_fan_out` layers (GPT-2's Conv1D, W of shape (in, out)), peft transposes the update:
W' = W + s * (B @ A)^T. `r` is read from A's shape, so `rank_pattern` needs no handling;
`alpha_pattern` overrides lora_alpha per module. Keys, as peft saves them:
`base_model.model.<module>.lora_A.weight`; other saved tensors (`<module>.base_layer.bias`
with bias="lora_only", `lm_head.weight` from modules_to_save) replace the base tensor.
DoRA and LoRA biases on B are refused rather than folded wrongly.

The update is added in place into the fp32 copy of W (`addmm_`), so folding holds W, A and B
and no separate (out, in) delta.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Optional

import torch

from hybridflow.merge.checkpoints import CHECKPOINT_FORMATS, Checkpoint, SafetensorsCheckpoint, open_checkpoint
from hybridflow.merge.errors import MergeError

PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class LoraCheckpoint(Checkpoint):
    """`base` (a Checkpoint) with the adapter at `path` folded in."""

    uses_base = True

    @classmethod
    def matches(cls, path: Path) -> bool:
        return path.is_dir() and (path / ADAPTER_CONFIG).is_file()

    def __init__(self, path: Path, base: Optional[Checkpoint] = None) -> None:
        self.path = path
        self.config = _read_config(path)
        weights = path / ADAPTER_WEIGHTS
        if not weights.is_file():
            raise MergeError(f"{path}: no {ADAPTER_WEIGHTS}; re-save the adapter with "
                             "save_pretrained(..., safe_serialization=True)")
        self.adapter = SafetensorsCheckpoint(weights)
        self._owns_base = base is None
        self.base = base if base is not None else _base_from_config(path, self.config)
        self._base_keys = set(self.base.keys())
        self.updates: dict[str, tuple[str, str, bool]] = {}  # base key -> (A key, B key, transposed)
        self.replaced: dict[str, str] = {}  # base key -> adapter key holding its new value
        for key in self.adapter.keys():
            self._add_key(key)

    def _add_key(self, key: str) -> None:
        name = key[len(PREFIX):] if key.startswith(PREFIX) else key
        if "lora_magnitude_vector" in name or name.endswith("lora_B.bias"):
            raise MergeError(f"{self.path}: {key!r} is a DoRA magnitude or LoRA bias, which cannot be folded "
                             "here; merge it with peft's merge_and_unload() and pass the merged model")
        linear_transposed = bool(self.config.get("fan_in_fan_out", False))  # Conv1D stores W as (in, out)
        for a_part, b_part, transposed in ((".lora_A.weight", ".lora_B.weight", linear_transposed),
                                           (".lora_embedding_A", ".lora_embedding_B", True)):
            if name.endswith(a_part):
                module = name[: -len(a_part)]
                self._add_update(module, key, key[: -len(a_part)] + b_part, transposed)
                return
        if name.endswith((".lora_B.weight", ".lora_embedding_B")):
            return  # taken with its A
        target = name.replace(".base_layer.", ".")
        if target not in self._base_keys:
            raise MergeError(f"{self.path}: adapter tensor {key!r} replaces {target!r}, which the base model "
                             f"{self.base.path} does not have (tied embeddings, or the wrong base model?)")
        if self.adapter.shape(key) != self.base.shape(target):
            raise MergeError(f"{self.path}: adapter tensor {key!r} has shape {list(self.adapter.shape(key))} but "
                             f"{target!r} in {self.base.path} has {list(self.base.shape(target))}")
        self.replaced[target] = key

    def _add_update(self, module: str, a_key: str, b_key: str, transposed: bool) -> None:
        target = module + ".weight"
        if target not in self._base_keys:
            raise MergeError(f"{self.path}: LoRA on {module!r}, but the base model {self.base.path} has no "
                             f"{target!r}; is --base the model the adapter was trained on?")
        if b_key not in self.adapter.keys():
            raise MergeError(f"{self.path}: {a_key!r} has no matching {b_key!r}; the adapter file is incomplete")
        self.updates[target] = (a_key, b_key, transposed)

    def scale(self, module: str, rank: int) -> float:
        alpha = self.config.get("lora_alpha", 8)
        for pattern, value in (self.config.get("alpha_pattern") or {}).items():
            if re.fullmatch(rf"(.*\.)?{pattern}", module):
                alpha = value
        return alpha / math.sqrt(rank) if self.config.get("use_rslora") else alpha / rank

    def keys(self) -> list[str]:
        return self.base.keys()

    def dtype(self, key: str) -> torch.dtype:
        return self.base.dtype(key)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.base.shape(key)

    def read(self, key: str) -> torch.Tensor:
        # peft may save a module's base weight too (embeddings): it replaces the base's copy
        # and the low-rank update is added on top of it.
        weight = self.adapter.read(self.replaced[key]) if key in self.replaced else self.base.read(key)
        if key not in self.updates:
            return weight
        a_key, b_key, transposed = self.updates[key]
        weight = weight.to(torch.float32)
        lora_a = self.adapter.read(a_key).to(torch.float32)  # (r, in) or (r, num_embeddings)
        lora_b = self.adapter.read(b_key).to(torch.float32)  # (out, r) or (dim, r)
        first, second = (lora_a.T, lora_b.T) if transposed else (lora_b, lora_a)
        if (first.shape[0], second.shape[1]) != tuple(weight.shape):
            raise MergeError(f"{self.path}: LoRA update for {key!r} has shape {[first.shape[0], second.shape[1]]} "
                             f"but the base weight is {list(weight.shape)}; the adapter belongs to another model")
        return weight.addmm_(first, second, alpha=self.scale(key[: -len(".weight")], lora_a.shape[0]))

    def source(self, key: str) -> str:
        if key in self.updates or key in self.replaced:
            return f"{self.adapter.path} (folded into {self.base.source(key)})"
        return self.base.source(key)

    def attach_hasher(self, hasher) -> None:
        self.adapter.attach_hasher(hasher)
        self.base.attach_hasher(hasher)

    def weight_files(self) -> list[Path]:
        return self.adapter.weight_files() + self.base.weight_files()

    def files_to_copy(self) -> list[Path]:
        own = [p for p in self.path.iterdir() if p.is_file() and p.name not in (ADAPTER_CONFIG, "README.md")
               and not p.name.startswith("adapter_model")]
        names = {p.name for p in own}
        return sorted([p for p in self.base.files_to_copy() if p.name not in names] + own)

    def close(self) -> None:
        self.adapter.close()
        if self._owns_base:
            self.base.close()


CHECKPOINT_FORMATS.add("lora", LoraCheckpoint)


def _read_config(path: Path) -> dict:
    try:
        config = json.loads((path / ADAPTER_CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise MergeError(f"{path / ADAPTER_CONFIG}: cannot read it ({exc})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise MergeError(f"{path}: peft_type {config.get('peft_type')!r} is not LORA; only LoRA adapters fold")
    if config.get("use_dora"):
        raise MergeError(f"{path}: DoRA adapters are not folded here; use peft's merge_and_unload()")
    return config


def _base_from_config(path: Path, config: dict) -> Checkpoint:
    named = config.get("base_model_name_or_path")
    if named and Path(named).expanduser().is_dir():
        return open_checkpoint(named)
    raise MergeError(f"LoRA adapter {path} needs its base model: pass --base BASE_DIR (adapter_config.json "
                     f"names {named!r}, which is not a local directory)")
