"""What a Hugging Face model directory says about its model, read in one place.

`config.json` is opened here and nowhere else in the project (tests/unit/test_layering.py checks):
the config rules, vLLM's input checks, the memory model, the planner and the parity message
all take a `ModelFacts`. One set of names and fallbacks serves every architecture family the
project meets — Llama-style names (`num_attention_heads`, `hidden_size`, ...) and GPT-2's (`n_head`,
`n_embd`, `n_layer`, `n_inner`, `n_positions`), a multimodal model's `text_config` — so a model
cannot pass one check and fail another for reading a field differently. The parameter count
comes from the safetensors headers (exact, without loading a tensor).

Standard library only: the config schema imports it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path


@dataclass(frozen=True)
class ModelFacts:
    architecture: str  # the first of config.json's `architectures`, else its `model_type`
    model_type: str
    layers: int  # 0 when config.json does not say
    heads: int  # attention heads; 0 when config.json does not say
    kv_heads: int  # key/value heads (the attention heads when not grouped)
    head_size: int  # 0 when it cannot be told
    hidden: int
    intermediate: int
    vocab: int
    tied_embeddings: bool  # unsaid: tied (the smaller, a memory model's lower bound)
    max_positions: int  # 0 when config.json does not say
    parameters: int  # from the safetensors headers; 0 without weights

    @classmethod
    def from_config_json(cls, config: dict, parameters: int = 0) -> "ModelFacts":
        """From a parsed config.json (its `text_config` for a multimodal model)."""
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config

        def number(*names: str) -> int:
            for name in names:
                value = text.get(name)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
            return 0

        heads = number("num_attention_heads", "n_head")
        hidden = number("hidden_size", "n_embd")
        names = config.get("architectures") or []
        model_type = str(config.get("model_type") or text.get("model_type") or "")
        return cls(architecture=str(names[0]) if names else (model_type or "an unknown architecture"),
                   model_type=model_type, layers=number("num_hidden_layers", "n_layer"), heads=heads,
                   kv_heads=number("num_key_value_heads") or heads,
                   head_size=number("head_dim") or (hidden // heads if heads else 0), hidden=hidden,
                   intermediate=number("intermediate_size", "n_inner") or 4 * hidden, vocab=number("vocab_size"),
                   tied_embeddings=bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", True))),
                   max_positions=number("max_position_embeddings", "n_positions"), parameters=parameters)

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelFacts | None":
        """From a model directory's config.json and safetensors headers; None when config.json is
        missing or unreadable (the model's own loading, or preflight's directory check, says why)."""
        root = Path(path).expanduser()
        try:
            stamp = (root / "config.json").stat().st_mtime_ns
        except OSError:
            return None
        return _read(str(root), stamp)


@lru_cache(maxsize=32)
def _read(root: str, stamp: int) -> "ModelFacts | None":
    """One read per directory and version of its config.json (`stamp`: its modification time)."""
    try:
        config = json.loads((Path(root) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    try:
        parameters = sum(_safetensors_numel(f) for f in Path(root).glob("*.safetensors"))
    except (OSError, ValueError):
        parameters = 0
    return ModelFacts.from_config_json(config, parameters)


def _safetensors_numel(path: Path) -> int:
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    total = 0
    for name, entry in header.items():
        if name != "__metadata__":
            count = 1
            for d in entry["shape"]:
                count *= d
            total += count
    return total
