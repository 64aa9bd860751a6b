"""Row files: parquet or JSON lines with at least a `prompt` column (usually also `ground_truth`
and `data_source`).

verl's parquet layout is read as is: `prompt` may be a list of chat messages (see chat.py), and
the answer may sit inside a dict column, `reward_model.ground_truth`; it is then also given as
the `ground_truth` column (see `NESTED_COLUMNS`). `extra_info`, `ability` and any other column
pass through unchanged to reward functions.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

from hybridflow.data.checks import RowChecker

REQUIRED_COLUMNS = ("prompt",)
SUFFIXES = (".parquet", ".jsonl", ".json")
# column -> (dict column, key): verl writes the answer as reward_model = {"ground_truth": ..., "style": ...}
NESTED_COLUMNS = {"ground_truth": ("reward_model", "ground_truth")}
_PARQUET_BATCH_ROWS = 65_536


def write_rows(rows: list[dict], path: str | Path) -> Path:
    """Write rows to `.parquet` or `.jsonl` (by suffix), atomically (temporary file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), tmp)
    elif path.suffix == ".jsonl":
        with open(tmp, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    else:
        raise ValueError(f"{path}: row files end in .parquet or .jsonl")
    os.replace(tmp, path)
    return path


def lift_nested_columns(row: dict) -> dict:
    """Add `ground_truth` from `reward_model.ground_truth` (verl) when the row has no such column."""
    for column, (outer, key) in NESTED_COLUMNS.items():
        nested = row.get(outer)
        if row.get(column) is None and isinstance(nested, dict) and nested.get(key) is not None:
            row[column] = nested[key]
    return row


def check_row_file(path: str | Path) -> Path:
    """The path, if it names an existing .parquet / .jsonl file; else an error naming the fix."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist; set data.train_path / data.val_path to a .parquet or .jsonl file")
    if path.suffix not in SUFFIXES:
        raise ValueError(f"data file {path}: use a .parquet or .jsonl file")
    return path


def iter_rows(path: str | Path, limit: int | None = None) -> Iterator[dict]:
    """Stream the rows of a row file (nested columns lifted), at most `limit` of them.

    Parquet is read a batch of rows at a time and JSON lines a line at a time, so a check that
    streams a large file never holds all of it. A line that is not JSON is named by number.
    """
    path = check_row_file(path)
    if limit is not None and limit <= 0:
        return
    count = 0
    for row in _parquet_rows(path, limit) if path.suffix == ".parquet" else _jsonl_rows(path):
        yield lift_nested_columns(row)
        count += 1
        if limit is not None and count >= limit:
            return


def _parquet_rows(path: Path, limit: int | None) -> Iterator[dict]:
    import pyarrow.parquet as pq

    batch_rows = min(limit, _PARQUET_BATCH_ROWS) if limit else _PARQUET_BATCH_ROWS
    for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_rows):
        yield from batch.to_pylist()


def _jsonl_rows(path: Path) -> Iterator[dict]:
    with open(path) as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({exc.msg}); each line must be one JSON object") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{line_no}: a JSON {type(row).__name__}, not an object; each line must be "
                                 'one JSON object such as {"prompt": "...", "ground_truth": "..."}')
            yield row


def count_rows(path: str | Path, at_least: int | None = None) -> tuple[int, bool]:
    """(rows, exact): a parquet file's row count from its footer; a JSON lines file's count of
    non-blank lines, stopping once `at_least` is reached (then `exact` is False)."""
    path = check_row_file(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows, True
    count = 0
    with open(path, "rb") as f:
        for line in f:
            count += bool(line.strip())
            if at_least is not None and count >= at_least:
                return count, False
    return count, True


def parquet_columns(path: str | Path) -> list[str]:
    """The column names in a parquet file's schema (nested ones lifted), read from its footer."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pq.read_schema(path)
    names = list(schema.names)
    for column, (outer, key) in NESTED_COLUMNS.items():
        if outer in names and pa.types.is_struct(schema.field(outer).type) and \
                schema.field(outer).type.get_field_index(key) >= 0 and column not in names:
            names.append(column)
    return names


def read_rows(path: str | Path, required: tuple[str, ...] = REQUIRED_COLUMNS) -> list[dict]:
    """Rows of a `.parquet` or `.jsonl` file; a missing file, bad line or column is named, and every
    row's prompt is checked to be text or chat messages as it is read (one pass over the file)."""
    path = Path(path)
    rows = list(iter_rows(path))
    if not rows:
        raise ValueError(f"data file {path} has no rows")
    for i, row in enumerate(rows):
        missing = [c for c in required if c not in row or row[c] is None]
        if missing:
            raise ValueError(f"data file {path}, row {i}: missing column(s) {missing}; every row needs {list(required)}")
    checker = RowChecker()
    for i, row in enumerate(rows):
        checker.check(i, row)
    problems = checker.messages(f"data file {path}")
    if problems:
        raise ValueError("\n".join(problems))
    return rows
