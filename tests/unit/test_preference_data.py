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
    fit_pair,
    near_miss,
    pair_limit_problems,
    pair_sequences,
    pair_sums,
    preference_row,
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
    # a multi-turn response is never cut to its last message: its history belongs in the prompt
    with pytest.raises(ValueError, match=r"f, column 'rejected', row 3: a conversation of 2 messages; fix: read the "
                                         r"row with preference_row"):
        response_text([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "7"}], "rejected", 3, "f")
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
    problems, over = pair_limit_problems(rows, tokenizer, 8, 3, None, where="data file p.jsonl (data.train_path)")
    assert over == [1]
    assert problems == ["data file p.jsonl (data.train_path), column 'rejected', row(s) 1: row 1's response needs 6 "
                        "tokens with EOS, more than rollout.max_response_tokens=3; fix: raise "
                        "rollout.max_response_tokens to 6, shorten those responses, or set "
                        "dpo.truncation_mode=keep_start|keep_end to cut them"]
    # dpo.max_length: the prompt (5 tokens: BOS? no, the tiny tokenizer's own count) and the longer response
    problems, over = pair_limit_problems(rows[:1], tokenizer, 8, 3, 3, where="f")
    assert over == [0] and problems[0].startswith("f, row(s) 0: row 0's prompt and longer response need ")
    assert "more than dpo.max_length=3; fix: raise dpo.max_length to" in problems[0]


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
    from hybridflow.checks.preflight import InputError, check_inputs

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


def test_a_response_longer_than_the_limit_stops_the_run_before_ray_starts(tmp_path, tokenizer, monkeypatch):
    import ray

    from hybridflow.config import compose
    from hybridflow.data.checks import InputError
    from hybridflow.run.launch import prepare_preference_data

    rows = [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}] * 4
    train = _write(tmp_path / "train.jsonl", rows[:3] + [{"prompt": "1+1=", "chosen": "2", "rejected": "3" * 30}])
    val = _write(tmp_path / "val.jsonl", rows)
    config = compose(["recipe=dpo", f"data.train_path={train}", f"data.val_path={val}", "trainer.prompts_per_step=4",
                      "rollout.max_response_tokens=8"])
    with pytest.raises(InputError, match=rf"data file {train} \(data.train_path\), column 'rejected', row\(s\) 3: .*"
                                         r"needs 31 tokens with EOS, more than rollout.max_response_tokens=8"):
        prepare_preference_data(config, tmp_path / "run", tokenizer)
    assert not ray.is_initialized()
    # asked to, the run cuts the pair instead (TRL's truncation_mode), and says so
    cut = compose(["recipe=dpo", f"data.train_path={train}", f"data.val_path={val}", "trainer.prompts_per_step=4",
                   "rollout.max_response_tokens=8", "dpo.truncation_mode=keep_start"])
    said = []
    monkeypatch.setattr("hybridflow.data.tokenizer.say_once", said.append)
    pairs = prepare_preference_data(cut, tmp_path / "cut", tokenizer)
    assert len(pairs.train) == 4 and (
        f"hybridflow: dpo.truncation_mode=keep_start: 1 of 4 pairs of data file {train} (data.train_path) are cut to "
        "fit (rollout.max_response_tokens=8, dpo.max_length=None), e.g. row 3") in said
    batch = encode_pairs(pairs.train, tokenizer, 16, 8, truncation_mode="keep_start")
    assert batch["rejected_mask"][3].all() and batch["rejected_ids"][3].tolist() == \
        tokenizer("3" * 30, add_special_tokens=False)["input_ids"][:8]  # the first 8 tokens; EOS cut
    pairs = prepare_preference_data(compose(["recipe=dpo", "trainer.val_prompts=16"]), tmp_path / "synthetic", tokenizer)
    assert len(pairs.val) == 16 and all(row["chosen"] == row["ground_truth"] != row["rejected"] for row in pairs.train)


USER, ASSISTANT = "user", "assistant"


def _m(role, content):
    return {"role": role, "content": content}


def test_trls_preference_formats_become_a_prompt_and_two_responses():
    f = "data file p.jsonl (data.train_path)"
    # explicit prompt, text
    assert preference_row({"prompt": "The sky is", "chosen": " blue.", "rejected": " green.", "id": 7}, 0, f) == {
        "prompt": "The sky is", "chosen": " blue.", "rejected": " green.", "id": 7}
    # implicit prompt, text: the shared start; the space before the difference goes to the responses (TRL's)
    assert preference_row({"chosen": "The sky is blue.", "rejected": "The sky is green."}, 0, f) == {
        "prompt": "The sky is", "chosen": " blue.", "rejected": " green."}
    # conversational, explicit prompt
    row = {"prompt": [_m(USER, "2+2=")], "chosen": [_m(ASSISTANT, "4")], "rejected": [_m(ASSISTANT, "5")]}
    assert preference_row(row, 0, f) == {"prompt": [_m(USER, "2+2=")], "chosen": "4", "rejected": "5"}
    # conversational, implicit prompt: the conversation before the final assistant turn
    row = {"chosen": [_m("system", "be brief"), _m(USER, "2+2="), _m(ASSISTANT, "4")],
           "rejected": [_m("system", "be brief"), _m(USER, "2+2="), _m(ASSISTANT, "5")]}
    assert preference_row(row, 0, f) == {"prompt": [_m("system", "be brief"), _m(USER, "2+2=")], "chosen": "4",
                                         "rejected": "5"}
    # multi-turn: the final assistant turn is trained, the turns before it join the prompt (never cut)
    history = [_m(ASSISTANT, "4"), _m(USER, "and times 3?")]
    row = {"prompt": [_m(USER, "2+2=")], "chosen": history + [_m(ASSISTANT, "12")],
           "rejected": history + [_m(ASSISTANT, "13")]}
    assert preference_row(row, 0, f) == {"prompt": [_m(USER, "2+2="), *history], "chosen": "12", "rejected": "13"}
    row = {"chosen": [_m(USER, "2+2="), *history, _m(ASSISTANT, "12")],
           "rejected": [_m(USER, "2+2="), *history, _m(ASSISTANT, "13")]}
    assert preference_row(row, 0, f)["prompt"] == [_m(USER, "2+2="), *history]
    # a text prompt with single assistant messages (today's mixed rows) still reads
    assert preference_row({"prompt": "2+2=", "chosen": [_m(ASSISTANT, "4")], "rejected": "5"}, 0, f)["chosen"] == "4"


@pytest.mark.parametrize("row, message", [
    ({"chosen": "abc", "rejected": "xyz"}, r"row 4: no 'prompt' column, and 'chosen' and 'rejected' share no start"),
    ({"chosen": "2+2=4", "rejected": "2+2=45"}, r"are one the start of the other"),
    ({"chosen": [_m(USER, "a"), _m(ASSISTANT, "1")], "rejected": [_m(USER, "b"), _m(ASSISTANT, "2")]},
     r"row 4: no 'prompt' column, and the conversations in 'chosen' and 'rejected' differ before their final assistant"),
    ({"chosen": [_m(USER, "a"), _m(ASSISTANT, "1")], "rejected": "2"}, r"one of 'chosen' and 'rejected' is text"),
    ({"prompt": "a", "chosen": [_m(ASSISTANT, "1"), _m(USER, "b"), _m(ASSISTANT, "2")],
      "rejected": [_m(ASSISTANT, "1"), _m(USER, "b"), _m(ASSISTANT, "3")]},
     r"row 4: 'prompt' is text and 'chosen' is a conversation of 3 messages; fix: give 'prompt' as chat messages"),
    ({"prompt": [_m(USER, "a")], "chosen": [_m(USER, "b"), _m(ASSISTANT, "1")], "rejected": [_m(ASSISTANT, "2")]},
     r"row 4: the conversations in 'chosen' and 'rejected' differ before their final assistant turn"),
    ({"prompt": "a", "chosen": [_m(USER, "1")], "rejected": "2"}, r"column 'chosen', row 4: the last message's role"),
    ({"prompt": "a", "chosen": "1"}, r"row 4: no value in column\(s\) \['rejected'\]; fix: give text"),
])
def test_a_row_that_fits_no_format_is_refused_naming_the_file_row_and_fix(row, message):
    with pytest.raises(ValueError, match=r"^data file p.jsonl \(data.train_path\)(, column '\w+')?, row 4: .*fix: "):
        preference_row(row, 4, "data file p.jsonl (data.train_path)")
    with pytest.raises(ValueError, match=message):
        preference_row(row, 4, "data file p.jsonl (data.train_path)")


def test_a_pair_over_its_limits_is_refused_or_cut_as_trl_cuts_by_hand():
    prompt, chosen, rejected = [1, 2, 3, 4], [10, 11, 12, 13, 99], [20, 21, 99]  # 99: EOS
    # within the limits: unchanged in every mode
    for mode in ("error", "keep_start", "keep_end"):
        assert fit_pair(prompt, chosen, rejected, 5, None, mode) == (prompt, chosen, rejected)
    # a response over rollout.max_response_tokens=3: refused, or its first 3 tokens, or its last 3 (EOS kept)
    assert fit_pair(prompt, chosen, rejected, 3, None, "error") is None
    assert fit_pair(prompt, chosen, rejected, 3, None, "keep_start") == (prompt, [10, 11, 12], [20, 21, 99])
    assert fit_pair(prompt, chosen, rejected, 3, None, "keep_end") == (prompt, [12, 13, 99], [20, 21, 99])
    # dpo.max_length=7 per sequence: 4 prompt + 5 chosen = 9 tokens. keep_start keeps the first 7 of
    # each sequence (the responses' first 3); keep_end the last 7: the shared prompt loses its first
    # 9 - 7 = 2 tokens and the responses stay whole
    assert fit_pair(prompt, chosen, rejected, 8, 7, "error") is None
    assert fit_pair(prompt, chosen, rejected, 8, 7, "keep_start") == (prompt, [10, 11, 12], [20, 21, 99])
    assert fit_pair(prompt, chosen, rejected, 8, 7, "keep_end") == ([3, 4], chosen, rejected)
    with pytest.raises(ValueError, match="leave no room for a response in dpo.max_length=4"):
        fit_pair(prompt, chosen, rejected, 8, 4, "keep_start")
    with pytest.raises(ValueError, match="leaves no room for the prompt in dpo.max_length=5"):
        fit_pair(prompt, chosen, rejected, 8, 5, "keep_end")


def test_keep_end_cuts_the_prompts_start_in_the_pair_batch(tokenizer):
    rows = [{"prompt": "11+22+33=", "chosen": "66", "rejected": "67"}]
    whole = encode_pairs(rows, tokenizer, max_prompt_tokens=16, max_response_tokens=4)
    prompt = whole["prompt_ids"][0][whole["prompt_mask"][0]].tolist()
    response = int(whole["chosen_mask"][0].sum())
    limit = len(prompt) + response - 2
    with pytest.raises(ValueError, match=r"row 0: the pair needs more than .* dpo.max_length=\d+ per sequence"):
        encode_pairs(rows, tokenizer, 16, 4, max_length=limit)
    cut = encode_pairs(rows, tokenizer, 16, 4, max_length=limit, truncation_mode="keep_end")
    assert cut["prompt_ids"][0][cut["prompt_mask"][0]].tolist() == prompt[2:]  # left-padded: the last tokens kept
    assert torch.equal(cut["chosen_ids"], whole["chosen_ids"]) and torch.equal(cut["rejected_mask"], whole["rejected_mask"])


def test_an_implicit_prompt_file_passes_the_checks_and_a_bad_row_is_named_before_anything_starts(tmp_path, tokenizer):
    from hybridflow.config import compose
    from hybridflow.run.launch import prepare_preference_data
    from hybridflow.checks.preflight import InputError, check_inputs

    rows = [{"chosen": [_m(USER, f"{a}+1="), _m(ASSISTANT, str(a + 1))],
             "rejected": [_m(USER, f"{a}+1="), _m(ASSISTANT, str(a + 2))]} for a in range(4)]
    train, val = _write(tmp_path / "train.jsonl", rows), _write(tmp_path / "val.jsonl", rows)
    config = compose(["recipe=dpo", f"data.train_path={train}", f"data.val_path={val}", "trainer.prompts_per_step=4",
                      "trainer.val_prompts=4", "data.max_prompt_tokens=32"])
    check_inputs(config)  # no prompt column: the implicit prompt is the conversation before the final turn
    pairs = prepare_preference_data(config, tmp_path / "run", tokenizer)
    assert pairs.train[1] == {"prompt": [_m(USER, "1+1=")], "chosen": "2", "rejected": "3"}
    _write(train, rows[:3] + [{"chosen": "x", "rejected": "y"}])
    with pytest.raises(InputError, match=rf"data file {train} \(data.train_path\), row 3: no 'prompt' column, and "
                                         r"'chosen' and 'rejected' share no start.*fix: add a 'prompt' column"):
        check_inputs(config)
