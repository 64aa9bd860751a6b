"""Stage deadlines: no controller wait on a worker lasts forever.

A recipe names the stages of its step (`with timer("generate"): ...`); while a stage runs, every
blocking call on a worker group waits at most until the stage's deadline
(`trainer.stage_timeout_s.<stage>`, else `trainer.default_stage_timeout_s`). A stage that
overruns raises `StageTimeoutError` naming the stage, the key that set its deadline, and each
worker class, method and rank that gave no answer. Outside any stage each wait is bounded
by `trainer.default_stage_timeout_s` (set-up, validation, checkpoints).

A wait ends at the earliest of three deadlines: the caller's own `timeout_s` (e.g.
`weight_sync.timeout_s`), the deadline of the stage the wait runs in, and the deadline of the
stage each awaited call was *submitted* in (a call issued in one stage and awaited in a later
one, as an asynchronous rollout's generation is, keeps the deadline it was issued under). The
error names whichever deadline ended the wait, and its key.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator

_TIMEOUTS: dict[str, float] = {}
_DEFAULT: list[float | None] = [None]
OUTSIDE = "(between stages)"
_CURRENT: ContextVar[tuple[str, float, float] | None] = ContextVar("hybridflow_stage", default=None)


class StageTimeoutError(TimeoutError):
    """A stage of the step did not finish within its deadline."""


def configure(timeouts: dict[str, float], default_s: float | None) -> None:
    """Deadlines per stage name (seconds), and for stages not named."""
    _TIMEOUTS.clear()
    _TIMEOUTS.update(timeouts)
    _DEFAULT[0] = default_s


@contextmanager
def stage(name: str) -> Iterator[None]:
    """Every group wait inside this block ends by the stage's deadline."""
    timeout_s = _TIMEOUTS.get(name, _DEFAULT[0])
    if timeout_s is None:
        yield
        return
    token = _CURRENT.set((name, time.monotonic() + timeout_s, timeout_s))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def remaining() -> tuple[str, float, float] | None:
    """(stage, seconds left, the stage's whole timeout) while a stage with a deadline runs; outside
    any stage, the default timeout for this one wait (None when no default is configured)."""
    current = _CURRENT.get()
    if current is None:
        return None if _DEFAULT[0] is None else (OUTSIDE, _DEFAULT[0], _DEFAULT[0])
    name, deadline, timeout_s = current
    return name, max(0.0, deadline - time.monotonic()), timeout_s


@dataclass(frozen=True)
class Deadline:
    """When a wait must end (`time.monotonic()` seconds), and who set it: a stage's name, or
    `by_caller` for a caller's own `timeout_s`."""

    stage: str
    at: float
    timeout_s: float
    by_caller: bool = False

    def left(self) -> float:
        return max(0.0, self.at - time.monotonic())


def current() -> Deadline | None:
    """The deadline of the stage running now (outside any stage: the default, from now)."""
    found = remaining()
    return None if found is None else Deadline(found[0], time.monotonic() + found[1], found[2])


def caller(timeout_s: float) -> Deadline:
    return Deadline("(caller's timeout_s)", time.monotonic() + timeout_s, timeout_s, by_caller=True)


def earliest(candidates: list[Deadline | None]) -> Deadline | None:
    found = [d for d in candidates if d is not None]
    return min(found, key=lambda d: d.at) if found else None


def overrun(name: str, timeout_s: float, detail: str) -> StageTimeoutError:
    key = f"trainer.stage_timeout_s.{name}" if name in _TIMEOUTS else "trainer.default_stage_timeout_s"
    return StageTimeoutError(f"stage {name!r} did not finish within {timeout_s:g} s ({key}): {detail}. A worker is "
                             f"stuck (a hung collective, a dead peer) or the stage needs longer: raise {key}")
