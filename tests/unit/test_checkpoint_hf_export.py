"""export_hf_model in one process: untied heads, sharded output, peft LoRA merged, errors.

(The FSDP2-sharded, tied-embedding export is tested with two processes in
test_checkpoint_fsdp.py.)
"""

from __future__ import annotations

import json

import pytest
import torch

from hybridflow.builders import build_tiny_model
from hybridflow.config.schema import TinyModelConfig
from hybridflow.checkpoint import CheckpointError, export_hf_model

UNTIED = TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False)
PROBE = torch.arange(4, 16).reshape(2, 6)  # (B=2, T=6)


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("untied") / "model", UNTIED)


def _logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=PROBE).logits


def _load(path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model


def test_untied_export_in_shards(untied_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(untied_dir)
    with torch.no_grad():
        model.lm_head.weight.add_(0.5)  # distinguishable from the input embedding
    out = export_hf_model(tmp_path / "hf", model=model, tokenizer_source_dir=untied_dir, rank=0,
                          max_shard_bytes=16_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and "lm_head.weight" in index["weight_map"]
    assert not (out / "model.safetensors").exists()
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {p.name for p in out.iterdir()}
    torch.testing.assert_close(_logits(_load(out)), _logits(model), atol=0, rtol=0)


def test_export_casts_dtype(untied_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(untied_dir)
    out = export_hf_model(tmp_path / "hf", model=model, tokenizer_source_dir=untied_dir, rank=0,
                          dtype=torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16


def test_lora_model_is_exported_merged(untied_dir, tmp_path):
    import peft
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(untied_dir)
    config = peft.LoraConfig(r=4, lora_alpha=8, use_rslora=True, rank_pattern={"v_proj": 2},
                             target_modules=["q_proj", "v_proj", "embed_tokens"], modules_to_save=["lm_head"],
                             init_lora_weights=False)  # random B: the adapter changes the outputs
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        model.base_model.model.lm_head.modules_to_save["default"].weight.mul_(1.5)
    expected = _logits(model)
    out = export_hf_model(tmp_path / "hf", model=model, tokenizer_source_dir=untied_dir, rank=0)
    merged = _load(out)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    torch.testing.assert_close(_logits(merged), expected, atol=1e-5, rtol=1e-5)
    fresh = AutoModelForCausalLM.from_pretrained(untied_dir)
    assert not torch.allclose(_logits(fresh), expected, atol=1e-3)  # the merge really carried the adapter


def test_already_merged_adapter_is_not_added_twice(untied_dir, tmp_path):
    import peft
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(untied_dir)
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    expected = _logits(model)
    model.merge_adapter()  # what a rollout weight sync may leave behind
    out = export_hf_model(tmp_path / "hf", model=model, tokenizer_source_dir=untied_dir, rank=0)
    torch.testing.assert_close(_logits(_load(out)), expected, atol=1e-5, rtol=1e-5)


def test_export_errors(untied_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(untied_dir)
    with pytest.raises(CheckpointError, match=r"tokenizer_source_dir .*empty holds no tokenizer_config.json"):
        export_hf_model(tmp_path / "hf", model=model, tokenizer_source_dir=tmp_path / "empty", rank=0)
    export_hf_model(tmp_path / "hf", model=model, tokenizer_source_dir=untied_dir, rank=0)
    with pytest.raises(CheckpointError, match="already holds model files; export into a new directory"):
        export_hf_model(tmp_path / "hf", model=model, tokenizer_source_dir=untied_dir, rank=0)
