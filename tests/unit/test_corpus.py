"""The pretraining corpus: generated text, files, packing into sequences, the actor's layout."""

import json

import pytest
import torch

from hybridflow.builders.tiny_model import build_char_tokenizer
from hybridflow.data.corpus import (PretrainConfig, build_corpus, generated_documents, pack_documents,
                                    read_documents, sequence_batch)


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def test_generated_documents_are_deterministic_and_held_out_differs():
    docs = generated_documents(50, world_entities=20, world_seed=0, seed=0)
    assert docs == generated_documents(50, world_entities=20, world_seed=0, seed=0)
    held_out = generated_documents(50, world_entities=20, world_seed=0, seed=1)
    assert not set(docs) & set(held_out)
    text = " ".join(docs)
    assert "=" in text and "reverse" in text and "sort" in text and "coins" in text


def test_generated_text_has_no_unknown_characters(tokenizer):
    docs = generated_documents(200, world_entities=20, world_seed=0, seed=0)
    ids = tokenizer(docs, add_special_tokens=False)["input_ids"]
    assert all(tokenizer.unk_token_id not in row for row in ids)


def test_pack_by_hand(tokenizer):
    # "12" "345" -> 1 2 </s> 3 4 5 </s> (7 tokens) -> two sequences of 3, the last token dropped
    packed = pack_documents(["12", "345"], tokenizer, 3)
    eos = tokenizer.eos_token_id
    assert packed.tolist() == [[tokenizer.convert_tokens_to_ids(c) for c in "12"] + [eos],
                               [tokenizer.convert_tokens_to_ids(c) for c in "345"]]


def test_sequence_batch_layout():
    batch = sequence_batch(torch.tensor([[5, 6, 7], [8, 9, 10]]), start_token_id=1)
    assert batch["prompt_ids"].tolist() == [[1], [1]] and batch["prompt_mask"].all()
    assert batch["response_ids"].tolist() == [[5, 6, 7], [8, 9, 10]] and batch["response_mask"].all()


def test_corpus_from_files_and_errors(tmp_path, tokenizer):
    train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train.write_text("".join(json.dumps({"body": "abc " * 40}) + "\n" for _ in range(20)))
    val.write_text("".join(json.dumps({"body": "cab " * 40}) + "\n" for _ in range(4)))
    config = PretrainConfig(train_path=str(train), val_path=str(val), text_column="body", tokens_per_sequence=16,
                            sequences_per_step=4, val_sequences=8)
    corpus = build_corpus(config, tokenizer)
    assert corpus.train.shape == (20 * 161 // 16, 16) and corpus.val.shape == (8, 16)
    assert corpus.start_token_id == tokenizer.bos_token_id
    with pytest.raises(ValueError, match="column 'text' holds no such column"):
        read_documents(train, "text", "pretrain.train_path")
    with pytest.raises(ValueError, match="pretrain.val_sequences=99"):
        build_corpus(PretrainConfig(train_path=str(train), val_path=str(val), text_column="body",
                                    tokens_per_sequence=16, val_sequences=99), tokenizer)
    with pytest.raises(ValueError, match="set both"):
        PretrainConfig(train_path=str(train))
