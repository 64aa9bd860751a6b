"""The config's checks are functions that return problems and never change what they check
(hybridflow/checks/rules.py): each is given a frozen copy of the configs users run — every recipe, the
placements, LoRA, an async depth, one that breaks a plan rule — which raises on any assignment."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import pytest

from hybridflow.checks.rules import config_problems, plan_problems, resolved
from hybridflow.config import compose
from hybridflow.config.schema import plain
from hybridflow.planning.auto import decide_plan


def _refuse(self, name, value=None):
    raise AttributeError(f"a check assigned {type(self).__name__}.{name}")


def frozen(value):
    """A copy of `value` whose dataclasses raise on assignment, whose dicts are read-only and lists tuples."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        locked = type(f"Frozen{cls.__name__}", (cls,), {"__setattr__": _refuse, "__delattr__": _refuse})
        copy = object.__new__(locked)
        for f in dataclasses.fields(value):
            object.__setattr__(copy, f.name, frozen(getattr(value, f.name)))
        return copy
    if isinstance(value, dict):
        return MappingProxyType({k: frozen(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(frozen(v) for v in value)
    return value


FOUR = "placement.pools.global.devices_per_node=4"
CONFIGS = [
    [], ["recipe=grpo"], ["recipe=ppo"], ["recipe=dpo"], ["recipe=sft"], ["recipe=pretrain"], ["recipe=evaluate"],
    ["recipe=grpo", "placement=disaggregated", "trainer.max_staleness=2", "trainer.old_log_probs=actor"],
    ["recipe=grpo", "placement=local"], ["recipe=grpo", "actor.lora.rank=8"],
    ["recipe=grpo", FOUR, "rollout.tensor_parallel_size=3"],  # a plan rule broken: its problem is returned
]


@pytest.mark.parametrize("overrides", CONFIGS, ids=lambda o: " ".join(o) or "default")
def test_the_checks_return_problems_and_change_nothing(overrides):
    config = compose(overrides)
    before = plain(config)
    locked = frozen(config)
    assert config_problems(locked) == []  # composed: what the config alone shows is already right
    problems = [] if config.recipe.name == "pipeline" else plan_problems(locked, decide_plan(config).plan)
    assert (problems != []) == ("rollout.tensor_parallel_size=3" in overrides)
    assert plain(config) == before
    assert resolved(config) is not config and plain(config) == before  # a copy, never the config itself


def test_a_frozen_copy_refuses_an_assignment():
    config = frozen(compose(["recipe=grpo"]))
    with pytest.raises(AttributeError, match="a check assigned FrozenModelConfig.dtype"):
        config.model.dtype = None
    with pytest.raises(TypeError):
        config.placement.pools["other"] = None
