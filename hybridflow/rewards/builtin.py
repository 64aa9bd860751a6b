"""Built-in rule-based rewards."""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def extract_answer(response: str) -> str | None:
    """The first number in a response ("82 and more" -> "82"); None if there is none."""
    match = _NUMBER.search(response)
    return match.group(0) if match else None


def exact_match(response: str, ground_truth: str, **_) -> float:
    """1.0 when the response, stripped of surrounding space, equals the ground truth, else 0.0."""
    return 1.0 if response.strip() == str(ground_truth).strip() else 0.0
