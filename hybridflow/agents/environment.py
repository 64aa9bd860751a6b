"""The environment protocol, and calling user code with a data row's columns.

An environment is a class; one instance serves one trajectory:

    class Guess:
        stop = ("?",)                        # texts that end a model turn (besides EOS)
        def reset(self, ground_truth, **_):  # the data row's columns, by name
            self.answer = ground_truth
            return None                      # first observation (text after the prompt), or None
        def step(self, response):            # the text of the model's last turn
            return "higher", 0.0, False      # (observation | None, reward, done)

`reset` takes the columns it names (all of them with `**kwargs`), as reward functions do. An
optional `close()` is called when the trajectory ends, whatever ended it (an OpenEnv session ends so). The
rewards of a trajectory's steps are summed into `agent_reward`, which reward functions may name.
A `step` that raises, hangs past `rollout.tool_timeout_s` or returns something else than
(str | None, number, bool) is an error: the model reads `error_observation(message)` (the
class's own, or "error: <message>") and the error is counted in `agent/tool_errors`.

Two kinds of error, told apart by what was raised (`is_call_error`): a **call error** — the model's
call was wrong: a ValueError (json's decode error included), TypeError or LookupError — is part of
what the model learns from; an **environment failure** — a timeout, or anything else raised (a server
gone: ConnectionError, OSError; a bug: RuntimeError, AttributeError) — is not the model's doing, and
a run trained on its error observations learns from a broken environment (UniRL PR #214). Environment
failures are counted (`agent/env_failures`, `agent/env_failure_fraction`), the first one said on the
console, and a step where more than `rollout.max_env_failure_fraction` of the environment steps
failed stops the run, naming the agent and the error (hybridflow/agents/failures.py). An environment
raises ValueError for a call the model got wrong.
"""

from __future__ import annotations

import inspect
import numbers
from typing import Any, Protocol


class AgentError(ValueError):
    """An agent that cannot run at all (it does not load, or its `reset` fails): names the agent,
    the sample and the fix. Errors during steps never raise; they become error observations."""


class Environment(Protocol):
    stop: tuple[str, ...]

    def reset(self, **row: Any) -> str | None: ...

    def step(self, response: str) -> tuple[str | None, float, bool]: ...


def call_with_row(fn, row: dict[str, Any]) -> Any:
    """`fn(**columns)` with only the columns `fn` names (all of them when it takes `**kwargs`)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return fn(**row)
    return fn(**{p.name: row[p.name] for p in params if p.name in row})


CALL_ERRORS = (ValueError, TypeError, LookupError)  # the model's call was wrong (the module docstring)


def is_call_error(error: BaseException | None) -> bool:
    """Whether a failed step's exception blames the model's call rather than the environment."""
    return isinstance(error, CALL_ERRORS)


def failure_kind(error: BaseException | None, timed_out: bool = False) -> str:
    """The kind of an environment failure, its `env/errors/<kind>` count: timeout, connection (a server
    gone: ConnectionError), the `kind` an adapter's exception carries (hybridflow/agents/hubs), else exception."""
    if timed_out:
        return "timeout"
    kind = getattr(error, "kind", None)
    if isinstance(kind, str) and kind:
        return kind
    return "connection" if isinstance(error, ConnectionError) else "exception"


def error_observation(env: Any, message: str) -> str:
    """What the model reads after a failed step: the environment's own wording when it has one."""
    own = getattr(env, "error_observation", None)
    return own(message) if callable(own) else f"error: {message}"


def check_step_result(result: Any, name: str) -> tuple[str | None, float, bool]:
    """The (observation, reward, done) of one step, or a TypeError naming what was wrong."""
    if not (isinstance(result, tuple) and len(result) == 3):
        raise TypeError(f"{name}.step returned {_short(result)}; return (observation: str | None, reward: float, "
                        "done: bool)")
    observation, reward, done = result
    if observation is not None and not isinstance(observation, str):
        raise TypeError(f"{name}.step returned the observation {_short(observation)} "
                        f"({type(observation).__name__}); return a str or None")
    if not isinstance(reward, numbers.Real) or isinstance(reward, bool) or reward != reward:
        raise TypeError(f"{name}.step returned the reward {_short(reward)}; return a finite number")
    return observation, float(reward), bool(done)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
