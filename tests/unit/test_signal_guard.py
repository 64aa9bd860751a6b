"""The no-signal guard (hybridflow/training/signal.py): the rule, the streak, the line and the stop."""

from __future__ import annotations

import pytest

from hybridflow.training.signal import NoSignalError, SignalGuard, step_has_signal


@pytest.mark.parametrize("metrics, expected", [
    ({"reward/score": 0.0, "reward/score_std": 0.0}, False),  # every sample the same
    ({"reward/score": 0.5, "reward/score_std": 0.5, "advantages/zero_std_fraction": 1.0}, False),  # groups flat
    ({"reward/score": 0.5, "reward/score_std": 0.5, "advantages/zero_std_fraction": 0.75}, True),
    ({"reward/score": 0.5, "reward/score_std": 0.1}, True),  # PPO: no group statistic, the batch varies
])
def test_a_step_has_signal_when_some_samples_score_differently(metrics, expected):
    assert step_has_signal(metrics) is expected


def test_the_streak_is_counted_said_once_and_stops_the_run_at_the_limit(capsys):
    guard = SignalGuard(3, "reward.fn=my.py:score")
    flat = {"reward/score": 0.0, "reward/score_std": 0.0, "reward/answer_found": 0.0}
    varied = {"reward/score": 0.4, "reward/score_std": 0.3}
    for metrics, streak in [(dict(flat), 1), (dict(varied), 0), (dict(flat), 1), (dict(flat), 2)]:
        guard.observe(metrics)
        guard.enforce(metrics)
        assert metrics["guard/steps_without_signal"] == streak
    said = capsys.readouterr().out
    assert said.count("no learning signal") == 1 and "every sample scored 0" in said
    assert "reward.fn=my.py:score" in said and "reward/answer_found = 0" in said
    last = dict(flat)
    guard.observe(last)
    with pytest.raises(NoSignalError, match=r"3 step\(s\) in a row.*trainer.max_steps_without_signal=3"):
        guard.enforce(last)


def test_null_keeps_the_line_and_the_metric_and_never_stops(capsys):
    guard = SignalGuard(None, "reward.fn=exact_match")
    for _ in range(10):
        metrics = {"reward/score": 1.0, "reward/score_std": 0.0}
        guard.observe(metrics)
        guard.enforce(metrics)
    assert metrics["guard/steps_without_signal"] == 10
    assert "trainer.max_steps_without_signal=null: the run goes on" in capsys.readouterr().out
