"""verl's and TRL's reward functions plug in unchanged: verl's `compute_score(data_source,
solution_str, ground_truth, extra_info)` per sample, TRL's batched `f(prompts, completions, **kwargs)`."""

from __future__ import annotations

import textwrap

import pytest

from hybridflow.rewards import RewardConfig, RewardFunctionConfig, build_reward

VERL_FILE = textwrap.dedent('''
    def compute_score(data_source, solution_str, ground_truth, extra_info):
        assert data_source == "arith" and isinstance(extra_info, dict)
        return 1.0 if solution_str.strip() == ground_truth else 0.0

    def compute_score_dict(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": float(solution_str == ground_truth), "acc": float(solution_str == ground_truth)}
''')
TRL_FILE = textwrap.dedent('''
    def reward_len(completions, prompts, ground_truth, **kwargs):
        assert isinstance(completions, list) and isinstance(prompts, list)
        return [float(c == g) + 0.1 * len(p) for c, p, g in zip(completions, prompts, ground_truth)]
''')


def rows() -> list[dict]:
    return [{"prompt": "user: 1+1= assistant: ", "response": " 2", "ground_truth": "2", "data_source": "arith",
             "extra_info": {"index": 0}, "reward_model": {"ground_truth": "2"}},
            {"prompt": "x", "response": "5", "ground_truth": "4", "data_source": "arith", "extra_info": {"index": 1},
             "reward_model": {"ground_truth": "4"}}]


def score(tmp_path, source: str, name: str, **spec) -> list[float]:
    path = tmp_path / "fns.py"
    path.write_text(source)
    config = RewardConfig(fn=None, functions=[RewardFunctionConfig(fn=f"{path}:{name}", **spec)])
    return build_reward(config).score(rows()).scores


def test_verl_compute_score_gets_the_response_as_solution_str(tmp_path):
    assert score(tmp_path, VERL_FILE, "compute_score") == [1.0, 0.0]


def test_verl_compute_score_returning_a_dict(tmp_path):
    assert score(tmp_path, VERL_FILE, "compute_score_dict") == [0.0, 0.0]  # " 2" != "2": no stripping here


def test_trl_batched_function_gets_prompts_and_completions_as_lists(tmp_path):
    # sample 0: " 2" != "2" -> 0 + 0.1 * 22 characters of prompt = 2.2 ; sample 1: "5" != "4" -> 0.1 * 1 = 0.1
    assert score(tmp_path, TRL_FILE, "reward_len", batched=True) == pytest.approx([2.2, 0.1])


def test_a_data_column_named_like_an_alias_wins(tmp_path):
    source = "def f(solution_str):\n    return float(len(solution_str))\n"
    path = tmp_path / "fns.py"
    path.write_text(source)
    composer = build_reward(RewardConfig(fn=f"{path}:f"))
    assert composer.score([{"prompt": "p", "response": "abc", "solution_str": "abcdefg"}]).scores == [7.0]


def test_data_arguments_leave_out_what_the_sample_and_kwargs_fill(tmp_path):
    path = tmp_path / "fns.py"
    path.write_text("def f(solution_str, prompts, ground_truth, extra_info, scale, bonus=0.0):\n    return 0.0\n")
    fn = build_reward(RewardConfig(fn=None, functions=[
        RewardFunctionConfig(fn=f"{path}:f", kwargs={"scale": 2.0})])).functions[0]
    assert fn.data_arguments() == ["ground_truth", "extra_info"]
    assert fn.clashing_columns(["prompt", "scale"]) == ["scale"]
