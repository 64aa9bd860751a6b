"""Built-in reward functions, against hand-worked answers."""

from __future__ import annotations

import pytest

from hybridflow.rewards import REWARD_FUNCTIONS, exact_match, extract_answer


def test_registry_holds_builtins_and_refuses_duplicates():
    assert {"exact_match", "math_answer"} <= set(REWARD_FUNCTIONS.names())
    with pytest.raises(KeyError, match="already registered"):
        REWARD_FUNCTIONS.add("exact_match", lambda response: 0.0)
    with pytest.raises(KeyError, match="registered: digit_match, environment, exact_match, last_number, math_answer, math_verify"):
        REWARD_FUNCTIONS.get("nope")


def test_exact_match_returns_score_and_accuracy():
    assert exact_match(" 82 ", "82") == {"score": 1.0, "accuracy": 1.0}
    assert exact_match("82 and more", "82") == {"score": 0.0, "accuracy": 0.0}


@pytest.mark.parametrize("text, answer", [
    ("She pays 3 + 4 = 7 dollars.", "7"),  # last number
    ("step 12 ... #### 1,234", "1234"),  # after ####, commas stripped
    ("#### $18.50 because 3", "18.50"),  # the first number after ####
    ("a #### 5 b #### -6", "-6"),  # after the last ####
    ("no digits here", None),
    ("The answer is 42.", "42"),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize("response, truth, score", [
    ("so the total is 1,234", "1234", 1.0),
    ("#### 72", "Natalia sold 48/2 = 24 clips... 48+24 = 72\n#### 72", 1.0),  # GSM8K solution as truth
    ("72.0", "72", 1.0),  # numeric, not string, comparison
    ("#### 71 and later 72", "72", 0.0),  # #### wins over the last number
    ("no answer", "72", 0.0),
    ("-3", "3", 0.0),
])
def test_last_number(response, truth, score):
    from hybridflow.rewards.builtin import last_number

    assert last_number(response, truth) == {"score": score, "accuracy": score}


def test_digit_match_gives_partial_credit_aligned_from_the_right():
    from hybridflow.rewards.builtin import digit_match

    assert digit_match("173", "173") == {"score": 1.0, "accuracy": 1.0}
    assert digit_match("170", "173") == {"score": 2 / 3, "accuracy": 0.0}  # "17" matches, "0" != "3"
    assert digit_match("73", "173") == {"score": 2 / 3, "accuracy": 0.0}  # " 73" vs "173"
    assert digit_match("88", "173") == {"score": 0.0, "accuracy": 0.0}
    assert digit_match("", "") == {"score": 0.0, "accuracy": 0.0}
    assert digit_match("1730", "173") == {"score": 0.0, "accuracy": 0.0}  # "1730" vs " 173": shifted


def test_math_answer_and_math_verify_are_one_function_by_value():
    """The presets' `math_answer` is the by-value reward (docs/rewards.md's table,
    tests/unit/test_rewards_math_table.py); `math_verify` names the same function."""
    from hybridflow.rewards.math_verify import score_math

    assert REWARD_FUNCTIONS.get("math_answer") is score_math is REWARD_FUNCTIONS.get("math_verify")
    assert score_math(response=r"\boxed{\frac{1}{2}}", ground_truth="0.5")["score"] == 1.0


def test_a_response_cut_by_the_length_limit_scores_zero_where_the_last_number_regex_scores_one():
    """The last-number regex takes the "12" a cut response was writing for 123."""
    from hybridflow.rewards.builtin import last_number

    cut = "3 x 41 = 12"
    assert last_number(response=cut, ground_truth="12")["score"] == 1.0
    scored = REWARD_FUNCTIONS.get("math_answer")(response=cut, ground_truth="12", finish_reason="length")
    assert scored["score"] == 0.0 and scored["truncated"] == 1.0
    assert REWARD_FUNCTIONS.get("math_answer")(response=cut, ground_truth="12", finish_reason="stop")["score"] == 1.0


def test_math_answer_without_math_verify_is_refused_naming_the_install(monkeypatch):
    import importlib.util

    from hybridflow.rewards.math_verify import require_math_verify

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a))
    with pytest.raises(ImportError, match=r"need the math-verify package.*pip install 'math-verify"):
        require_math_verify()
    from hybridflow.config import compose
    from hybridflow.checks.preflight import check_run

    problems = check_run(compose(["recipe=grpo", "reward.fn=math_answer"]))  # the input checks, before anything starts
    assert any("math-verify package, which is not installed" in p for p in problems), problems
