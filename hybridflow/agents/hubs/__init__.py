"""Environments from the hubs, trained unchanged (docs/agents.md "Environments from the hubs" and
"OpenEnv environments"). Two shapes, by what the hub's environment owns:

- one that is reset and stepped (OpenEnv: openenv_env.py, `rollout.agent=openenv:<target>`,
  `rollout.openenv.*`): an agent like any other (hybridflow/agents/environment.py's `reset(**row)` /
  `step(response)`), so the turn loop, the token-faithful trajectories and the failure guard are the
  ones every agent rollout uses; its server's lifetime is the run's (openenv_server.py);
- one that owns its tasks, turn logic and rubric (verifiers), described below.

`rollout.environment=<hub>:<id>` names one, `rollout.environment_args` its load arguments. Each hub
is one class (STYLE 18) registered here by name, built in the rollout worker's process; the rollout
serves the model to it through the OpenAI-compatible endpoint (hybridflow/agents/endpoint.py), and
every sample's trajectory is the ids the engine sampled. A hub class provides:

    Hub(environment_id: str, arguments: dict)              load and check; errors name the key and the fix
    hub.rows(limit: int | None) -> list[dict]              its tasks as data rows (`prompt` + its columns)
    hub.rollout(prompts, endpoint, phase) -> Batch         the rows' episodes, as the agent rollout's batch

The table of hubs (`ENVIRONMENT_HUBS`, hybridflow/config/references.py) names each class by import
path, so the config schema checks a name without importing a hub's package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridflow.agents.trajectory import GenerateFn
from hybridflow.config.references import ENVIRONMENT_HUBS, check_environment
from hybridflow.registry import load_object


@dataclass
class Phase:
    """What a rollout worker hands a hub for one generation phase."""

    version: int  # the policy version the engine serves: the endpoint refuses calls after the phase
    seeds: list[int | None]  # per sample (`sample_seed`), None: unseeded (greedy)
    generate: GenerateFn  # the engine
    temperature: float  # what it samples at (0: greedy)
    budget: int  # rollout.max_response_tokens: every token after a sample's first prompt
    max_prompt_tokens: int  # data.max_prompt_tokens: the width of the prompt tensors
    pad_token_id: int
    tokenizer: Any


def load_hub_environment(value: str, arguments: dict[str, Any]):
    """The hub environment `value` ('<hub>:<id>', checked by the schema) names, loaded with `arguments`."""
    hub, _, ident = check_environment(value).partition(":")
    return load_object(ENVIRONMENT_HUBS[hub])(ident, dict(arguments or {}))
