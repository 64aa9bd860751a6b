"""`<role>.optim.fused`: the AdamW the actor and the critic step with, as a user's override reaches them
(compose -> the role's builder -> its `start`). PyTorch's fused AdamW on the CPU is opt-in (null: fused
on CUDA only); bench/optimizer_step.py times the two (docs/results/performance.md "The optimizer step")."""

from __future__ import annotations

import pytest

from hybridflow.config import compose
from hybridflow.controller import WorkerContext
from hybridflow.run.stage import prepare_stage
from recipes.roles import actor_role, critic_role


@pytest.mark.parametrize("value, fused", [(None, False), ("true", True), ("false", False)])
def test_the_actor_and_the_critic_step_with_the_adamw_their_optim_fused_names(tiny_model_dir, value, fused):
    overrides = [] if value is None else [f"actor.optim.fused={value}", f"critic.optim.fused={value}"]
    config = prepare_stage(compose(["recipe=ppo", *overrides])).config
    for role in (actor_role, critic_role):
        worker = role(config, tiny_model_dir).build(WorkerContext())
        worker.start()
        assert bool(worker.optimizer.defaults["fused"]) is fused, (role.__name__, value)


def test_a_fused_value_that_is_not_a_boolean_is_refused_naming_the_override():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="actor.optim.fused=sometimes"):
        compose(["recipe=grpo", "actor.optim.fused=sometimes"])
