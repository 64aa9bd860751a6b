"""A synthetic arithmetic task: "37+45=" -> "82".

Rows carry the columns every task in HybridFlow has: `prompt`, `ground_truth` and
`data_source`. Difficulty is set by the number of digits per operand and the operations
allowed; `data_source` records both (e.g. "arithmetic/add/2d"), so metrics can be split by it.
Generation is seeded and deterministic. `make_arithmetic_split` draws the training and
validation rows together and splits them at random, so the held-out set is disjoint from the
training set and has the same mix of difficulties: drawn separately, a small validation set
would take most of the few 1-digit problems (100 exist, against 8,100 2-digit ones) and test a
different mix than training sees.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

OPERATIONS = {"add": "+", "sub": "-", "mul": "*"}


@dataclass(frozen=True)
class ArithmeticSpec:
    min_digits: int = 1
    max_digits: int = 2
    operations: tuple[str, ...] = ("add",)
    allow_negative: bool = False  # subtraction results below zero are redrawn when False

    def __post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits <= 9:
            raise ValueError(
                f"arithmetic task: need 1 <= min_digits <= max_digits <= 9, "
                f"got min_digits={self.min_digits}, max_digits={self.max_digits}")
        unknown = [op for op in self.operations if op not in OPERATIONS]
        if unknown or not self.operations:
            raise ValueError(f"arithmetic task: operations {list(self.operations)} must be a non-empty subset of {sorted(OPERATIONS)}")


def make_arithmetic_rows(count: int, spec: ArithmeticSpec, seed: int, exclude: set[str] | None = None) -> list[dict]:
    """`count` distinct rows with prompt, ground_truth and data_source; none whose prompt is in `exclude`."""
    rng = random.Random(seed)
    exclude = exclude or set()
    rows: list[dict] = []
    seen: set[str] = set()
    attempts = 0
    while len(rows) < count:
        attempts += 1
        if attempts > 50 * count + 1000:
            raise ValueError(
                f"arithmetic task: only {len(rows)} distinct problems exist for {spec}; ask for fewer "
                "rows or widen max_digits / operations")
        op = rng.choice(spec.operations)
        digits = rng.randint(spec.min_digits, spec.max_digits)
        a = rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)
        b = rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)
        if op == "sub" and a < b and not spec.allow_negative:
            a, b = b, a
        prompt = f"{a}{OPERATIONS[op]}{b}="
        if prompt in seen or prompt in exclude:
            continue
        seen.add(prompt)
        answer = a + b if op == "add" else a - b if op == "sub" else a * b
        rows.append({"prompt": prompt, "ground_truth": str(answer), "data_source": f"arithmetic/{op}/{digits}d"})
    return rows


def make_arithmetic_split(train_rows: int, val_rows: int, spec: ArithmeticSpec, seed: int
                          ) -> tuple[list[dict], list[dict]]:
    """(train, val): `train_rows + val_rows` distinct rows, shuffled, the first `val_rows` held out."""
    rows = make_arithmetic_rows(train_rows + val_rows, spec, seed)
    random.Random(seed + 1).shuffle(rows)
    return rows[val_rows:], rows[:val_rows]


def first_operand_below(rows: list[dict], bound: int, rows_not_below: int = 0) -> list[dict]:
    """The rows whose first operand is below `bound`, then the first `rows_not_below` of the others (all
    of them where there are fewer, as in a short run's few rows): a task shown in part (an SFT stage's
    demonstrations), with a few examples of the rest so the model has a foothold there, while its
    held-out rows and RL prompts cover all of it. An empty result is an error naming the bound."""
    kept, others = [], []
    for row in rows:
        (kept if int(re.match(r"\d+", row["prompt"]).group()) < bound else others).append(row)  # "37+45=" -> 37
    if not kept:
        raise ValueError(f"data.synthetic.train_first_operand_below={bound} leaves none of the {len(rows)} training "
                         "rows; raise it (operands start at 0)")
    return kept + others[:rows_not_below]
