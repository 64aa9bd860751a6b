"""Multi-turn agent rollouts: the model writes, a tool or an environment answers, the model
reads the answer and writes again, and the whole trajectory is rewarded on its outcome.

What a user writes (docs/agents.md):
  - tools: plain typed Python functions with a docstring, called by the model as
    `<name>arguments</name>` and answered with `<result>text</result>` (tools.py);
  - or an environment class: `reset(**row)` -> first observation, `step(response)` ->
    (observation, reward, done) (environment.py).
Both are named in `rollout.agent` like reward functions ('path/to/file.py:Name' or
'package.module:Name') and loaded by `load_agents`; with several, a data column
(`rollout.agent_column`) picks one per row.

Token in, token out (trajectory.py): a trajectory is kept as token ids. The model's tokens are
appended exactly as sampled, with their sampler log-probs, and are never decoded and re-encoded;
only observations are encoded. The loss mask is True on the model's tokens only.

Agents written for the OpenAI client reach the engine through an OpenAI-compatible endpoint that keeps
the same promise (endpoint.py), and environments from the hubs (`rollout.environment`, hubs/) run
through it unchanged.
"""

from hybridflow.agents.environment import AgentError, Environment, call_with_row
from hybridflow.agents.loading import AgentSet, load_agents
from hybridflow.agents.tools import Tool, ToolEnvironment, tool_environment
from hybridflow.agents.trajectory import Trajectory, agent_metrics, run_trajectories, trajectories_to_batch

__all__ = ["AgentError", "AgentSet", "Environment", "Tool", "ToolEnvironment", "Trajectory", "agent_metrics",
           "call_with_row", "load_agents", "run_trajectories", "tool_environment", "trajectories_to_batch"]
