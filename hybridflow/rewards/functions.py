"""One user reward function, wrapped: arguments chosen by name, calls bounded, results checked.

`RewardFunction` turns a plain, `async def` or batched function into per-sample scores. It
passes each call only the keyword arguments the function names (everything when it takes
`**kwargs`): `prompt`, `response`, every column of the data row, and the fixed `kwargs` of
its config entry. Other frameworks' names for the sample's text are filled too when a
function names them (`ARGUMENT_ALIASES`): verl's `compute_score(data_source, solution_str,
ground_truth, extra_info)` and TRL's `reward_func(prompts, completions, **kwargs)` plug in
unchanged. It runs the calls with a deadline each (see `calls.py`) and checks every
result: a finite number, or a dict with a finite numeric `score` and numeric extras. A
failure becomes a `RewardFunctionError` naming the function, the sample and the cause; the
composer then raises it or scores the sample with the fallback.
"""

from __future__ import annotations

import inspect
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable

from hybridflow.rewards.calls import Outcome, run_async, run_sync

# Filled for every sample by the reward role; `finish_reason` is the rollout's: "stop" (EOS or a stop
# text) or "length" (cut at rollout.max_response_tokens, or an agent out of turns or tokens).
SAMPLE_ARGUMENTS = ("prompt", "response", "finish_reason")
# Filled for every sample of an agent rollout (rollout.agent; hybridflow/agents/trajectory.py), and
# for no other sample: the response text of all turns, and the environment's summed step rewards.
AGENT_ARGUMENTS = ("trajectory", "agent_reward")
# Filled for every sample of a hub environment's rollout (rollout.environment; hybridflow/agents/hubs):
# the environment's own rubric, {'score': its weighted total, <reward function>: its score, ...}, or
# None where the episode failed (the sample's `agent_failure` says how).
ENVIRONMENT_ARGUMENTS = ("env_rewards",)
# Other frameworks' argument names -> the sample field they mean. Filled only for a function that
# names them and only when the data has no column of that name (a column always wins).
ARGUMENT_ALIASES = {"solution_str": "response", "completions": "response", "prompts": "prompt"}


class RewardFunctionError(ValueError):
    """A reward function failed on a sample.

    `kind` is the cause: "raised", "bad_value", "timeout" (these three may fall back), or a
    setup error, always raised: "load", "bad_signature", "missing_argument", "argument_clash",
    "needs_main_thread" (a function using signals, called in a thread).
    """

    FALLBACK_KINDS = ("raised", "bad_value", "timeout")

    def __init__(self, message: str, *, function: str = "", sample: int | None = None, kind: str = "") -> None:
        super().__init__(message)
        self.function, self.sample, self.kind = function, sample, kind

    def __reduce__(self):  # keyword attributes survive pickling (errors cross Ray processes)
        return (_rebuild_error, (str(self), self.function, self.sample, self.kind))


def _rebuild_error(message: str, function: str, sample: int | None, kind: str) -> RewardFunctionError:
    return RewardFunctionError(message, function=function, sample=sample, kind=kind)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class FunctionScores:
    """Per-sample results of one function: a score and extras, or the error that replaced them."""

    scores: list[float | None]
    extras: list[dict[str, float]]
    errors: list[RewardFunctionError | None] = field(default_factory=list)
    root_cause: int | None = None  # position of the sample whose failure made others fail (blocked loop)

    def first_error(self) -> RewardFunctionError | None:
        """The error to report: the root cause if there is one, else the first by position."""
        if self.root_cause is not None and self.errors[self.root_cause] is not None:
            return self.errors[self.root_cause]
        return next((err for err in self.errors if err is not None), None)


class RewardFunction:
    """A reward function with its metric name, weight and fixed keyword arguments.

    `reference` is what the config named (for messages); `key` the config key it came from.
    """

    def __init__(self, fn: Callable, reference: str, name: str, weight: float = 1.0, batched: bool = False,
                 kwargs: dict[str, Any] | None = None, key: str = "reward.fn") -> None:
        self.fn, self.reference, self.name, self.weight = fn, reference, name, weight
        self.batched = batched or bool(getattr(fn, "reward_batched", False))
        self.kwargs, self.key = dict(kwargs or {}), key
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
        self._accepted, self._required, self._takes_all = self._inspect()

    def _inspect(self) -> tuple[set[str], list[str], bool]:
        if not callable(self.fn):
            raise self._setup_error(f"is a {type(self.fn).__name__}, not a function", "bad_signature")
        try:
            params = inspect.signature(self.fn).parameters.values()
        except (TypeError, ValueError) as exc:
            raise self._setup_error(f"has no readable signature ({exc})", "bad_signature") from None
        positional = [p.name for p in params if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
        if positional:
            raise self._setup_error(f"has positional-only parameters {positional}; arguments are passed by name",
                                    "bad_signature")
        named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        takes_all = any(p.kind is p.VAR_KEYWORD for p in params)
        accepted = {p.name for p in named}
        unknown = sorted(set(self.kwargs) - accepted) if not takes_all else []
        if unknown:
            raise self._setup_error(f"takes no argument(s) {unknown} given in {self.key}.kwargs; "
                                    f"it takes {sorted(accepted)}", "bad_signature")
        return accepted, [p.name for p in named if p.default is p.empty], takes_all

    def _setup_error(self, what: str, kind: str) -> RewardFunctionError:
        return RewardFunctionError(f"reward function {self.reference!r} ({self.key}) {what}",
                                   function=self.reference, kind=kind)

    # ---- arguments ---------------------------------------------------------------------------

    def _arguments(self, row: dict[str, Any], index: int) -> dict[str, Any]:
        """The keyword arguments for one sample; a required one that is missing is an error."""
        clash = sorted(set(self.kwargs) & set(row))
        if clash:
            raise self._sample_error(index, row, f"{self.key}.kwargs sets {clash}, which the data row also has; "
                                     "rename the fixed argument or drop the column", "argument_clash")
        available = {**row, **self.kwargs}
        for alias, field_name in ARGUMENT_ALIASES.items():
            if alias in self._accepted and alias not in available and field_name in row:
                available[alias] = row[field_name]
        missing = [name for name in self._required if name not in available]
        if missing:
            raise self._sample_error(
                index, row, f"needs argument(s) {missing}, which the sample does not have; available: "
                f"{sorted(available)}. Add the column to the data, set it in {self.key}.kwargs, or give "
                "the parameter a default", "missing_argument")
        if self._takes_all:
            return available
        return {k: v for k, v in available.items() if k in self._accepted}

    def data_arguments(self, agent_rollout: bool = False, environment_rollout: bool = False) -> list[str]:
        """The required arguments that only a data column can fill: not the sample's prompt or
        response (or an alias of them), not what an agent rollout (or a hub environment's) fills when
        there is one, and not a fixed argument of the config entry."""
        filled = {*SAMPLE_ARGUMENTS, *ARGUMENT_ALIASES, *self.kwargs,
                  *(AGENT_ARGUMENTS if agent_rollout or environment_rollout else ()),
                  *(ENVIRONMENT_ARGUMENTS if environment_rollout else ())}
        return [name for name in self._required if name not in filled]

    def clashing_columns(self, columns) -> list[str]:
        """Fixed arguments (`<key>.kwargs`) that a data column of the same name would collide with."""
        return sorted(set(self.kwargs) & set(columns))

    # ---- scoring -------------------------------------------------------------------------------

    def score(self, rows: list[dict[str, Any]], *, timeout_s: float, max_concurrency: int,
              stop_on_error: bool, first_index: int = 0) -> FunctionScores:
        """Score `rows` (dicts with prompt, response and the data columns).

        Sample numbers in errors are `first_index + position`. With `stop_on_error`, scoring
        stops at the first failure (the rest get no score and no error).
        """
        args = [self._arguments(row, first_index + i) for i, row in enumerate(rows)]
        if self.batched:
            return self._score_batched(rows, args, timeout_s, first_index)
        if self.is_async:
            outcomes = run_async([_bind(self.fn, a) for a in args], timeout_s, max_concurrency, stop_on_error)
        else:
            outcomes = run_sync([_bind(self.fn, a) for a in args], timeout_s, max_concurrency, stop_on_error)
        out = FunctionScores([None] * len(rows), [{} for _ in rows], [None] * len(rows))
        out.root_cause = next((o.blocked_by for o in outcomes if o is not None and o.blocked_by is not None), None)
        for i, outcome in enumerate(outcomes):
            if outcome is None:
                continue
            try:
                out.scores[i], out.extras[i] = self._check(outcome, timeout_s, i, first_index, rows[i])
            except RewardFunctionError as err:
                out.errors[i] = err
        return out

    def _score_batched(self, rows, args, timeout_s, first_index) -> FunctionScores:
        columns = {k: [a[k] for a in args] for k in args[0]} if args else {}
        columns.update(self.kwargs)  # fixed arguments are passed once, not per sample
        run = run_async if self.is_async else run_sync
        outcome = run([_bind(self.fn, columns)], timeout_s, 1, True)[0]
        out = FunctionScores([None] * len(rows), [{} for _ in rows], [None] * len(rows))
        values = outcome.value
        if outcome.ok and (isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__")
                           or len(values) != len(rows)):
            got = f"length {len(values)}" if hasattr(values, "__len__") else type(values).__name__
            cause = (f"must return a list of {len(rows)} scores, one per sample of samples {first_index}.."
                     f"{first_index + len(rows) - 1}; it returned {_short(values)} ({got})")
            out.errors = [self._sample_error(first_index + i, row, cause, "bad_value") for i, row in enumerate(rows)]
            return out
        for i in range(len(rows)):
            one = Outcome(value=values[i]) if outcome.ok else outcome
            try:
                out.scores[i], out.extras[i] = self._check(one, timeout_s, i, first_index, rows[i])
            except RewardFunctionError as err:
                out.errors[i] = err
        return out

    def _check(self, outcome: Outcome, timeout_s: float, i: int, first_index: int, row: dict) -> tuple[float, dict]:
        """The checked (score, extras) of one call's outcome, or the error describing it."""
        index = first_index + i
        if outcome.timed_out and outcome.blocked_by not in (None, i):
            raise self._sample_error(index, row, f"did not finish within {timeout_s:g} s: sample "
                                     f"{first_index + outcome.blocked_by} blocked the event loop", "timeout")
        if outcome.timed_out:
            if outcome.blocked_by == i:
                note = ("; it blocked the event loop, so the loop was abandoned: an async def function must "
                        "await, not call blocking code such as time.sleep")
            elif self.is_async:
                note = "; the call was cancelled"
            else:
                note = "; the call was abandoned (a thread cannot be killed: it may still be running)"
            raise self._sample_error(index, row, f"timed out after {timeout_s:g} s{note}", "timeout")
        if outcome.error is not None:
            exc = outcome.error
            if _needs_main_thread(exc):  # fails the same way on every sample: never a fallback score
                raise self._sample_error(index, row, f"raised {type(exc).__name__}: {exc}. It uses signals "
                                         f"(e.g. signal.alarm for its own timeout), which work only in a "
                                         f"process's main thread, and the reward role calls functions in "
                                         f"threads; fix: turn the function's own timeout off (math-verify: "
                                         f"parse(..., parsing_timeout=None), verify(..., timeout_seconds=None)): "
                                         f"reward.timeout_s={timeout_s:g} is the deadline of every call",
                                         "needs_main_thread")
            raise self._sample_error(index, row, f"raised {type(exc).__name__}: {exc}", "raised")
        try:
            return check_result(outcome.value)
        except ValueError as bad:
            raise self._sample_error(index, row, f"returned {_short(outcome.value)}: {bad}", "bad_value") from None

    def _sample_error(self, index: int, row: dict, cause: str, kind: str) -> RewardFunctionError:
        where = f"sample {index}" + (f" (prompt {_short(row['prompt'], 60)})" if "prompt" in row else "")
        if self.batched:
            where += " in a batched call"
        return RewardFunctionError(f"reward function {self.reference!r} ({self.key}) on {where}: {cause}",
                                   function=self.reference, sample=index, kind=kind)


def _needs_main_thread(exc: BaseException) -> bool:
    """Whether `exc` is Python's refusal of a signal handler off the main thread (or math-verify's
    rewording of it)."""
    text = str(exc)
    return isinstance(exc, ValueError) and ("main thread" in text or "threaded environment" in text)


def batched_reward(fn):
    """Mark `fn` as batched (lists in, one list out), for the `reward.fn=file.py:name` shorthand.

    Same as `batched: true` in a `reward.functions` entry. Without importing hybridflow, a
    reward file can set the attribute itself: `fn.reward_batched = True`.
    """
    fn.reward_batched = True
    return fn


def _bind(fn: Callable, kwargs: dict[str, Any]) -> Callable[[], Any]:
    return lambda: fn(**kwargs)


def _number(value: Any) -> float | None:
    """A plain float from a Python/numpy/torch number (bools count as 0/1); None if not a number."""
    if isinstance(value, numbers.Real):  # int, float, bool, numpy floats and ints
        return float(value)
    item = getattr(value, "item", None)  # 1-element torch tensors and numpy arrays, numpy bools
    if callable(item):
        try:
            inner = item()
        except (TypeError, ValueError, RuntimeError):
            return None
        return float(inner) if isinstance(inner, numbers.Real) else None
    return None


def check_result(value: Any) -> tuple[float, dict[str, float]]:
    """(score, extras) from a returned float or `{'score': ..., <extra>: ...}`; ValueError says why not."""
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"a dict without 'score' (keys {sorted(map(str, value))}); return "
                             "{'score': <number>, <extra metric>: <number>, ...}")
        extras = {}
        for key, item in value.items():
            number = _number(item)
            if not isinstance(key, str) or number is None or not math.isfinite(number):
                what = "score" if key == "score" else f"extra {key!r}"
                raise ValueError(f"its {what} is {_short(item)}, not a finite number")
            extras[key] = number
        return extras.pop("score"), extras
    number = _number(value)
    if number is None:
        if inspect.isawaitable(value):
            getattr(value, "close", lambda: None)()  # never awaited: close it quietly
            raise ValueError("an awaitable; an async function must be defined with 'async def' to be awaited")
        raise ValueError(f"a {type(value).__name__}; a reward function returns a finite number or a dict "
                         "with a numeric 'score'")
    if not math.isfinite(number):
        raise ValueError("not a finite number")
    return number, {}
