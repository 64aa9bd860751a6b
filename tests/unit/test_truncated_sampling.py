"""Truncated sampling bias (issue 87): a recipe that trains on its samples refuses rollout.top_p < 1 and
rollout.top_k, before anything starts; a recipe that only scores its samples keeps them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hybridflow.config import ConfigError, compose


@pytest.mark.parametrize("recipe", ["grpo", "ppo"])
@pytest.mark.parametrize("truncation, shown", [("rollout.top_p=0.7", r"\(0.7, -1\)"),
                                                ("rollout.top_k=20", r"\(1.0, 20\)")])
def test_a_training_recipe_refuses_truncated_sampling_naming_the_keys_and_the_fix(recipe, truncation, shown):
    with pytest.raises(ConfigError, match=rf"rollout.top_p/top_k={shown} is invalid: recipe={recipe} trains on its "
                                          r"samples.*truncated sampling bias.*set rollout.top_p=1.0 rollout.top_k=-1"):
        compose([f"recipe={recipe}", truncation])


def test_evaluation_keeps_truncated_sampling():
    config = compose(["recipe=evaluate", "rollout.top_p=0.7", "rollout.top_k=20"])
    assert (config.rollout.top_p, config.rollout.top_k) == (0.7, 20)


def test_top_k_zero_is_refused_with_the_values_that_mean_something():
    with pytest.raises(ConfigError, match=r"rollout.top_k.*0.*-1 \(the whole vocabulary\) or >= 1"):
        compose(["rollout.top_k=0"])


def test_the_cli_refuses_it_before_ray_starts(tmp_path):
    """As a user runs it: the command fails in the config check, and no Ray session was started."""
    run = subprocess.run([sys.executable, "-m", "hybridflow.cli", "recipe=grpo", "rollout.top_p=0.7",
                          f"logger.output_root={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "truncated sampling bias" in run.stderr + run.stdout
    assert "ray.init" not in run.stderr and "Started a local Ray instance" not in run.stderr
    assert not any(tmp_path.rglob("metrics.jsonl"))
