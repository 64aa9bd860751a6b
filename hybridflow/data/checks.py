"""Per-row checks of data files, one row at a time, so a check can stream a file of any size.

Each problem is reported once per column with the first offending rows, the type and value of
the first of them, and the fix: a file with a million bad rows gives one line, not a million.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridflow.data.chat import CHAT_FIX, is_chat, prompt_problem

MAX_LISTED_ROWS = 5


class InputError(ValueError):
    """The run's inputs cannot work; the message lists every problem found, one per line. The
    `hybridflow` command exits with status 2 on it (raised before Ray starts)."""


@dataclass
class _Offenders:
    what: str  # what the first offending row holds, e.g. "int 42"
    rows: list[int] = field(default_factory=list)  # the first MAX_LISTED_ROWS
    count: int = 0


class RowChecker:
    """Checks each row's `prompt` (text or chat messages) and that the `required` columns have values.

    `required` maps a column to the reason it is needed (e.g. "reward function 'score' (reward.fn)
    takes it as an argument"), which the error repeats.
    """

    def __init__(self, required: dict[str, str] | None = None, keep_prompts: int = 0) -> None:
        self.required = dict(required or {})
        self.rows_checked = 0
        self.first_chat_row: int | None = None
        self.keep_prompts = keep_prompts
        self.prompts: list[tuple[int, object]] = []  # (row, prompt): the first `keep_prompts` good ones
        self.targets: list[dict] = []  # their SFT targets: ground_truth, demonstration
        self._offenders: dict[str, _Offenders] = {}

    def check(self, index: int, row: dict) -> None:
        prompt = row.get("prompt")
        problem = prompt_problem(prompt)
        if problem is not None:
            self._add("prompt", index, problem)
        else:
            if self.first_chat_row is None and is_chat(prompt):
                self.first_chat_row = index
            if len(self.prompts) < self.keep_prompts:
                self.prompts.append((index, prompt))
                self.targets.append({k: row.get(k) for k in ("ground_truth", "demonstration")})
        for column in self.required:
            if row.get(column) is None and column != "prompt":
                self._add(column, index, "null" if column in row else "no such key")
        self.rows_checked += 1

    def _add(self, column: str, index: int, what: str) -> None:
        found = self._offenders.setdefault(column, _Offenders(what))
        found.count += 1
        if len(found.rows) < MAX_LISTED_ROWS:
            found.rows.append(index)

    def messages(self, where: str, skip: list[str] = ()) -> list[str]:
        """One error line per offending column, each starting with `where` (the file and its key);
        columns in `skip` (e.g. absent from the whole file, reported once elsewhere) are left out."""
        out = []
        for column, found in self._offenders.items():
            if column in skip:
                continue
            rows = ", ".join(map(str, found.rows)) + (f" and {found.count - len(found.rows)} more"
                                                     if found.count > len(found.rows) else "")
            if column == "prompt":
                out.append(f"{where}, column 'prompt', row(s) {rows}: row {found.rows[0]} holds {found.what}, "
                           f"not text or chat messages; fix: {CHAT_FIX}")
            else:
                out.append(f"{where}, column {column!r}, row(s) {rows}: no value (row {found.rows[0]}: "
                           f"{found.what}), but {self.required[column]}; fix: give every row a {column!r} value")
        return out
