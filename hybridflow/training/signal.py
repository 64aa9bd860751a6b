"""A run whose reward gives the update nothing to learn from: the no-signal guard.

A reward that scores every sample the same (a function that returns 0, an answer extractor that never
finds an answer, a reward model that saturates) makes every advantage 0: the run trains on with
gradient norm 0 and every metric plausible (issue 87). A step has **no signal** when

  - every sample of the batch scored the same (`reward/score_std` = 0), or
  - the estimator is group-relative and every group's samples scored the same
    (`advantages/zero_std_fraction` = 1: GRPO's advantages are all 0, whatever the groups' levels).

The guard says so on the console at the first such step, counts consecutive ones in
`guard/steps_without_signal`, and stops the run when the count reaches `trainer.max_steps_without_signal`
(null: the console line and the metric only). One step without signal is common early on a hard task;
several in a row mean the reward, not the policy.
"""

from __future__ import annotations

from hybridflow.output import console

class NoSignalError(RuntimeError):
    """The reward gave no learning signal for trainer.max_steps_without_signal steps in a row."""


def step_has_signal(metrics: dict[str, float]) -> bool:
    """Whether a step's metrics show a reward the update can learn from (the module docstring's rule)."""
    if metrics.get("reward/score_std", 1.0) == 0.0:
        return False
    return metrics.get("advantages/zero_std_fraction", 0.0) < 1.0


def no_signal_message(streak: int, metrics: dict[str, float], reward: str, limit: int | None) -> str:
    found = metrics.get("reward/answer_found")
    why = (f"every sample scored {metrics['reward/score']:g}" if metrics.get("reward/score_std", 1.0) == 0.0
           else f"every group's samples scored alike (advantages/zero_std_fraction = 1; mean score "
                f"{metrics['reward/score']:g})")
    clue = ("; no response had an answer the reward could find (reward/answer_found = 0): check the answer "
            "format the prompts ask for against what the reward extracts") if found == 0.0 else ""
    stop = (f"the run stops at {limit} such steps in a row (trainer.max_steps_without_signal={limit}; null: "
            "only this line)") if limit else "trainer.max_steps_without_signal=null: the run goes on"
    return (f"hybridflow: no learning signal for {streak} step(s) in a row: {why}, so every advantage is 0 and "
            f"the update learns nothing from reward {reward}{clue}; {stop}")


class SignalGuard:
    """Counts consecutive steps without signal; says the first, stops the run at the limit."""

    def __init__(self, max_steps: int | None, reward: str) -> None:
        self.max_steps, self.reward = max_steps, reward
        self.streak, self.said = 0, False

    @classmethod
    def from_config(cls, config) -> SignalGuard:
        r = config.reward
        reward = (f"reward.fn={r.fn}" if r.fn else "reward.functions" if r.functions
                  else f"reward.reward_model.path={r.reward_model.path}")
        return cls(config.trainer.max_steps_without_signal, reward)

    def observe(self, metrics: dict[str, float]) -> None:
        """Adds `guard/steps_without_signal` to the step's metrics (before they are logged)."""
        self.streak = 0 if step_has_signal(metrics) else self.streak + 1
        metrics["guard/steps_without_signal"] = float(self.streak)
        if self.streak and not self.said:
            console.say(no_signal_message(self.streak, metrics, self.reward, self.max_steps))
            self.said = True

    def enforce(self, metrics: dict[str, float]) -> None:
        """Raises NoSignalError once the streak reaches the limit (after the step was logged)."""
        if self.max_steps and self.streak >= self.max_steps:
            raise NoSignalError(no_signal_message(self.streak, metrics, self.reward, self.max_steps))
