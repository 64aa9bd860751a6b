"""The input checks run before anything starts (hybridflow/checks/preflight.py), in-process: what each
mode of data.validate_rows reads, and the problems each bad input gives. The same bad inputs
through the `hybridflow` command are in tests/e2e/test_preflight.py."""

from __future__ import annotations

import json
import shutil

import pytest

from hybridflow.config.schema import DataConfig, HybridFlowConfig, ModelConfig, RecipeConfig, TrainerConfig
from hybridflow.data import write_rows
from hybridflow.checks.preflight import SAMPLE_ROWS, InputError, check_inputs, check_model_dir, check_run
from hybridflow.rewards import RewardConfig

VERL_SCORE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info):
    return float(solution_str.strip() == ground_truth)
'''


def config(train, val=None, recipe="grpo", validate_rows="sample", model=None, reward_fn="exact_match",
           prompts_per_step=4, val_prompts=4) -> HybridFlowConfig:
    return HybridFlowConfig(
        recipe=RecipeConfig(name=recipe), model=ModelConfig(path=model and str(model)),
        data=DataConfig(train_path=str(train), val_path=str(val or train), validate_rows=validate_rows),
        reward=RewardConfig(fn=reward_fn), trainer=TrainerConfig(prompts_per_step=prompts_per_step,
                                                                 val_prompts=val_prompts))


def rows(count: int) -> list[dict]:
    return [{"prompt": f"{i}+1=", "ground_truth": str(i + 1), "data_source": "a"} for i in range(count)]


def test_good_inputs_pass(tmp_path):
    assert check_run(config(write_rows(rows(8), tmp_path / "train.parquet"))) == []


def test_verl_layout_and_compute_score_pass(tmp_path):
    verl = [{"data_source": "arith", "prompt": [{"role": "user", "content": f"{i}+1="}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(i + 1)}, "extra_info": {"index": i}}
            for i in range(8)]
    score = tmp_path / "score.py"
    score.write_text(VERL_SCORE)
    assert check_run(config(write_rows(verl, tmp_path / "verl.parquet"), reward_fn=f"{score}:compute_score")) == []


@pytest.mark.parametrize("mode, caught", [("sample", False), ("all", True), ("none", False)])
def test_validate_rows_modes_read_what_they_say(tmp_path, capsys, mode, caught):
    data = rows(SAMPLE_ROWS + 50)
    data[SAMPLE_ROWS + 10]["prompt"] = {"text": "late bad row"}  # past the sample
    data[3]["ground_truth"] = None  # inside the sample
    path = write_rows(data, tmp_path / "train.jsonl")
    problems = check_run(config(path, validate_rows=mode))
    assert any(f"row(s) {SAMPLE_ROWS + 10}: row {SAMPLE_ROWS + 10} holds dict" in p for p in problems) == caught
    assert any("column 'ground_truth', row(s) 3: no value" in p for p in problems) == (mode != "none")
    said = capsys.readouterr().out
    assert (f"checked the first {SAMPLE_ROWS} rows (of more) of {path}" in said) == (mode == "sample")


def test_row_counts_against_one_step_and_the_validation_size(tmp_path):
    train, val = write_rows(rows(8), tmp_path / "train.parquet"), write_rows(rows(3), tmp_path / "val.jsonl")
    problems = check_run(config(train, val, prompts_per_step=16, val_prompts=5))
    assert problems == [
        f"data file {train} (data.train_path) has 8 rows, fewer than trainer.prompts_per_step=16; fix: lower "
        "trainer.prompts_per_step to at most 8, or add rows",
        f"data file {val} (data.val_path) has 3 rows, fewer than trainer.val_prompts=5; fix: lower "
        "trainer.val_prompts to at most 3, or add rows"]
    assert check_run(config(train, val, recipe="demo", prompts_per_step=16, val_prompts=5)) == []  # no steps


def test_synthetic_task_sizes_are_checked_from_the_config():
    cfg = HybridFlowConfig(recipe=RecipeConfig(name="sft"), trainer=TrainerConfig(val_prompts=300))
    assert check_run(cfg) == ["config trainer.val_prompts=300 is more than data.synthetic.val_rows=200; lower "
                              "trainer.val_prompts to at most 200 or raise data.synthetic.val_rows"]


def test_reward_argument_the_data_lacks(tmp_path):
    score = tmp_path / "score.py"
    score.write_text("def score(response, answer):\n    return 0.0\n")
    train = write_rows(rows(8), tmp_path / "train.parquet")
    (problem,) = check_run(config(train, reward_fn=f"{score}:score"))[:1]
    assert problem.startswith(f"data file {train} (data.train_path): no column 'answer' (columns: ['prompt', "
                              f"'ground_truth', 'data_source']), but reward function '{score}:score' (reward.fn) "
                              "requires the argument 'answer'; fix: add a 'answer' column")


def test_reward_function_that_cannot_load_or_be_called_by_name(tmp_path):
    broken, positional = tmp_path / "broken.py", tmp_path / "positional.py"
    broken.write_text("def score(response:\n")
    positional.write_text("def score(response, /):\n    return 0.0\n")
    train = write_rows(rows(8), tmp_path / "train.parquet")
    (load,) = check_run(config(train, reward_fn=f"{broken}:score"))
    assert f"cannot load reward function reward.fn='{broken}:score': SyntaxError" in load
    (signature,) = check_run(config(train, reward_fn=f"{positional}:score"))
    assert "has positional-only parameters ['response']" in signature


def test_chat_prompts_need_a_chat_template(tmp_path, tiny_model_dir):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").unlink()
    chat = [{"prompt": [{"role": "user", "content": "1+1="}], "ground_truth": "2"}] * 4
    train, val = write_rows(chat, tmp_path / "chat.parquet"), write_rows(rows(4), tmp_path / "val.parquet")
    (problem,) = check_run(config(train, val, model=model))
    assert problem.startswith(f"data file {train} (data.train_path), column 'prompt', row 0: a list of chat messages, "
                              f"but the tokenizer in model.path='{model}' has no chat template")
    assert check_run(config(train, model=tiny_model_dir)) == []


def test_model_directory_problems(tmp_path, tiny_model_dir):
    assert check_model_dir(str(tiny_model_dir), "model.path") == []
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "model.safetensors").write_bytes(b"\x10\x00")
    (model / "tokenizer.json").unlink()
    (model / "config.json").write_text("{not json")
    problems = check_model_dir(str(model), "model.path")
    assert [p.split(":")[0] for p in problems] == [f"{model}/config.json (model.path)",
                                                   f"{model}/model.safetensors (model.path)", f"model.path='{model}'"]
    assert "not valid JSON" in problems[0] and "truncated" in problems[1] and "no tokenizer files" in problems[2]


def test_sharded_weights_whose_index_names_a_missing_file(tmp_path, tiny_model_dir):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    (problem,) = check_model_dir(str(model), "model.path")
    assert "lists weight file(s) ['model-00002-of-00002.safetensors'] that are not in" in problem


def test_check_inputs_lists_every_problem_at_once(tmp_path):
    train = write_rows([{"prompt": 7}] * 2, tmp_path / "train.jsonl")
    val = write_rows(rows(4), tmp_path / "val.jsonl")
    with pytest.raises(InputError) as err:
        check_inputs(config(train, val, model=tmp_path / "nowhere"))
    message = str(err.value)
    assert message.startswith("4 problem(s) with the run's inputs, found before anything started:")
    for part in (f"model.path='{tmp_path / 'nowhere'}': no such directory", "has 2 rows, fewer than",
                 "column 'prompt', row(s) 0, 1: row 0 holds int 7", "no column 'ground_truth'"):
        assert part in message


def test_prompts_longer_than_max_prompt_tokens_with_the_models_tokenizer(tmp_path, tiny_model_dir):
    long = rows(8)
    long[2]["prompt"] = long[6]["prompt"] = "1+" * 20 + "1="  # 42 characters: 42 tokens of the tiny tokenizer
    # "user: 1+1= assistant: ": 19 tokens as the model directory's tokenizer loads (AutoTokenizer gives
    # Qwen2Tokenizer, which drops the spaces), the tokenizer the recipe encodes with
    chat = [{"prompt": [{"role": "user", "content": "1+1="}], "ground_truth": "2"}] * 4
    train, val = write_rows(long, tmp_path / "train.parquet"), write_rows(chat, tmp_path / "val.parquet")
    cfg = config(train, val, model=tiny_model_dir)
    cfg.data.max_prompt_tokens = 18
    assert check_run(cfg) == [
        f"data file {train} (data.train_path), column 'prompt', row(s) 2, 6: row 2 has 42 tokens, more than "
        "data.max_prompt_tokens=18; fix: raise data.max_prompt_tokens to 42, shorten the prompts, or set "
        "data.prompt_truncation=left|filter",
        f"data file {val} (data.val_path), column 'prompt', row(s) 0, 1, 2, 3: row 0 has 19 tokens, more than "
        "data.max_prompt_tokens=18; fix: raise data.max_prompt_tokens to 19, shorten the prompts, or set "
        "data.prompt_truncation=left|filter"]
    cfg.data.max_prompt_tokens = 42
    assert check_run(cfg) == []
    cfg.data.max_prompt_tokens = 18
    for truncation in ("left", "filter"):  # over-long prompts are then cut or left out, not refused
        cfg.data.prompt_truncation = truncation
        assert check_run(cfg) == []
