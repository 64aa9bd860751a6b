"""Tools: plain typed Python functions the model calls by writing `<name>arguments</name>`.

    def calc(expression: str) -> str:
        \"\"\"Evaluate an arithmetic expression of integers with + - * and parentheses.\"\"\"
        ...

A model turn ends when it writes a tool's closing tag (`</calc>`); the text between the tags
is the argument. A one-parameter tool receives it converted to its annotation (str, int,
float); a tool of several parameters receives a JSON object of them. The model then reads
`<result>text</result>` and writes its next turn; a turn without a tool call is the final answer
and ends the trajectory. The function must return a str: a tool that raises, hangs past
`rollout.tool_timeout_s` or returns anything else answers `<result>error: ...</result>` and is
counted in `agent/tool_errors`.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from typing import Any, Callable

RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"
ERROR_MESSAGE_CHARS = 60  # observations cost tokens of the trajectory's budget: errors say the cause, briefly
_CONVERTERS = {str: str, int: int, float: float, inspect.Parameter.empty: str, "str": str, "int": int, "float": float}


@dataclass(frozen=True)
class Tool:
    """One function as the model sees it: its name (the tag), parameters and docstring."""

    fn: Callable[..., Any]
    name: str
    parameters: tuple[inspect.Parameter, ...]
    doc: str

    @classmethod
    def of(cls, fn: Callable[..., Any], reference: str = "") -> "Tool":
        where = reference or getattr(fn, "__qualname__", repr(fn))
        if not callable(fn) or inspect.isclass(fn):
            raise TypeError(f"tool {where!r} is a {type(fn).__name__}, not a function")
        params = tuple(inspect.signature(fn).parameters.values())
        bad = [p.name for p in params if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY)]
        if not params or bad:
            raise TypeError(f"tool {where!r} must take named parameters (got {bad or 'none'}); e.g. "
                            "def calc(expression: str) -> str")
        unknown = [p.name for p in params if p.annotation not in _CONVERTERS]
        if unknown:
            raise TypeError(f"tool {where!r}: parameters {unknown} need an annotation of str, int or float "
                            "(the model writes text; the tool receives it converted)")
        return cls(fn, fn.__name__, params, inspect.getdoc(fn) or "")

    def arguments(self, text: str) -> dict[str, Any]:
        """The call's keyword arguments from the text between the tags."""
        if len(self.parameters) == 1:
            p = self.parameters[0]
            return {p.name: _CONVERTERS[p.annotation](text.strip())}
        values = json.loads(text)
        if not isinstance(values, dict):
            raise ValueError(f"tool {self.name} takes a JSON object of {[p.name for p in self.parameters]}")
        return {p.name: _CONVERTERS[p.annotation](values[p.name]) for p in self.parameters if p.name in values}

    def __call__(self, text: str) -> str:
        result = self.fn(**self.arguments(text))
        if not isinstance(result, str):
            raise TypeError(f"tool {self.name} returned {type(result).__name__} {result!r:.40}, not a str")
        return result


class ToolEnvironment:
    """The environment of a set of tools: a turn that ends in a call gets the tool's result, a
    turn without one is the final answer. Rewards come from the reward functions (outcome)."""

    def __init__(self, tools: dict[str, Tool]) -> None:
        self.tools = tools
        self.stop = tuple(f"</{name}>" for name in tools)

    def reset(self, **_: Any) -> None:
        return None

    def step(self, response: str) -> tuple[str | None, float, bool]:
        call = self.parse_call(response)
        if call is None:
            return None, 0.0, True
        name, text = call
        return f"{RESULT_OPEN}{self.tools[name](text)}{RESULT_CLOSE}", 0.0, False

    def parse_call(self, response: str) -> tuple[str, str] | None:
        """(tool name, argument text) when the turn ends in `<name>...</name>`, else None."""
        for name in self.tools:
            close = f"</{name}>"
            if response.rstrip().endswith(close):
                body = response.rstrip()[: -len(close)]
                start = body.rfind(f"<{name}>")
                if start < 0:
                    raise ValueError(f"the call ends in {close} but has no <{name}>")
                return name, body[start + len(name) + 2:]
        return None

    def error_observation(self, message: str) -> str:
        return f"{RESULT_OPEN}error: {message[:ERROR_MESSAGE_CHARS]}{RESULT_CLOSE}"


def tool_environment(tools: list[Tool]) -> Callable[[], ToolEnvironment]:
    """A factory of environments (one per trajectory) over `tools`."""
    by_name = {t.name: t for t in tools}
    return lambda: ToolEnvironment(by_name)
