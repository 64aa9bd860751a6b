"""The `reasoning_gym` reward: a response scored by its reasoning-gym dataset's own `score_answer`.

Rows come from `python -m hybridflow.data.reasoning_gym` (hybridflow/data/reasoning_gym.py). Their
`reasoning_gym` column locates the entry (dataset, config, index), and the entry is generated again
here rather than read back from the row: JSON turns tuples into lists, and some scorers compare
tuples (arc_agi and rearc score their own answer 0.05 against a JSON copy of the entry). Entries are
cached per process (a few datasets take ~0.5 s per entry, e.g. knight_swap). The row's question
must equal the regenerated one, else the rows were written by another reasoning-gym version: an
error, not a wrong score.

The answer is the text inside the response's last <answer>...</answer>, reasoning-gym's own
convention (its system prompts, which the generated rows start with, ask for it); without one the
dataset scores a missing answer (0; 0.01 for three datasets). The fixed argument `answer_tag: null`
(`reward.functions=[{fn: reasoning_gym, kwargs: {answer_tag: null}}]`) scores the whole response,
stripped. A scorer that raises on a malformed answer (prime_factorization and boxnet do) scores it 0,
counted in the `scorer_raised` extra.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import re
import threading

from hybridflow.data.reasoning_gym import COLUMN, INSTALL, create_dataset

FIX = "write the rows with python -m hybridflow.data.reasoning_gym <dataset> <out_dir>"


def require_reasoning_gym() -> None:
    """ImportError naming the fix when reasoning-gym is not installed; found without importing it,
    when the reward function is loaded (the input checks run it before anything starts)."""
    if importlib.util.find_spec("reasoning_gym") is None:
        raise ImportError(f"reward.fn=reasoning_gym needs the reasoning-gym package, which is not installed; "
                          f"fix: {INSTALL}")


def extract_tagged_answer(text: str, tag: str = "answer") -> str | None:
    """The stripped text inside the last <tag>...</tag> of `text`; None when there is none."""
    found = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", str(text), flags=re.DOTALL)
    return found[-1].strip() if found else None


@functools.lru_cache(maxsize=64)
def _dataset(name: str, config_json: str):
    return create_dataset(name, json.loads(config_json))


@functools.lru_cache(maxsize=4096)
def _cached_entry(name: str, config_json: str, index: int) -> dict:
    return _dataset(name, config_json)[index]


_GENERATING = threading.Lock()  # the samples of one prompt, scored in threads at once, generate its entry once


def _entry(name: str, config_json: str, index: int) -> dict:
    with _GENERATING:
        return _cached_entry(name, config_json, index)


def locate_entry(located: dict) -> tuple[object, dict]:
    """(dataset, entry) for a row's `reasoning_gym` value; an error names what does not fit."""
    if not isinstance(located, dict) or not {"dataset", "config", "index", "entry"} <= set(located):
        raise ValueError(f"column {COLUMN!r} holds {str(located)[:80]!r}, not a dict with dataset, config, index and "
                         f"entry; {FIX}")
    name, config_json, index = located["dataset"], json.dumps(located["config"], sort_keys=True), located["index"]
    entry = _entry(name, config_json, index)
    if entry["question"] != located["entry"]["question"]:
        raise ValueError(f"reasoning-gym dataset {name!r} entry {index} (config {located['config']}) has another "
                         "question than the row: the rows were written by another reasoning-gym version; "
                         f"{FIX} again, or install the version that wrote them")
    return _dataset(name, config_json), entry  # cached by _entry


def score_reasoning_gym(response: str, reasoning_gym: dict, answer_tag: str | None = "answer", **_) -> dict:
    """The dataset's score of the response's answer, in [0, 1]; extras `accuracy` (score 1),
    `answer_found` (an answer was extracted) and `scorer_raised` (the scorer raised on it: 0)."""
    dataset, entry = locate_entry(reasoning_gym)
    answer = (str(response).strip() or None) if answer_tag is None else extract_tagged_answer(response, answer_tag)
    raised = 0.0
    try:
        score = float(dataset.score_answer(answer, entry=copy.deepcopy(entry)))  # a copy: entries are cached
    except Exception:  # noqa: BLE001 - the scorer's own parsing failed on a malformed answer: it is wrong
        score, raised = 0.0, 1.0
    return {"score": score, "accuracy": float(score == 1.0), "answer_found": float(answer is not None),
            "scorer_raised": raised}


score_reasoning_gym.reward_requires = require_reasoning_gym  # checked when the function is loaded
