"""A bench script's result: printed as JSON and, with `--out`, written to that file."""

from __future__ import annotations

import json
from pathlib import Path


def emit(report: dict, out: str = "") -> None:
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
