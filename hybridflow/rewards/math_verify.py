"""The math reward by value (`math_answer`, also registered as `math_verify`): the response's final
answer checked against the ground truth with Hugging Face's math-verify, a dependency of HybridFlow.

math-verify parses both sides into sympy objects, so `\\boxed{\\frac{1}{2}}`, `0.5`, `1/2` agree, LaTeX
and plain expressions alike. It is used rather than a hand-written parser because answer formats are
where hand-written graders fail silently (a truncated "12" matching a "123" that was being written, a
fraction read as its numerator). What this module adds around it, each a case math-verify alone
scores wrong (docs/rewards.md has the table, written by tests/unit/test_rewards_math_table.py):

- the response's answer is its **last** `\\boxed{}` alone (math-verify reads `First \\boxed{3}, finally
  \\boxed{4}` as the set {3, 4}); without one, the number right after its last `####` (GSM8K's form);
  else the whole response, where math-verify takes the last expression;
- a percent (`50\\%`, `50%`) equals its number or its hundredth (0.5 and 50 both): a box's content or a
  ground truth that is one, or prose whose last number a `%` follows ("That is 50%.", "12.5% off"); the
  percent is read here, not by math-verify, which on prose takes the words before the `%` into it;
- a thousands separator (`1,234`) is a separator, not a tuple;
- a response cut at `rollout.max_response_tokens` (`finish_reason` "length", set by the rollout for
  every sample) scores 0 whatever its last number: it never gave an answer.
- math-verify's own timeout is off: it uses `signal.alarm`, which fails in the reward role's worker
  threads on every call; the project's deadline, `reward.timeout_s`, is the one that counts.
"""

from __future__ import annotations

import importlib.util
import re

INSTALL = "pip install 'math-verify[antlr4_9_3]>=0.9' (a dependency of hybridflow: pip install -e .)"
_FINAL_MARK = "####"
_THOUSANDS = re.compile(r"(?<![\d.,])\d{1,3}(?:,\d{3})+(?![\d,])")
_GSM8K_NUMBER = re.compile(r"\s*\$?\s*(-?[\d,]*\.?\d+(?:\s*\\?%)?)")  # keeps a percent sign
_PERCENT = re.compile(r"^(.*?)\s*\\?%\s*$", re.S)
# A number as people write it ("-1,234.5"), standing alone: not the end of a fraction or a power ("1/2").
_PROSE_NUMBER = re.compile(r"(?<![\w.^/])(?:-?\d[\d,]*(?:\.\d+)?|-?\.\d+)")
_PERCENT_SIGN = re.compile(r"\s*\\?%")


def require_math_verify() -> None:
    """ImportError naming the fix when math-verify is not installed; found without importing it, when
    the reward function is loaded (the input checks run it before anything starts)."""
    if importlib.util.find_spec("math_verify") is None:
        raise ImportError(f"the math rewards (math_answer, math_verify) need the math-verify package, which "
                          f"is not installed; fix: {INSTALL}")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) of `text`, braces balanced; None if none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[begin:i - 1] if depth == 0 else None  # an unclosed box gave no answer


def final_answer_text(response: str) -> tuple[str, bool]:
    """(the text holding the final answer, whether it is LaTeX math): the last `\\boxed{}`'s content,
    else what follows the last `####`, else the whole response."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed, True
    if _FINAL_MARK in response:
        after = response.rsplit(_FINAL_MARK, 1)[1]
        number = _GSM8K_NUMBER.match(after)  # GSM8K's own answer: the number right after '####'
        return (number.group(1) if number else after), False
    return response, False


def _parse(text: str, math: bool) -> list:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    text = _THOUSANDS.sub(lambda m: m.group(0).replace(",", ""), text)
    return parse(f"${text}$" if math else text, parsing_timeout=None,
                 extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()])


def _percent_number(text: str, math: bool) -> str | None:
    """The number of an answer that is a percent, else None. LaTeX (a box's content, a ground truth): all
    before a final `%` (`\\frac{1}{2}\\%`). Prose: its last number, when a `%` follows it ("That is 50%.",
    "12.5% off"); matching the whole prose as for LaTeX read "That is 50%" as the product t*h*a*t*i*s*50."""
    if math:
        percent = _PERCENT.match(text.strip().strip("$").strip())
        return (percent.group(1).strip() or None) if percent else None
    numbers = list(_PROSE_NUMBER.finditer(text))
    if numbers and _PERCENT_SIGN.match(text, numbers[-1].end()):
        return numbers[-1].group(0)
    return None


def _candidates(text: str, math: bool) -> list[list]:
    """The parsed readings of an answer: one, or for a percent its number and its hundredth."""
    number = _percent_number(text, math)
    if number is not None:
        return [p for p in (_parse(number, True), _parse(f"({number})/100", True)) if p]
    parsed = _parse(text, math)
    return [parsed] if parsed else []


def _gold(ground_truth: str) -> list[list]:
    truth = str(ground_truth)
    truth = truth.rsplit(_FINAL_MARK, 1)[1].strip() if _FINAL_MARK in truth else truth.strip()
    boxed = last_boxed(truth)
    if boxed is not None:
        return _candidates(boxed, True)
    return _candidates(truth.strip("$"), True)  # a bare answer (MATH's `\\sqrt{8}`) is LaTeX too


def score_math(response: str, ground_truth: str, finish_reason: str | None = None, **_) -> dict:
    """1.0 when the response's final answer equals the ground truth by value; 0.0 for a response cut by
    the length limit. Also reported: `accuracy` (= score), `answer_found`, `truncated`."""
    from math_verify import verify

    if finish_reason == "length":
        return {"score": 0.0, "accuracy": 0.0, "answer_found": 0.0, "truncated": 1.0}
    golds = _gold(ground_truth)
    answers = _candidates(*final_answer_text(str(response)))
    score = float(any(verify(gold, answer, timeout_seconds=None) for gold in golds for answer in answers))
    return {"score": score, "accuracy": score, "answer_found": float(bool(answers)), "truncated": 0.0}


score_math.reward_requires = require_math_verify  # checked when the function is loaded
