"""verl's data layout read as is: chat prompts rendered with the chat template, nested ground truth,
and every row's prompt checked to be text or chat messages while the file is read."""

from __future__ import annotations

import pytest

from hybridflow.builders.tiny_model import build_char_tokenizer
from hybridflow.data import read_rows, write_rows
from hybridflow.data.chat import is_chat, prompt_problem, render_prompt
from hybridflow.data.checks import RowChecker
from hybridflow.data.prompts import encode_prompts
from hybridflow.data.rows import count_rows, iter_rows, parquet_columns


def verl_rows(count: int) -> list[dict]:
    return [{"data_source": "arith", "prompt": [{"role": "user", "content": f"{i}+1="}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
             "extra_info": {"split": "train", "index": i}} for i in range(count)]


def test_verl_parquet_is_read_with_the_nested_ground_truth_lifted(tmp_path):
    path = write_rows(verl_rows(3), tmp_path / "train.parquet")
    rows = read_rows(path)
    assert [r["ground_truth"] for r in rows] == ["1", "2", "3"]
    assert rows[1]["reward_model"] == {"style": "rule", "ground_truth": "2"}  # the original column stays
    assert rows[1]["extra_info"] == {"split": "train", "index": 1} and rows[1]["ability"] == "math"
    assert rows[0]["prompt"] == [{"role": "user", "content": "0+1="}]
    assert set(parquet_columns(path)) == {"data_source", "prompt", "ability", "reward_model", "extra_info",
                                          "ground_truth"}


def test_a_top_level_ground_truth_wins_over_the_nested_one(tmp_path):
    path = write_rows([{"prompt": "1+1=", "ground_truth": "2", "reward_model": {"ground_truth": "x"}}],
                      tmp_path / "rows.jsonl")
    assert read_rows(path)[0]["ground_truth"] == "2"


def test_chat_prompt_is_rendered_with_the_tiny_tokenizers_template():
    tok = build_char_tokenizer()
    messages = [{"role": "system", "content": "add"}, {"role": "user", "content": "3+4="}]
    assert render_prompt(messages, tok) == "system: add user: 3+4= assistant: "
    assert render_prompt("3+4=", tok) == "3+4="


def test_encode_prompts_renders_chat_and_keeps_the_messages():
    tok = build_char_tokenizer()
    rows = [{"prompt": [{"role": "user", "content": "1+1="}], "ground_truth": "2"},
            {"prompt": "2+2=", "ground_truth": "4"}]
    batch = encode_prompts(rows, tok, max_prompt_tokens=32)
    assert batch["prompt"] == ["user: 1+1= assistant: ", "2+2="]  # the text the model saw
    assert batch["prompt_messages"] == [[{"role": "user", "content": "1+1="}], None]
    assert batch["prompt_mask"].sum(1).tolist() == [22, 4]  # one token per character
    assert tok.decode(batch["prompt_ids"][0][batch["prompt_mask"][0]]) == "user: 1+1= assistant: "


def test_chat_prompt_without_a_template_is_an_error_naming_the_fix():
    tok = build_char_tokenizer()
    tok.chat_template = None
    with pytest.raises(ValueError, match="validation data: sample 0: .*no chat template.*write the prompts as text"):
        encode_prompts([{"prompt": [{"role": "user", "content": "1="}]}], tok, 32, source="validation data")


@pytest.mark.parametrize("prompt, problem", [
    (42, "int 42"),
    (None, "null"),
    ("  ", "an empty prompt"),
    ([], "no messages"),
    (["hi"], "message 0 is a str"),
    ([{"role": "user"}], "has no text content"),
    ({"role": "user", "content": "x"}, "dict"),
])
def test_prompt_problems_name_the_type_and_value(prompt, problem):
    assert problem in prompt_problem(prompt)


def test_text_and_chat_prompts_have_no_problem():
    assert prompt_problem("1+1=") is None
    assert prompt_problem([{"role": "user", "content": "1+1="}]) is None and is_chat([{"role": "user", "content": ""}])


def test_read_rows_names_the_rows_whose_prompt_is_not_text(tmp_path):
    rows = [{"prompt": "1+1="}] + [{"prompt": i} for i in range(8)]
    path = write_rows(rows, tmp_path / "rows.jsonl")
    with pytest.raises(ValueError) as err:
        read_rows(path)
    message = str(err.value)
    assert f"data file {path}, column 'prompt', row(s) 1, 2, 3, 4, 5 and 3 more: row 1 holds int 0" in message
    assert "fix: write the prompt as text, or as a list of chat messages" in message


def test_row_checker_lists_missing_required_values_once_per_column():
    checker = RowChecker({"ground_truth": "reward function 'f' requires it"})
    for i, row in enumerate([{"prompt": "a", "ground_truth": "1"}, {"prompt": "b", "ground_truth": None},
                             {"prompt": "c"}]):
        checker.check(i, row)
    (message,) = checker.messages("data file x.jsonl")
    assert message == ("data file x.jsonl, column 'ground_truth', row(s) 1, 2: no value (row 1: null), but "
                       "reward function 'f' requires it; fix: give every row a 'ground_truth' value")
    assert checker.messages("x", skip=["ground_truth"]) == []


def test_iter_rows_streams_and_count_rows_stops_early(tmp_path):
    jsonl = write_rows([{"prompt": str(i)} for i in range(50)], tmp_path / "rows.jsonl")
    assert [r["prompt"] for r in iter_rows(jsonl, limit=3)] == ["0", "1", "2"]
    assert count_rows(jsonl, at_least=10) == (10, False)  # stopped reading at 10 rows
    assert count_rows(jsonl) == (50, True)
    parquet = write_rows([{"prompt": str(i)} for i in range(50)], tmp_path / "rows.parquet")
    assert len(list(iter_rows(parquet, limit=7))) == 7
    assert count_rows(parquet, at_least=10) == (50, True)  # from the footer


def test_a_json_line_that_is_not_an_object_is_named(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "a"}\n["prompt", "b"]\n')
    with pytest.raises(ValueError, match=r"rows.jsonl:2: a JSON list, not an object"):
        read_rows(path)
