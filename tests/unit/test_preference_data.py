"""Preference data (hybridflow/data/preference.py): TRL's (prompt, chosen, rejected) rows in text and
conversational form, their pair batches, the 2B sequences both halves are scored as, the per-pair
sums, the synthetic pairs, and the checks that name a bad row before anything starts."""

from __future__ import annotations

import random

import pytest
import torch

from hybridflow.algos.preference import PREFERENCE_LOSSES
from hybridflow.config.schema import PREFERENCE_LOSS_NAMES, REFERENCE_FREE_LOSSES, DPOConfig, HybridFlowConfig, RecipeConfig
from hybridflow.data.preference import (
    encode_pairs,
    long_response_problems,
    near_miss,
    pair_sequences,
    pair_sums,
    response_text,
    synthetic_pairs,
)
from hybridflow.data.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def test_a_response_is_text_or_chat_messages_ending_with_the_assistants_turn():
    assert response_text("82", "chosen", 0, "f") == "82"
    assert response_text([{"role": "assistant", "content": "82"}], "chosen", 0, "f") == "82"
    assert response_text([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "7"}],
                         "rejected", 3, "f") == "7"
    with pytest.raises(ValueError, match=r"f, column 'rejected', row 3: the last message's role is 'user'"):
        response_text([{"role": "user", "content": "7"}], "rejected", 3, "f")
    with pytest.raises(ValueError, match=r"column 'chosen', row 5: int '7' is not a response; fix: give text"):
        response_text(7, "chosen", 5, "f")


def test_pairs_encode_as_one_row_per_pair_and_score_as_chosen_then_rejected_sequences(tokenizer):
    rows = [{"prompt": "12+3=", "chosen": "15", "rejected": "16"},
            {"prompt": [{"role": "user", "content": "4+4="}], "chosen": [{"role": "assistant", "content": "8"}],
             "rejected": [{"role": "assistant", "content": "9"}]}]
    pairs = encode_pairs(rows[:1], tokenizer, max_prompt_tokens=8, max_response_tokens=4)
    assert pairs["prompt_ids"].shape == (1, 8) and pairs["chosen_ids"].shape == (1, 4)
    eos = tokenizer.eos_token_id
    assert pairs["chosen_ids"][0, :3].tolist() == tokenizer("15", add_special_tokens=False)["input_ids"] + [eos]
    assert pairs["rejected_mask"][0].tolist() == [True, True, True, False]
    text = encode_pairs([rows[0], {**rows[0], "chosen": "150"}], tokenizer, 8, 4)
    sequences = pair_sequences(text)
    assert len(sequences) == 4  # chosen 0, chosen 1, rejected 0, rejected 1
    assert torch.equal(sequences["response_ids"][1], text["chosen_ids"][1])
    assert torch.equal(sequences["response_ids"][2], text["rejected_ids"][0])
    assert torch.equal(sequences["prompt_ids"][3], text["prompt_ids"][1])
    assert torch.equal(sequences["response_mask"][2:], text["rejected_mask"])


def test_pair_sums_are_each_responses_log_probability_or_its_mean_per_token():
    log_probs = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -9.0, -9.0], [-3.0, -1.0, -1.0], [-4.0, -9.0, -9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    chosen, rejected = pair_sums(log_probs, mask)
    assert chosen.tolist() == [-3.0, -0.5] and rejected.tolist() == [-5.0, -4.0]
    chosen, rejected = pair_sums(log_probs, mask, per_token=True)
    assert chosen.tolist() == [-1.5, -0.5] and rejected.tolist() == pytest.approx([-5 / 3, -4.0])


def test_synthetic_pairs_reject_a_near_miss_of_the_right_answer_drawn_from_the_seed():
    rng = random.Random(0)
    for answer in ["0", "9", "10", "99", "100", "58", "1234"]:
        for _ in range(20):
            wrong = near_miss(answer, rng)
            assert wrong != answer and len(wrong) == len(answer) and (wrong[0] != "0" or len(wrong) == 1)
            assert sum(a != b for a, b in zip(wrong, answer)) == 1  # one digit, moved by one
            assert max(abs(int(a) - int(b)) for a, b in zip(wrong, answer)) == 1
    rows = [{"prompt": f"{a}+1=", "ground_truth": str(a + 1)} for a in range(30)]
    pairs = synthetic_pairs(rows, seed=3)
    assert pairs == synthetic_pairs(rows, seed=3) and pairs != synthetic_pairs(rows, seed=4)
    assert all(p["chosen"] == p["ground_truth"] != p["rejected"] for p in pairs)
    with pytest.raises(ValueError, match="has no digit"):
        near_miss("abc", rng)


def test_a_response_over_the_token_limit_names_the_file_column_rows_and_the_fix(tokenizer):
    rows = [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}, {"prompt": "1+1=", "chosen": "2", "rejected": "33333"}]
    problems = long_response_problems(rows, tokenizer, limit=3, where="data file p.jsonl (data.train_path)")
    assert problems == ["data file p.jsonl (data.train_path), column 'rejected', row(s) 1: row 1's response needs 6 "
                        "tokens with EOS, more than rollout.max_response_tokens=3; fix: raise "
                        "rollout.max_response_tokens to 6, or shorten those responses"]


def test_the_schemas_loss_names_are_the_registered_losses_and_dpo_needs_a_reference_unless_reference_free():
    assert set(PREFERENCE_LOSS_NAMES) == set(PREFERENCE_LOSSES.names())
    for loss in PREFERENCE_LOSS_NAMES:
        config = HybridFlowConfig(recipe=RecipeConfig(name="dpo"), dpo=DPOConfig(loss=loss))
        assert config.needs_reference is (loss not in REFERENCE_FREE_LOSSES)
    assert not HybridFlowConfig(recipe=RecipeConfig(name="sft")).needs_reference
    with pytest.raises(ValueError, match=r"dpo.loss.*'kto'.*one of \['sigmoid'"):
        DPOConfig(loss="kto")
    with pytest.raises(ValueError, match=r"dpo.label_smoothing"):
        DPOConfig(label_smoothing=0.5)


def _write(path, rows):
    import json

    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_preference_file_without_a_response_column_is_refused_before_anything_starts(tmp_path):
    from hybridflow.config import compose
    from hybridflow.preflight import InputError, check_inputs

    good = [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}] * 4
    train = _write(tmp_path / "train.jsonl", [{"prompt": "1+1=", "chosen": "2"}] * 4)
    val = _write(tmp_path / "val.jsonl", good)
    config = compose(["recipe=dpo", f"data.train_path={train}", f"data.val_path={val}", "trainer.prompts_per_step=4"])
    with pytest.raises(InputError) as refused:
        check_inputs(config)
    message = str(refused.value)
    assert f"data file {train} (data.train_path): no column 'rejected'" in message
    assert "fix: add a 'rejected' column (text, or chat messages ending with the assistant's turn)" in message
    assert "ground_truth" not in message  # DPO scores nothing: no reward function's columns are asked for
    _write(train, good)
    check_inputs(config)  # the same files with the column: nothing to say


def test_a_response_longer_than_the_limit_stops_the_run_before_ray_starts(tmp_path, tokenizer):
    import ray

    from hybridflow.config import compose
    from hybridflow.data.checks import InputError
    from hybridflow.launch import prepare_preference_data

    rows = [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}] * 4
    train = _write(tmp_path / "train.jsonl", rows[:3] + [{"prompt": "1+1=", "chosen": "2", "rejected": "3" * 30}])
    val = _write(tmp_path / "val.jsonl", rows)
    config = compose(["recipe=dpo", f"data.train_path={train}", f"data.val_path={val}", "trainer.prompts_per_step=4",
                      "rollout.max_response_tokens=8"])
    with pytest.raises(InputError, match=rf"data file {train} \(data.train_path\), column 'rejected', row\(s\) 3: .*"
                                         r"needs 31 tokens with EOS, more than rollout.max_response_tokens=8"):
        prepare_preference_data(config, tmp_path / "run", tokenizer)
    assert not ray.is_initialized()
    pairs = prepare_preference_data(compose(["recipe=dpo", "trainer.val_prompts=16"]), tmp_path / "synthetic", tokenizer)
    assert len(pairs.val) == 16 and all(row["chosen"] == row["ground_truth"] != row["rejected"] for row in pairs.train)
