"""hybridflow/config/model_facts.py: one reading of config.json for every check — Llama-style and
GPT-2 names alike, a multimodal model's text_config, the parameter count from safetensors headers."""

from __future__ import annotations

import json

from hybridflow.builders.architectures import build_tiny_architecture
from hybridflow.config.model_facts import ModelFacts
from hybridflow.config.schema import ModelConfig, model_heads, model_layers
from hybridflow.checks.memory_budget import ModelShape


def test_llama_and_gpt2_names_give_the_same_facts():
    llama = ModelFacts.from_config_json({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                         "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 256,
                                         "num_hidden_layers": 4, "intermediate_size": 512, "vocab_size": 1000,
                                         "max_position_embeddings": 128, "tie_word_embeddings": False})
    gpt2 = ModelFacts.from_config_json({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_head": 8,
                                        "n_embd": 256, "n_layer": 4, "n_inner": 512, "vocab_size": 1000,
                                        "n_positions": 128, "tie_word_embeddings": False})
    fields = ("layers", "heads", "head_size", "hidden", "intermediate", "vocab", "max_positions", "tied_embeddings")
    assert [getattr(llama, f) for f in fields] == [getattr(gpt2, f) for f in fields] == [4, 8, 32, 256, 512, 1000,
                                                                                          128, False]
    assert (llama.kv_heads, gpt2.kv_heads) == (2, 8)  # GPT-2's attention is not grouped
    assert (llama.architecture, gpt2.architecture) == ("LlamaForCausalLM", "GPT2LMHeadModel")


def test_fallbacks_text_config_and_an_explicit_head_size():
    facts = ModelFacts.from_config_json({"model_type": "llava", "text_config": {
        "num_attention_heads": 4, "hidden_size": 128, "head_dim": 64, "num_hidden_layers": 2}})
    assert (facts.heads, facts.kv_heads, facts.head_size, facts.layers) == (4, 4, 64, 2)
    assert facts.intermediate == 4 * 128 and facts.tied_embeddings  # unsaid: 4 x hidden, tied
    assert facts.architecture == "llava"
    empty = ModelFacts.from_config_json({})
    assert (empty.heads, empty.head_size, empty.layers) == (0, 0, 0)


def test_a_directory_is_read_once_per_version_and_counts_its_parameters(tmp_path):
    path = build_tiny_architecture("gpt2", tmp_path / "gpt2")
    facts = ModelFacts.from_dir(path)
    assert facts.architecture == "GPT2LMHeadModel" and facts.heads > 0 and facts.parameters > 0
    assert ModelFacts.from_dir(path) is facts  # cached
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "n_layer": 7}))
    assert ModelFacts.from_dir(path).layers == 7  # a changed file is read again
    assert ModelFacts.from_dir(tmp_path / "missing") is None


def test_the_schemas_head_count_reads_gpt2s_names(tmp_path):
    """Before: the schema's reader knew only `num_attention_heads`, so a GPT-2 directory had 0 heads
    there while vLLM's check and the memory model read `n_head`."""
    path = build_tiny_architecture("gpt2", tmp_path / "gpt2")
    config = json.loads((path / "config.json").read_text())
    model = ModelConfig(path=str(path))
    assert model_heads(model) == (config["n_head"], config["n_head"])
    assert model_layers(model) == config["n_layer"]
    assert ModelShape.from_dir(path).heads == config["n_head"]
