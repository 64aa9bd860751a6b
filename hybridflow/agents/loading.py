"""`rollout.agent`: references to tools and environment classes, loaded into one AgentSet.

Each reference names a function (a tool), a list of functions (tools), or a class (an
environment), or is `openenv:<target>`, an OpenEnv environment (hybridflow/agents/hubs). The tools
together form one agent called `tools`; each environment class is an agent called by its class name,
an OpenEnv environment the agent `openenv`. With one agent every row uses it; with several, the row's
`rollout.agent_column` column names the agent.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

from hybridflow.agents.environment import AgentError
from hybridflow.agents.hubs.openenv_env import OPENENV_AGENT
from hybridflow.agents.hubs.openenv_server import openenv_agent
from hybridflow.config.schema import OpenEnvConfig
from hybridflow.agents.tools import Tool, tool_environment

TOOLS_AGENT = "tools"
OPENENV_PREFIX = "openenv:"  # an OpenEnv environment (hybridflow/agents/hubs/openenv_env.py)


@dataclass
class AgentSet:
    factories: dict[str, Callable[[], Any]]  # agent name -> a new environment
    column: str

    def make(self, row: dict[str, Any], sample: int) -> tuple[str, Any]:
        """(agent name, a new environment) for one data row."""
        if len(self.factories) == 1:
            name = next(iter(self.factories))
        else:
            name = row.get(self.column)
            if name not in self.factories:
                raise AgentError(f"sample {sample}: column {self.column!r} (rollout.agent_column) is {name!r}; with "
                                 f"several agents in rollout.agent each row names one of {sorted(self.factories)}")
        return name, self.factories[name]()


def load_agents(references: list[str], column: str = "agent", openenv: Any = None,
                timeout_s: float = 10.0) -> AgentSet:
    """`openenv`: rollout.openenv (hybridflow.config.schema.OpenEnvConfig) for an `openenv:<target>`
    reference; `timeout_s`: rollout.tool_timeout_s, which bounds each of its calls."""
    from hybridflow.registry import load_object

    tools: list[Tool] = []
    factories: dict[str, Callable[[], Any]] = {}
    for reference in references:
        if reference.startswith(OPENENV_PREFIX):
            factories[OPENENV_AGENT] = openenv_agent(reference[len(OPENENV_PREFIX):], openenv or OpenEnvConfig(),
                                                     timeout_s)
            continue
        try:
            obj = load_object(reference)
        except Exception as exc:  # noqa: BLE001 - whatever the import raised, name the reference and key
            raise AgentError(f"rollout.agent: {reference!r} does not load: {exc}") from exc
        if inspect.isclass(obj):
            missing = [m for m in ("reset", "step") if not callable(getattr(obj, m, None))]
            if missing:
                raise AgentError(f"rollout.agent: environment {reference!r} has no {missing}; an environment "
                                 "defines reset(**row) -> str | None and step(response) -> (observation, reward, done)")
            factories[obj.__name__] = obj
        else:
            try:
                tools += [Tool.of(fn, reference) for fn in (obj if isinstance(obj, (list, tuple)) else [obj])]
            except TypeError as exc:
                raise AgentError(f"rollout.agent: {exc}") from None
    if tools:
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise AgentError(f"rollout.agent: tool names {names} repeat; each tool's function name is its tag")
        factories[TOOLS_AGENT] = tool_environment(tools)
    return AgentSet(factories, column)
