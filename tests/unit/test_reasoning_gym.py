"""reasoning-gym tasks: row files from its generators, scored by its own scorers through the reward
role (hybridflow/data/reasoning_gym.py, hybridflow/rewards/reasoning_gym.py), with the real package."""

from __future__ import annotations

import sys

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.controller import WorkerContext
from hybridflow.data.reasoning_gym import main, make_reasoning_gym_split
from hybridflow.data.rows import read_rows
from hybridflow.checks.preflight import check_data_file
from hybridflow.rewards import RewardConfig, RewardFunctionConfig, RewardFunctionError, build_reward
from hybridflow.rewards.composer import build_reward_function
from hybridflow.rewards.reasoning_gym import extract_tagged_answer
from workers.reward import RewardWorker


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out = tmp_path_factory.mktemp("rg")
    assert main(["basic_arithmetic", str(out), "--train-rows", "40", "--val-rows", "10", "--seed", "3"]) == 0
    return out / "train.jsonl", out / "val.jsonl"


def score_through_the_reward_role(rows: list[dict], responses: list[str], reward: RewardConfig) -> Batch:
    """What the recipe does with a step's samples: the rows' columns and responses, scored by the
    reward worker (in-process here)."""
    worker = RewardWorker(WorkerContext(), reward)
    worker.start()
    objects = {key: [row[key] for row in rows] for key in rows[0]}
    objects.update(prompt=[row["prompt"][-1]["content"] for row in rows], response=responses)
    return worker.compute_rewards(Batch({"response_ids": torch.zeros(len(rows), 1, dtype=torch.long)}, objects))


def test_rows_have_the_columns_and_train_and_val_are_disjoint(files):
    train, val = (read_rows(path) for path in files)
    assert len(train) == 40 and len(val) == 10
    for row in train + val:
        system, user = row["prompt"]
        assert system["role"] == "system" and "<answer>" in system["content"]  # asks for the tags the reward reads
        assert user == {"role": "user", "content": row["reasoning_gym"]["entry"]["question"]}
        assert row["ground_truth"] == row["reasoning_gym"]["entry"]["answer"]
        assert row["data_source"] == "reasoning_gym/basic_arithmetic"
        assert row["reasoning_gym"]["dataset"] == "basic_arithmetic"
        assert row["reasoning_gym"]["config"] == {"seed": 3, "size": 200}  # 2 * 50 rows + 100 draws of room
    questions = [[row["prompt"][-1]["content"] for row in rows] for rows in (train, val)]
    assert len(set(questions[0])) == 40 and len(set(questions[1])) == 10
    assert not set(questions[0]) & set(questions[1])


def test_own_answer_scores_one_and_a_wrong_one_less(files):
    rows = read_rows(files[1])[:3]
    right = [f"Adding up... <answer>{row['ground_truth']}</answer>" for row in rows]
    wrong = [f"<answer>{int(row['ground_truth']) + 1}</answer>" for row in rows]
    untagged = [row["ground_truth"] for row in rows]  # the right number, but not in <answer> tags
    out = score_through_the_reward_role(rows * 3, right + wrong + untagged, RewardConfig(fn="reasoning_gym"))
    assert out["sequence_rewards"].tolist() == [1.0] * 3 + [0.0] * 6
    assert out["reward_extra/accuracy"].tolist() == [1.0] * 3 + [0.0] * 6
    assert out["reward_extra/answer_found"].tolist() == [1.0] * 6 + [0.0] * 3
    assert not out["reward_fallback"].any()


def test_answer_tag_null_scores_the_whole_response(files):
    rows = read_rows(files[1])[:2]
    whole = RewardConfig(fn=None, functions=[RewardFunctionConfig(fn="reasoning_gym", kwargs={"answer_tag": None})])
    out = score_through_the_reward_role(rows, [f" {rows[0]['ground_truth']}\n", "7 and more"], whole)
    assert out["sequence_rewards"].tolist()[0] == 1.0 and out["sequence_rewards"].tolist()[1] < 1.0


def test_entries_are_generated_again_so_tuple_comparing_scorers_score_their_answer_one():
    # arc_agi compares the parsed board with the entry's tuples: against a JSON copy it gives 0.05
    train, _ = make_reasoning_gym_split("arc_agi", 1, 1, seed=0)
    out = score_through_the_reward_role(train, [f"<answer>{train[0]['ground_truth']}</answer>"],
                                        RewardConfig(fn="reasoning_gym"))
    assert out["sequence_rewards"].tolist() == [1.0]


def test_a_scorer_that_raises_on_a_malformed_answer_scores_zero_and_is_counted():
    train, _ = make_reasoning_gym_split("prime_factorization", 2, 1, seed=0)
    out = score_through_the_reward_role(train, ["<answer>two times x</answer>", f"<answer>{train[1]['ground_truth']}</answer>"],
                                        RewardConfig(fn="reasoning_gym"))
    assert out["sequence_rewards"].tolist() == [0.0, 1.0]
    assert out["reward_extra/scorer_raised"].tolist() == [1.0, 0.0]


def test_rows_of_another_reasoning_gym_version_are_refused(files):
    row = read_rows(files[1])[0]
    row["reasoning_gym"]["entry"]["question"] = "a question this version does not generate"
    with pytest.raises(RewardFunctionError, match="written by another reasoning-gym version"):
        build_reward(RewardConfig(fn="reasoning_gym")).score([dict(row, prompt="p", response="<answer>1</answer>")])


def test_an_unknown_dataset_lists_the_valid_ones(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"unknown reasoning-gym dataset 'basic_arithmetc' \(did you mean "
                                         r"basic_arithmetic.*\); reasoning-gym 0.1.25 has: ab, acre, .*spell_backward"):
        make_reasoning_gym_split("basic_arithmetc", 4, 2, seed=0)
    assert main(["basic_arithmetc", str(tmp_path)]) == 2
    assert "did you mean basic_arithmetic" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"has no config field\(s\) \['max_term'\]; its fields: \['min_terms', "):
        make_reasoning_gym_split("basic_arithmetic", 4, 2, seed=0, config={"max_term": 3})


def test_the_input_checks_need_the_column(files, tmp_path):
    fn = build_reward_function(RewardFunctionConfig(fn="reasoning_gym"), "reward.fn")
    needed = {name: "reward.fn needs it" for name in fn.data_arguments()}
    assert needed == {"reasoning_gym": "reward.fn needs it"}
    assert check_data_file(str(files[0]), "data.train_path", needed, None, "sample", [fn]).problems == []
    bare = tmp_path / "bare.jsonl"
    bare.write_text('{"prompt": "1+1=", "ground_truth": "2"}\n')
    problems = check_data_file(str(bare), "data.train_path", needed, None, "sample", [fn]).problems
    assert len(problems) == 1 and "no column 'reasoning_gym'" in problems[0]


def test_a_missing_package_names_the_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` now fails
    with pytest.raises(RewardFunctionError, match=r"ImportError: .*pip install -e '\.\[reasoning\]'") as err:
        build_reward_function(RewardFunctionConfig(fn="reasoning_gym"), "reward.fn")  # what the input checks call
    assert err.value.kind == "load" and isinstance(err.value.__cause__, ImportError)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[reasoning\]'"):
        make_reasoning_gym_split("basic_arithmetic", 4, 2, seed=0)


def test_extract_tagged_answer():
    assert extract_tagged_answer("<answer>1</answer> then <answer>\n 42 \n</answer>") == "42"  # the last, stripped
    assert extract_tagged_answer("<answer>unclosed") is None
    assert extract_tagged_answer("<final>x</final>", tag="final") == "x"
