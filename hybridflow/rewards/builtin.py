"""Built-in rule-based reward functions, registered by name in `REWARD_FUNCTIONS`.

Every entry follows the custom-function contract (see docs/rewards.md): keyword arguments
taken by name from the sample (`prompt`, `response`, data columns), a float or a dict with
`score` returned. `reasoning_gym` lives in its own module (it needs an optional package).
"""

from __future__ import annotations

import math
import re

from hybridflow.registry import Registry
from hybridflow.rewards.math_verify import score_math
from hybridflow.rewards.reasoning_gym import score_reasoning_gym

REWARD_FUNCTIONS: Registry = Registry(
    "reward function",
    signature="fn(*, response, prompt, <data columns such as ground_truth>, **_) -> float | {'score': float, ...}",
)

# A number as people write it: optional sign, thousands separators, decimals ("-1,234.5").
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_FINAL_MARK = "####"  # GSM8K writes the final answer after '####'


def extract_answer(text: str) -> str | None:
    """The final numeric answer of a text, commas stripped; None if there is none.

    The first number after the last '####' when the text has one (GSM8K solutions), else the
    last number in the text ("so 3 + 4 = 7" -> "7").
    """
    text = str(text)
    if _FINAL_MARK in text:
        numbers = _NUMBER.findall(text.rsplit(_FINAL_MARK, 1)[1])
        found = numbers[0] if numbers else None
    else:
        numbers = _NUMBER.findall(text)
        found = numbers[-1] if numbers else None
    if found is None:
        return None
    found = found.replace(",", "").rstrip(".")
    return found or None


def _same_number(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return False
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-9)
    except ValueError:
        return False


@REWARD_FUNCTIONS.register("exact_match")
def exact_match(response: str, ground_truth: str, **_) -> dict:
    """1.0 when the response, stripped of surrounding space, equals the ground truth, else 0.0."""
    s = 1.0 if str(response).strip() == str(ground_truth).strip() else 0.0
    return {"score": s, "accuracy": s}


@REWARD_FUNCTIONS.register("last_number")
def last_number(response: str, ground_truth: str, **_) -> dict:
    """1.0 when the response's last number equals the ground truth's numerically: a regex, no parser.

    Both sides go through `extract_answer`, so a ground truth may be a bare number ("1,234")
    or a full GSM8K solution ending in "#### 1234". Blind to fractions, boxes and cut responses (a
    response cut while writing "123" scores for 12): `math_answer` compares by value instead.
    """
    s = 1.0 if _same_number(extract_answer(response), extract_answer(ground_truth)) else 0.0
    return {"score": s, "accuracy": s}


@REWARD_FUNCTIONS.register("digit_match")
def digit_match(response: str, ground_truth: str, **_) -> dict:
    """Partial credit: the share of characters that match the ground truth, aligned from the right
    (units under units), over the longer of the two; 1.0 exactly when the answer is exact.

    A denser signal than exact match for arithmetic ("170" for 173 scores 2/3), while
    `accuracy` stays exact match. ("88", "173") -> aligned "_88" vs "173": 0 of 3 match -> 0.0.
    """
    got, want = str(response).strip(), str(ground_truth).strip()
    width = max(len(got), len(want))
    if width == 0:
        return {"score": 0.0, "accuracy": 0.0}
    matches = sum(a == b for a, b in zip(got.rjust(width), want.rjust(width)))
    exact = 1.0 if got == want else 0.0
    return {"score": matches / width, "accuracy": exact}


@REWARD_FUNCTIONS.register("environment")
def environment(env_rewards, agent_failure: str = "", **_) -> dict:
    """A hub environment's own rubric (rollout.environment, hybridflow/agents/hubs): its weighted total
    as the score and each of its reward functions' scores as an extra (the metric `reward/<name>`).
    A sample whose episode failed has no rubric score: it raises, and reward.on_error decides (raise
    stops the run naming the failure; fallback scores it reward.fallback_score, counted)."""
    if env_rewards is None:
        raise ValueError(f"the environment's episode failed, so its rubric gave no score: {agent_failure}")
    return dict(env_rewards)


REWARD_FUNCTIONS.add("reasoning_gym", score_reasoning_gym)
math_answer = score_math  # the math reward by value (hybridflow/rewards/math_verify.py), the presets' default
REWARD_FUNCTIONS.add("math_answer", score_math)
REWARD_FUNCTIONS.add("math_verify", score_math)  # the same function under the name of its parser
