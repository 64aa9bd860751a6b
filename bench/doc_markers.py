"""Benchmarks write their results into docs between two HTML comments, leaving the rest of the page."""

from __future__ import annotations

from pathlib import Path


def write_between(doc: Path, begin: str, end: str, text: str) -> None:
    """Replace what lies between the markers `begin` and `end` in `doc` with `text`."""
    body = doc.read_text() if doc.exists() else f"{begin}\n{end}\n"
    if begin not in body or end not in body:
        raise SystemExit(f"{doc} lacks the markers {begin} / {end} that the results go between")
    head, rest = body.split(begin, 1)
    doc.write_text(f"{head}{begin}\n{text}\n{end}{rest.split(end, 1)[1]}")
