"""Tiny real-architecture models and their BPE tokenizer (hybridflow/builders/architectures.py)."""

from __future__ import annotations

import json

import pytest

from hybridflow.builders.architectures import build_bpe_tokenizer, build_tiny_architecture
from hybridflow.checks.model import CPU_ATTENTION_HEAD_SIZES, attention_shape


def test_the_bpe_tokenizer_merges_and_renders_chat():
    tok = build_bpe_tokenizer()
    assert len(tok("37+45=82").input_ids) < len("37+45=82")  # merges learned from the generated corpus
    text = tok.apply_chat_template([{"role": "user", "content": "1+2="}], tokenize=False, add_generation_prompt=True)
    assert text == "<|user|>1+2=<|end|><|assistant|>"
    assert tok.decode(tok("What is 3+4?").input_ids) == "What is 3+4?"  # byte-level: lossless
    assert tok.pad_token_id != tok.eos_token_id


def test_gpt2_is_built_without_dropout_and_a_cpu_head_size(tmp_path):
    path = build_tiny_architecture("gpt2", tmp_path / "gpt2")
    config = json.loads((path / "config.json").read_text())
    assert config["resid_pdrop"] == config["embd_pdrop"] == config["attn_pdrop"] == 0.0
    assert attention_shape(config)[2] in CPU_ATTENTION_HEAD_SIZES
    assert build_tiny_architecture("gpt2", tmp_path / "gpt2") == path  # reused
    with pytest.raises(ValueError, match="unknown architecture 'bert'"):
        build_tiny_architecture("bert", tmp_path / "bert")
