"""Reward model scoring with a tiny sequence-classification model built offline."""

from __future__ import annotations

import pytest
import torch

from hybridflow.builders import build_char_tokenizer
from hybridflow.rewards import RewardConfig, RewardModelConfig, build_reward
from hybridflow.rewards.model import load_reward_model

ROWS = [
    {"prompt": "1+1=", "response": "2", "ground_truth": "2"},
    {"prompt": "12+30=", "response": "42 is it", "ground_truth": "42"},
    {"prompt": "7*8=", "response": "56", "ground_truth": "56"},
    {"prompt": "What is 9-3? ", "response": "6", "ground_truth": "5"},
    {"prompt": "2=", "response": "", "ground_truth": "2"},
]


def make_model(path, num_labels=1):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         num_labels=num_labels, pad_token_id=tokenizer.pad_token_id)
    Qwen2ForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("rm") / "model")


def one_by_one(model_dir, texts, keep_last_tokens=None):
    """Reference: each text alone, no padding, straight through the model."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    # The directory's own tokenizer, as the scorer loads it (transformers 5 picks the class
    # from the model type, Qwen2Tokenizer here, not the tokenizer the directory was saved with).
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    scores = []
    for text in texts:
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        if keep_last_tokens is not None:
            ids = ids[:, -keep_last_tokens:]
        with torch.no_grad():
            scores.append(float(model(input_ids=ids).logits[0, 0]))
    return scores


def test_scores_equal_unpadded_one_by_one(model_dir):
    scorer = load_reward_model(str(model_dir), max_length=64, micro_batch_rows=2)
    scores = scorer.score(ROWS)
    expected = one_by_one(model_dir, [r["prompt"] + r["response"] for r in ROWS])
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len(set(round(s, 6) for s in scores)) == len(ROWS)  # a real model: the scores differ


def test_truncation_keeps_the_end_of_the_response(model_dir):
    scorer = load_reward_model(str(model_dir), max_length=5, micro_batch_rows=4)
    texts = [r["prompt"] + r["response"] for r in ROWS]
    assert scorer.score(ROWS) == pytest.approx(one_by_one(model_dir, texts, keep_last_tokens=5), abs=1e-5)
    assert scorer.score(ROWS) != pytest.approx(one_by_one(model_dir, texts), abs=1e-5)  # truncation did happen


def test_reward_model_combined_with_a_function(model_dir):
    cfg = RewardConfig(fn="exact_match", reward_model=RewardModelConfig(path=str(model_dir), weight=0.5))
    result = build_reward(cfg).score(ROWS)
    model_scores = result.extras["reward_model/score"]
    exact = [1.0, 0.0, 1.0, 0.0, 0.0]
    assert result.scores == pytest.approx([e + 0.5 * m for e, m in zip(exact, model_scores)])
    assert result.metrics["reward/reward_model/score"] == pytest.approx(sum(model_scores) / len(ROWS))


def test_model_with_several_labels_is_refused(tmp_path):
    path = make_model(tmp_path / "two", num_labels=2)
    with pytest.raises(ValueError, match=r"num_labels=2; a reward model has a single output"):
        load_reward_model(str(path), max_length=16, micro_batch_rows=2)
