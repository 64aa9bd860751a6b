"""The `math_verify` reward: the response's final answer checked against the ground truth by
Hugging Face's math-verify (an optional extra: `pip install -e '.[math]'`).

math-verify parses both sides into sympy objects, so `\\boxed{\\frac{1}{2}}`, `0.5`, `1/2` and `50\\%`
agree, LaTeX and plain expressions alike; the regex of `math_answer` (the last number) cannot see a
fraction or a boxed expression. It is used here rather than a hand-written parser because answer
formats are where hand-written graders fail silently (a truncated "12" matching a "123" that was
being written, a fraction read as its numerator).

- A response cut at `rollout.max_response_tokens` (`finish_reason` "length", set by the rollout for
  every sample) scores 0 whatever its last number: it never gave an answer.
- A GSM8K ground truth ("... #### 1234") is read after its last `####`; so is a response that uses it.
  A bare ground truth (MATH's `\\sqrt{8}`) is read as LaTeX.
- The response's answer is its last `\\boxed{}` when it has one, else its last expression.

Not the default for `math_answer`: a reward that changes with what is installed would score the same
run differently on two machines, so the choice is the config's (`reward.fn=math_verify`).
"""

from __future__ import annotations

import importlib.util

INSTALL = "pip install -e '.[math]' (or pip install 'math-verify[antlr4_9_3]')"
_FINAL_MARK = "####"


def require_math_verify() -> None:
    """ImportError naming the fix when math-verify is not installed; found without importing it, when
    the reward function is loaded (the input checks run it before anything starts)."""
    if importlib.util.find_spec("math_verify") is None:
        raise ImportError(f"reward.fn=math_verify needs the math-verify package, which is not installed; fix: {INSTALL}")


def _after_final_mark(text: str) -> str:
    return text.rsplit(_FINAL_MARK, 1)[1] if _FINAL_MARK in text else text


def _parsed(text: str):
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    return parse(text, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()])


def score_math_verify(response: str, ground_truth: str, finish_reason: str | None = None, **_) -> dict:
    """1.0 when math-verify finds the response's final answer equal to the ground truth; 0.0 for a
    response cut by the length limit. Also reported: `answer_found`, `truncated`."""
    from math_verify import verify

    if finish_reason == "length":
        return {"score": 0.0, "accuracy": 0.0, "answer_found": 0.0, "truncated": 1.0}
    truth = _after_final_mark(str(ground_truth)).strip()
    gold = _parsed(truth if "$" in truth or "\\boxed" in truth else f"${truth}$")  # a bare answer is LaTeX too
    answer = _parsed(_after_final_mark(str(response)))
    score = float(bool(gold) and bool(answer) and verify(gold, answer))
    return {"score": score, "accuracy": score, "answer_found": float(bool(answer)), "truncated": 0.0}


score_math_verify.reward_requires = require_math_verify  # checked when the function is loaded
