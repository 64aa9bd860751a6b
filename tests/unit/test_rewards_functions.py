"""User reward functions: loading, argument selection, forms, and every bad case's error."""

from __future__ import annotations

import math
import pickle
import re
import sys
import textwrap
import time

import pytest

from hybridflow.rewards import RewardConfig, RewardFunctionConfig, RewardFunctionError, build_reward

USER_FILE = textwrap.dedent('''
    import asyncio, math, time

    calls = []

    def length_bonus(response, ground_truth):  # takes only what it names
        calls.append(("length_bonus", response, ground_truth))
        return {"score": float(response == ground_truth), "length": len(response)}

    def everything(**kwargs):
        calls.append(("everything", sorted(kwargs)))
        return 0.5

    def scaled(response, scale, offset=0.0):
        return scale * len(response) + offset

    def per_source(response, data_source):
        extra = {"gsm8k": {"gsm8k_only": 1.0}, "math": {"math_only": 2.0}}[data_source]
        return {"score": 1.0, **extra}

    def batched_lengths(response, prompt):
        return [float(len(r) + len(p)) for r, p in zip(response, prompt)]

    def batched_short(response):
        return [1.0] * (len(response) - 1)

    async def async_match(response, ground_truth):
        await asyncio.sleep(0.01)
        return float(response == ground_truth)

    def raises(response):
        if response == "boom":
            raise ZeroDivisionError("cannot score boom")
        return 1.0

    def returns_string(response):
        return "high" if response == "bad" else 1.0

    def returns_nan(response):
        return math.nan if response == "bad" else 1.0

    def returns_dict_without_score(response):
        return {"accuracy": 1.0} if response == "bad" else {"score": 1.0}

    def returns_none(response):
        return None

    def returns_bad_extra(response):
        return {"score": 1.0, "note": "text"}

    def sleeps(response):
        if response == "slow":
            time.sleep(5)
        return 1.0

    async def async_sleeps(response):
        if response == "slow":
            await asyncio.sleep(5)
        return 1.0

    async def async_blocks(response):
        if response == "slow":
            time.sleep(3)  # blocks the event loop: wait_for cannot fire
        return 1.0

    def needs_rubric(response, rubric):
        return 1.0
''')

ROWS = [
    {"prompt": "2+2=", "response": "4", "ground_truth": "4", "data_source": "gsm8k"},
    {"prompt": "3+3=", "response": "7", "ground_truth": "6", "data_source": "math"},
]


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_FILE)
    return path


def composer(user_file, name, **cfg):
    return build_reward(RewardConfig(fn=f"{user_file}:{name}", timeout_s=cfg.pop("timeout_s", 2.0), **cfg))


def user_module(path):
    """The module a `file.py:name` reference loaded (to read what the functions recorded)."""
    return next(m for m in sys.modules.values() if getattr(m, "__file__", None) == str(path))


def rows_with(responses):
    return [{"prompt": f"q{i}", "response": r, "ground_truth": "x"} for i, r in enumerate(responses)]


# ---- loading --------------------------------------------------------------------------------------


def test_function_from_file_path_with_extras(user_file):
    result = composer(user_file, "length_bonus").score(ROWS)
    assert result.scores == [1.0, 0.0]
    assert result.extras["length"] == [1.0, 1.0]
    assert result.metrics["reward/length"] == 1.0
    assert result.metrics["reward/length_bonus/score"] == 0.5


def test_relative_file_path_is_made_absolute(user_file, monkeypatch):
    monkeypatch.chdir(user_file.parent)
    cfg = RewardConfig(fn="my_rewards.py:length_bonus")
    assert cfg.fn == f"{user_file}:length_bonus"


def test_function_from_module_reference(tmp_path, monkeypatch):
    (tmp_path / "user_reward_pkg_for_test.py").write_text("def score(response, **_):\n    return len(response)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    result = build_reward(RewardConfig(fn="user_reward_pkg_for_test:score")).score(ROWS)
    assert result.scores == [1.0, 1.0]


def test_missing_attribute_in_file_is_a_load_error(user_file):
    with pytest.raises(RewardFunctionError, match=r"cannot load reward function reward.fn=.*no_such.*no attribute"):
        composer(user_file, "no_such")


# ---- arguments ------------------------------------------------------------------------------------


def test_only_named_arguments_are_passed(user_file):
    composer(user_file, "length_bonus").score(ROWS)
    assert ("length_bonus", "4", "4") in user_module(user_file).calls  # prompt and data_source were not passed


def test_var_kwargs_gets_prompt_response_and_every_column(user_file):
    composer(user_file, "everything").score(ROWS[:1])
    assert ("everything", ["data_source", "ground_truth", "prompt", "response"]) in user_module(user_file).calls


def test_fixed_kwargs_and_defaults(user_file):
    spec = RewardFunctionConfig(fn=f"{user_file}:scaled", kwargs={"scale": 2.0, "offset": 0.5})
    result = build_reward(RewardConfig(fn=None, functions=[spec])).score(rows_with(["abc"]))
    assert result.scores == [6.5]


def test_fixed_kwarg_that_is_also_a_column_is_an_error(user_file):
    spec = RewardFunctionConfig(fn=f"{user_file}:everything", kwargs={"ground_truth": "fixed"})
    with pytest.raises(RewardFunctionError, match=r"kwargs sets \['ground_truth'\], which the data row also has"):
        build_reward(RewardConfig(fn=None, functions=[spec])).score(ROWS)


def test_unknown_fixed_kwarg_is_an_error_at_build(user_file):
    spec = RewardFunctionConfig(fn=f"{user_file}:scaled", kwargs={"scale": 1.0, "scael": 2.0})
    with pytest.raises(RewardFunctionError, match=r"reward.functions\[0\]\) takes no argument\(s\) \['scael'\]"):
        build_reward(RewardConfig(fn=None, functions=[spec]))


def test_missing_required_argument_names_function_sample_and_available(user_file):
    # Raised even with on_error=fallback: a setup error, not a per-sample failure.
    reward = composer(user_file, "needs_rubric", on_error="fallback")
    with pytest.raises(RewardFunctionError) as info:
        reward.score(ROWS)
    err = info.value
    assert err.kind == "missing_argument" and err.sample == 0
    assert "needs_rubric" in str(err) and "sample 0 (prompt '2+2=')" in str(err)
    assert "needs argument(s) ['rubric']" in str(err)
    assert "available: ['data_source', 'ground_truth', 'prompt', 'response']" in str(err)


def test_extras_that_differ_between_samples_average_over_those_that_have_them(user_file):
    rows = [dict(ROWS[0]), dict(ROWS[1]), dict(ROWS[0])]
    result = composer(user_file, "per_source").score(rows)
    assert result.extras["gsm8k_only"][0] == 1.0 and math.isnan(result.extras["gsm8k_only"][1])
    assert result.metrics["reward/gsm8k_only"] == 1.0
    assert result.metrics["reward/math_only"] == 2.0


# ---- forms ----------------------------------------------------------------------------------------


def test_batched_function(user_file):
    spec = RewardFunctionConfig(fn=f"{user_file}:batched_lengths", batched=True)
    result = build_reward(RewardConfig(fn=None, functions=[spec])).score(ROWS)
    assert result.scores == [5.0, 5.0]


def test_batched_marker_on_the_function(tmp_path):
    path = tmp_path / "marked.py"
    path.write_text("def f(response):\n    return [len(r) for r in response]\nf.reward_batched = True\n")
    assert build_reward(RewardConfig(fn=f"{path}:f")).score(rows_with(["ab", "abc"])).scores == [2.0, 3.0]


def test_batched_wrong_length_is_an_error(user_file):
    spec = RewardFunctionConfig(fn=f"{user_file}:batched_short", batched=True)
    with pytest.raises(RewardFunctionError, match=r"must return a list of 2 scores.*\(length 1\)") as info:
        build_reward(RewardConfig(fn=None, functions=[spec])).score(ROWS)
    assert info.value.kind == "bad_value"


def test_async_function(user_file):
    result = composer(user_file, "async_match").score(ROWS * 8)
    assert result.scores == [1.0, 0.0] * 8


# ---- bad functions: each gives its own error ------------------------------------------------------


@pytest.mark.parametrize("name, bad, kind, cause", [
    ("raises", "boom", "raised", r"raised ZeroDivisionError: cannot score boom"),
    ("returns_string", "bad", "bad_value", r"returned 'high': a str; a reward function returns a finite number"),
    ("returns_nan", "bad", "bad_value", r"returned nan: not a finite number"),
    ("returns_dict_without_score", "bad", "bad_value", r"returned \{'accuracy': 1.0\}: a dict without 'score'"),
    ("returns_none", "bad", "bad_value", r"returned None: a NoneType"),
    ("returns_bad_extra", "bad", "bad_value", r"its extra 'note' is 'text', not a finite number"),
])
def test_bad_function_error_names_function_sample_and_cause(user_file, name, bad, kind, cause):
    reward = composer(user_file, name)
    with pytest.raises(RewardFunctionError) as info:
        reward.score(rows_with(["fine", bad]), first_index=10)
    err = info.value
    expected_sample = 10 if name in ("returns_none", "returns_bad_extra") else 11
    assert (err.kind, err.sample) == (kind, expected_sample)
    assert f"{user_file}:{name}" in str(err)
    assert f"sample {expected_sample} (prompt 'q{expected_sample - 10}')" in str(err)
    assert err.function == f"{user_file}:{name}"
    assert re.search(cause, str(err)), str(err)
    copy = pickle.loads(pickle.dumps(err))  # errors cross Ray processes
    assert (str(copy), copy.kind, copy.sample, copy.function) == (str(err), err.kind, err.sample, err.function)


@pytest.mark.parametrize("name", ["sleeps", "async_sleeps", "async_blocks"])
def test_timeout_returns_promptly_with_its_error(user_file, name):
    reward = composer(user_file, name, timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(RewardFunctionError) as info:
        reward.score(rows_with(["fine", "slow", "fine"]))
    assert time.monotonic() - start < 3.0
    err = info.value
    assert (err.kind, err.sample) == ("timeout", 1)
    assert f"{name}' (reward.fn) on sample 1 (prompt 'q1'): timed out after 0.5 s" in str(err)
    if name == "async_blocks":
        assert "it blocked the event loop" in str(err)


def test_fallback_scores_and_counts_each_cause(user_file, tmp_path):
    functions = [RewardFunctionConfig(fn=f"{user_file}:raises"), RewardFunctionConfig(fn=f"{user_file}:sleeps"),
                 RewardFunctionConfig(fn=f"{user_file}:returns_nan", weight=2.0)]
    cfg = RewardConfig(fn=None, functions=functions, on_error="fallback", fallback_score=-1.0, timeout_s=0.5)
    start = time.monotonic()
    result = build_reward(cfg).score(rows_with(["boom", "slow", "bad", "fine"]))
    assert time.monotonic() - start < 3.0
    # Per sample: raises + sleeps + 2 * returns_nan, a failing one scoring -1.
    assert result.scores == [-1 + 1 + 2, 1 - 1 + 2, 1 + 1 - 2, 1 + 1 + 2]
    assert result.extras["raises/score"] == [-1.0, 1.0, 1.0, 1.0]
    assert result.fallback == [True, True, True, False]
    assert result.metrics["reward/fallback_count"] == 3
    assert result.metrics["reward/fallback/raised"] == 1
    assert result.metrics["reward/fallback/timeout"] == 1
    assert result.metrics["reward/fallback/bad_value"] == 1


def test_fallback_in_batched_call_covers_the_whole_batch(user_file):
    spec = RewardFunctionConfig(fn=f"{user_file}:batched_short", batched=True)
    cfg = RewardConfig(fn=None, functions=[spec], on_error="fallback", fallback_score=0.25)
    result = build_reward(cfg).score(ROWS)
    assert result.scores == [0.25, 0.25] and result.fallback == [True, True]
    assert result.metrics["reward/fallback/bad_value"] == 2


def test_blocked_event_loop_falls_back_promptly(user_file):
    reward = composer(user_file, "async_blocks", timeout_s=0.5, on_error="fallback", fallback_score=-2.0)
    start = time.monotonic()
    result = reward.score(rows_with(["fine", "slow", "fine"]))
    assert time.monotonic() - start < 3.0
    assert result.scores[1] == -2.0 and result.fallback[1]
    assert result.metrics["reward/fallback/timeout"] >= 1


@pytest.mark.parametrize("is_async", [False, True])
def test_concurrency_is_bounded(tmp_path, is_async):
    path = tmp_path / "track.py"
    path.write_text(textwrap.dedent(f'''
        import asyncio, threading, time
        lock, state = threading.Lock(), {{"now": 0, "max": 0}}

        {"async " if is_async else ""}def f(response):
            with lock:
                state["now"] += 1
                state["max"] = max(state["max"], state["now"])
            {"await asyncio.sleep(0.3)" if is_async else "time.sleep(0.3)"}
            with lock:
                state["now"] -= 1
            return 1.0
    '''))
    reward = build_reward(RewardConfig(fn=f"{path}:f", max_concurrency=3))
    start = time.monotonic()
    assert reward.score(rows_with(["a"] * 9)).scores == [1.0] * 9
    assert time.monotonic() - start < 1.8  # 3 rounds of 0.3 s; 9 in a row take 2.7 s
    assert user_module(path).state["max"] == 3
