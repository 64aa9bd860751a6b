"""The checks an RL step's numbers pass once they are logged (docs/reliability.md "Runs that train
silently wrong"): one object, so the step loop makes two calls.

- `FirstBatchParity` (hybridflow/resharding/parity.py): the first batch's sampler-vs-actor gap;
- `SignalGuard` (hybridflow/training/signal.py): a reward that scores every sample alike;
- `EnvFailureGuard` (hybridflow/agents/failures.py): an agent rollout whose environment broke;
- `StallNote` (hybridflow/training/resolution.py): updates below the 16-bit copy's resolution (a line).
"""

from __future__ import annotations

from pathlib import Path

from hybridflow.agents.failures import EnvFailureGuard
from hybridflow.resharding.parity import FirstBatchParity
from hybridflow.training.resolution import StallNote
from hybridflow.training.signal import SignalGuard


class StepGuards:
    def __init__(self, parity: FirstBatchParity, signal: SignalGuard, environments: EnvFailureGuard,
                 stall: StallNote) -> None:
        self.parity, self.signal, self.environments, self.stall = parity, signal, environments, stall

    @classmethod
    def from_config(cls, config, model_dir: str | Path) -> StepGuards:
        return cls(FirstBatchParity.from_config(config, model_dir), SignalGuard.from_config(config),
                   EnvFailureGuard(config.rollout.max_env_failure_fraction), StallNote.from_config(config))

    def observe(self, metrics: dict[str, float]) -> None:
        """Before the step is logged: the guards' own metrics (`guard/steps_without_signal`)."""
        self.signal.observe(metrics)

    def check(self, step: int, samples, metrics: dict[str, float]) -> None:
        """After the step is logged (its numbers kept whatever stops the run): each guard raises or says."""
        self.parity.check(metrics)
        self.signal.enforce(metrics)
        self.environments.check(step, samples, metrics)
        self.stall.check(metrics)  # once a run: an update that hardly moved the weights the policy computes with
