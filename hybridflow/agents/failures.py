"""The environment-failure guard: an agent rollout whose environment broke stops the run, named.

A step's batch counts its environment failures (timeouts and exceptions that are not the model's
call's fault; hybridflow/agents/environment.py). The first one a run meets is said on the console with
its message; a step whose share of failed environment steps passes `rollout.max_env_failure_fraction`
stops the run with the count, the agents and their first errors, and the fix (1.0: never stops).
"""

from __future__ import annotations

from collections import Counter

from hybridflow.output import console
from hybridflow.batch import Batch


class EnvironmentFailureError(RuntimeError):
    """Too many of a step's environment steps failed on the environment's side."""


def failure_summary(samples: Batch, shown: int = 3) -> str:
    """The distinct first failures of a batch's samples, the commonest first, each with its count."""
    counts = Counter(m for m in samples.objects.get("agent_failure", []) if m)
    return "; ".join(f"{message} ({n} sample{'s' if n > 1 else ''})" for message, n in counts.most_common(shown))


class EnvFailureGuard:
    def __init__(self, max_fraction: float) -> None:
        self.max_fraction, self.said = max_fraction, False

    def check(self, step: int, samples: Batch, metrics: dict[str, float]) -> None:
        """Says the run's first environment failure; raises past the limit. `metrics` holds the step's
        `agent/env_failures` and `agent/env_failure_fraction` (absent for a batch no agent rolled out)."""
        failures, fraction = metrics.get("agent/env_failures", 0.0), metrics.get("agent/env_failure_fraction", 0.0)
        if not failures:
            return
        where = (f"step {step}: {failures:g} environment step(s) failed on the environment's side "
                 f"({fraction:.1%} of the step's environment calls): {failure_summary(samples)}")
        if fraction > self.max_fraction:
            raise EnvironmentFailureError(
                f"{where}; more than rollout.max_env_failure_fraction={self.max_fraction:g}, so the run stops rather "
                "than train on a broken environment's error observations. Fix the environment or its server (a "
                "call the model got wrong should raise ValueError, which the model learns from), or raise "
                "rollout.max_env_failure_fraction (1.0: never stop)")
        if not self.said:
            console.say(f"hybridflow: {where}; the model reads them as error observations; the run stops past "
                        f"rollout.max_env_failure_fraction={self.max_fraction:g} (agent/env_failure_fraction)")
            self.said = True
