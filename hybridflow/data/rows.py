"""Row files: parquet or JSON lines with at least `prompt`, `ground_truth`, `data_source` columns."""

from __future__ import annotations

import json
import os
from pathlib import Path

REQUIRED_COLUMNS = ("prompt",)


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


def read_rows(path: str | Path, required: tuple[str, ...] = REQUIRED_COLUMNS) -> list[dict]:
    """Rows of a `.parquet` or `.jsonl` file; a missing file, bad line or column is named."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist; set data.train_path / data.val_path to a .parquet or .jsonl file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    elif path.suffix in (".jsonl", ".json"):
        rows = []
        with open(path) as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{line_no}: not valid JSON ({exc.msg}); each line must be one JSON object") from None
    else:
        raise ValueError(f"data file {path}: use a .parquet or .jsonl file")
    if not rows:
        raise ValueError(f"data file {path} has no rows")
    for i, row in enumerate(rows):
        missing = [c for c in required if c not in row or row[c] is None]
        if missing:
            raise ValueError(f"data file {path}, row {i}: missing column(s) {missing}; every row needs {list(required)}")
    return rows
