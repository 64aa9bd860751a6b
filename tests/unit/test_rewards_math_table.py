"""The math reward by value (`math_answer` = `math_verify`) on answer forms as models write them; the
table in docs/rewards.md is written from `FORMS` by this file (`python -m tests.unit.test_rewards_math_table`)
and a test fails when the two differ.

tests/controller/test_reward_worker.py scores `FORMS` again through the reward role on real Ray (the path
a run uses: the worker's threads), for both names.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.rewards import REWARD_FUNCTIONS

DOC = Path(__file__).resolve().parents[2] / "docs" / "rewards.md"
START, END = "<!-- math-forms:start (tests/unit/test_rewards_math_table.py) -->", "<!-- math-forms:end -->"

# (form, response, ground truth, finish_reason, score)
FORMS = [
    ("integer", "The answer is 42.", "42", "stop", 1.0),
    ("negative", "so the change is -5", "-5", "stop", 1.0),
    ("sign matters", "-3", "3", "stop", 0.0),
    ("decimal = integer", "72.0", "72", "stop", 1.0),
    ("thousands separator", "They paid 1,234 dollars.", "1234", "stop", 1.0),
    ("thousands in a box", r"\boxed{1,000,000}", "1000000", "stop", 1.0),
    ("boxed fraction vs decimal", r"The answer is $\boxed{\frac{1}{2}}$.", "0.5", "stop", 1.0),
    ("dfrac", r"\boxed{\dfrac{3}{4}}", "0.75", "stop", 1.0),
    ("plain fraction", "x = 1/2", r"\frac{1}{2}", "stop", 1.0),
    ("rounded decimal is not a fraction", "0.333", "1/3", "stop", 0.0),
    ("percent vs decimal", r"$\boxed{50\%}$", "0.5", "stop", 1.0),
    ("percent vs number", "50%", "50", "stop", 1.0),
    ("percent, plain", r"10\%", "0.1", "stop", 1.0),
    ("percent in prose", "That is 50%.", "0.5", "stop", 1.0),
    ("percent mid-sentence", "The discount is 12.5% off.", "12.5%", "stop", 1.0),
    ("a percent is not its thousandth", "That is 50%", "0.05", "stop", 0.0),
    ("an earlier percent is not the answer", "A 20% cut leaves 40.", "40", "stop", 1.0),
    ("last box counts", r"First \boxed{3}, finally \boxed{4}", "4", "stop", 1.0),
    ("not an earlier box", r"First \boxed{4}, finally \boxed{3}", "4", "stop", 0.0),
    ("a set in one box is a set", r"\boxed{3, 4}", "4", "stop", 0.0),
    ("set", r"\boxed{\{1, 2\}}", r"\{2, 1\}", "stop", 1.0),
    ("interval", r"\boxed{[1, 2)}", "[1,2)", "stop", 1.0),
    ("open vs half-open interval", r"\boxed{(1, 2)}", "[1,2)", "stop", 0.0),
    ("equation x = 3", r"The answer is \boxed{x = 3}", "3", "stop", 1.0),
    ("radical", r"so $x = \boxed{2\sqrt{2}}$", r"\sqrt{8}", "stop", 1.0),
    ("units in text", r"\boxed{5 \text{ cm}}", "5", "stop", 1.0),
    ("dollar sign", "It costs $18.", "18", "stop", 1.0),
    ("scientific", r"\boxed{1.5 \times 10^{3}}", "1500", "stop", 1.0),
    ("pi is not 3.14159", r"\boxed{\pi}", "3.14159", "stop", 0.0),
    ("GSM8K #### in both", "48 + 24 = 72\n#### 72", "Natalia sold 48/2 = 24 clips in May.\n#### 72", "stop", 1.0),
    ("#### over the last number", "#### 71 and later 72", "72", "stop", 0.0),
    ("last expression", "so 3 + 4 = 7", "7", "stop", 1.0),
    ("a prefix of the answer", "I think it is 12", "123", "stop", 0.0),
    ("cut by the length limit", "3 x 41 = 12", "12", "length", 0.0),
    ("no answer", "no answer here", "7", "stop", 0.0),
    ("empty box", r"\boxed{}", "7", "stop", 0.0),
    ("unclosed box", r"\boxed{7", "7", "stop", 0.0),
    ("empty response", "", "5", "stop", 0.0),
]


def table() -> str:
    def cell(text: str) -> str:
        return "`" + text.replace("\n", "⏎").replace("|", "\\|") + "`" if text else "(empty)"

    lines = ["| form | response | ground truth | finish | score |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {form} | {cell(r)} | {cell(g)} | {fin} | {s:g} |" for form, r, g, fin, s in FORMS]
    return "\n".join(lines)


@pytest.mark.parametrize("name", ["math_answer", "math_verify"])
@pytest.mark.parametrize("form, response, truth, finish, score", FORMS, ids=[f[0] for f in FORMS])
def test_each_form_gets_the_score_in_the_table(name, form, response, truth, finish, score):
    assert REWARD_FUNCTIONS.get(name)(response=response, ground_truth=truth, finish_reason=finish)["score"] == score


# A percent in prose scores as the bare one does: its number or its hundredth, not another power of ten.
# (issue 87 item 10: "That is 50%" scored 0 against both "50%" and "0.5"; the whole prose before the `%`
# was parsed as the number, t*h*a*t*i*s*50.)
PERCENTS = [  # (response, as a percent, its hundredth, its thousandth, its tenth)
    ("That is 50%", "50%", "0.5", "0.05", "5"),
    ("That is 50%.", "50%", "0.5", "0.05", "5"),
    ("so the answer is 50 %", "50%", "0.5", "0.05", "5"),
    (r"That is $50\%$.", "50%", "0.5", "0.05", "5"),
    ("The discount is 12.5% off.", "12.5%", "0.125", "0.0125", "1.25"),
    (r"$\boxed{50\%}$", "50%", "0.5", "0.05", "5"),
    ("50%", "50%", "0.5", "0.05", "5"),
    ("#### 50%", "50%", "0.5", "0.05", "5"),
]


@pytest.mark.parametrize("name", ["math_answer", "math_verify"])
@pytest.mark.parametrize("response, percent, hundredth, thousandth, tenth", PERCENTS, ids=[p[0] for p in PERCENTS])
def test_a_percent_scores_alike_in_prose_boxed_and_bare(name, response, percent, hundredth, thousandth, tenth):
    score = REWARD_FUNCTIONS.get(name)
    got = {truth: score(response=response, ground_truth=truth, finish_reason="stop")["score"]
           for truth in (percent, hundredth, thousandth, tenth)}
    assert got == {percent: 1.0, hundredth: 1.0, thousandth: 0.0, tenth: 0.0}


def test_the_docs_table_is_the_one_these_forms_write():
    text = DOC.read_text()
    assert START in text and END in text, f"{DOC} lost its markers {START!r} / {END!r}"
    written = text.split(START, 1)[1].split(END, 1)[0].strip()
    assert written == table(), "docs/rewards.md's table is stale; fix: python -m tests.unit.test_rewards_math_table"


if __name__ == "__main__":
    text = DOC.read_text()
    head, rest = text.split(START, 1)
    DOC.write_text(f"{head}{START}\n{table()}\n{END}{rest.split(END, 1)[1]}")
