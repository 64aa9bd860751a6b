"""Row files from reasoning-gym's procedural reasoning tasks (the optional `reasoning` extra).

    python -m hybridflow.data.reasoning_gym basic_arithmetic data/rg --train-rows 2000 --val-rows 200

writes `data/rg/train.jsonl` and `data/rg/val.jsonl` for `data=files` and `reward.fn=reasoning_gym`
(hybridflow/rewards/reasoning_gym.py, which scores with the dataset's own `score_answer`). Each row:
`prompt` (chat messages: reasoning-gym's system prompt asking for <answer> tags, then the question),
`ground_truth` (the entry's answer; null for the datasets that have no single reference answer and
check a response's validity instead, such as rush_hour), `data_source` ("reasoning_gym/<name>") and
`reasoning_gym`: the dataset, its config (seed and size included) and the entry's index, which
locate the entry for the scorer, and the entry itself (question, answer, metadata) to read.

Train and validation rows are one dataset's distinct questions split in index order (each index is
its own seeded draw, so the split is random): disjoint, with the same mix of difficulties. A row
carries its own dataset and config, so files of several datasets can be concatenated into one mix.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from dataclasses import fields
from pathlib import Path

from hybridflow.data.rows import write_rows

COLUMN = "reasoning_gym"
INSTALL = "pip install -e '.[reasoning]' (or pip install reasoning-gym==0.1.25)"
SET_BY_US = ("seed", "size")  # dataset config fields the generator sets itself


def import_reasoning_gym():
    """The `reasoning_gym` package, or an ImportError saying what to install."""
    try:
        import reasoning_gym
    except ImportError as exc:
        raise ImportError(f"reasoning-gym tasks need the reasoning-gym package, which is not installed; "
                          f"fix: {INSTALL}") from exc
    return reasoning_gym


def dataset_names() -> list[str]:
    """reasoning-gym's registered datasets, less `composite` (concatenate row files instead)."""
    import_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    return sorted(name for name in DATASETS if name != "composite")


def create_dataset(name: str, config: dict):
    """reasoning-gym dataset `name` built with `config` (its config dataclass's fields); an unknown
    name lists the valid ones, an unknown or invalid field names the dataset's fields."""
    rg = import_reasoning_gym()
    names = dataset_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        if name == "composite":
            hint = " (for a mix, write each dataset's rows and concatenate the files: each row names its dataset)"
        raise ValueError(f"unknown reasoning-gym dataset {name!r}{hint}; reasoning-gym {_version()} has: "
                         f"{', '.join(names)}")
    from reasoning_gym.factory import DATASETS

    known = [f.name for f in fields(DATASETS[name][1])]
    unknown = sorted(set(config) - set(known))
    if unknown:
        raise ValueError(f"reasoning-gym dataset {name!r} has no config field(s) {unknown}; its fields: {known}")
    try:
        return rg.create_dataset(name, **config)
    except (AssertionError, ValueError, TypeError) as exc:  # its config's validate() asserts
        raise ValueError(f"reasoning-gym dataset {name!r} refuses config {config}: {str(exc) or type(exc).__name__}; "
                         f"its fields: {known}") from None


def _version() -> str:
    from importlib.metadata import version

    return version("reasoning-gym")


def system_messages(system_prompt: str) -> list[dict]:
    """The system message for reasoning-gym's named system prompt; none for 'none'."""
    if system_prompt == "none":
        return []
    import_reasoning_gym()
    from reasoning_gym.utils import SYSTEM_PROMPTS

    if system_prompt not in SYSTEM_PROMPTS:
        raise ValueError(f"--system-prompt {system_prompt!r}: use one of reasoning-gym's {sorted(SYSTEM_PROMPTS)} "
                         "or 'none'")
    return [{"role": "system", "content": SYSTEM_PROMPTS[system_prompt]}]


def make_reasoning_gym_split(name: str, train_rows: int, val_rows: int, seed: int, config: dict | None = None,
                             system_prompt: str = "default") -> tuple[list[dict], list[dict]]:
    """(train, val) rows: the first `train_rows + val_rows` distinct questions of dataset `name`
    (seeded with `seed`, `config` its other fields), the first `train_rows` for training."""
    if train_rows < 1 or val_rows < 1:
        raise ValueError(f"--train-rows {train_rows} / --val-rows {val_rows}: both must be >= 1")
    config = dict(config or {})
    reserved = sorted(set(config) & set(SET_BY_US))
    if reserved:
        raise ValueError(f"--config sets {reserved}; the seed is --seed and the size follows from the row counts")
    wanted = train_rows + val_rows
    config.update(seed=seed, size=2 * wanted + 100)  # room for repeated questions, which are skipped
    system = system_messages(system_prompt)
    dataset = create_dataset(name, config)
    rows, seen = [], set()
    for index in range(config["size"]):
        entry = dataset[index]
        if entry["question"] not in seen:
            seen.add(entry["question"])
            rows.append(_row(name, config, index, entry, system))
        if len(rows) == wanted:
            return rows[:train_rows], rows[train_rows:]
    raise ValueError(f"reasoning-gym dataset {name!r} with config {config} gave only {len(rows)} distinct questions "
                     f"in {config['size']} draws, fewer than the {wanted} rows asked for; ask for fewer rows, or "
                     "widen the dataset's ranges with --config")


def _row(name: str, config: dict, index: int, entry: dict, system: list[dict]) -> dict:
    # default=repr: a metadata value JSON cannot hold is kept as text (the scorer regenerates the entry)
    readable = json.loads(json.dumps({k: entry.get(k) for k in ("question", "answer", "metadata")}, default=repr))
    return {
        "prompt": [*system, {"role": "user", "content": entry["question"]}],
        "ground_truth": None if entry["answer"] is None else str(entry["answer"]),
        "data_source": f"reasoning_gym/{name}",
        COLUMN: {"dataset": name, "config": dict(config), "index": index, "entry": readable},
    }


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object such as '{{\"max_terms\": 3}}'")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hybridflow.data.reasoning_gym",
                                     description="Write train.jsonl and val.jsonl from a reasoning-gym dataset.")
    parser.add_argument("dataset", help="a reasoning-gym dataset name, e.g. basic_arithmetic")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--train-rows", type=int, default=2000)
    parser.add_argument("--val-rows", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", type=_json_object, default={},
                        help='the dataset\'s other config fields as a JSON object, e.g. \'{"max_terms": 3}\'')
    parser.add_argument("--system-prompt", default="default",
                        help="a name in reasoning_gym.utils.SYSTEM_PROMPTS (they ask for <answer> tags), or none")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # usage errors exit 2 through argparse
    try:
        train, val = make_reasoning_gym_split(args.dataset, args.train_rows, args.val_rows, args.seed, args.config,
                                              args.system_prompt)
    except (ValueError, ImportError) as exc:
        print(f"hybridflow.data.reasoning_gym: error: {exc}", file=sys.stderr)
        return 2
    train_path = write_rows(train, args.out_dir / "train.jsonl")
    val_path = write_rows(val, args.out_dir / "val.jsonl")
    print(f"wrote {len(train)} rows to {train_path} and {len(val)} to {val_path}; train on them with:\n"
          f"  hybridflow recipe=grpo data=files data.train_path={train_path} data.val_path={val_path} "
          "reward.fn=reasoning_gym")
    return 0


if __name__ == "__main__":
    sys.exit(main())
