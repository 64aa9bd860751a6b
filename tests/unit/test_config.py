"""Every YAML under conf/ composes; bad keys and values fail before Ray starts."""

from __future__ import annotations

import re

import pytest
from hydra.errors import ConfigCompositionException

from hybridflow.run.pipeline_stages import compose_command
from hybridflow.config import CONF_DIR, ConfigError, compose
from hybridflow.planning.plan import Plan

GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir())
REQUIRED_VALUES = {  # options whose '???' values a user must supply
    "model/local_hf": ["model.path=/some/model"],
    "data/files": ["data.train_path=/a.jsonl", "data.val_path=/b.jsonl"],
    "recipe/grpo_gsm8k": ["model.path=/some/model", "data.train_path=/a.parquet", "data.val_path=/b.parquet"],
    "recipe/distill": ["teacher.path=/some/teacher"],
}


def group_options():
    for group in GROUPS:
        for path in sorted((CONF_DIR / group).glob("*.yaml")):
            yield group, path.stem


@pytest.mark.parametrize("group,option", list(group_options()))
def test_every_yaml_composes(group, option):
    overrides = [f"{group}={option}", *REQUIRED_VALUES.get(f"{group}/{option}", [])]
    config = compose(overrides)
    assert config.recipe.name


def test_groups_cover_the_design():
    assert {"recipe", "model", "data", "algorithm", "rollout", "reward", "placement", "logger"} <= set(GROUPS)


def test_defaults_and_overrides_are_typed():
    config = compose(["rollout=hf", "rollout.temperature=0.5", "placement=split"])
    assert config.rollout.backend == "hf" and config.rollout.temperature == 0.5
    assert config.placement.roles["critic"] == "critic"


@pytest.mark.parametrize("override,expected", [
    (["model.no_such_key=1"], "model.no_such_key"),
    (["rollout.max_response_tokens=many"], "rollout.max_response_tokens"),
])
def test_unknown_keys_and_bad_types_fail_in_composition(override, expected):
    with pytest.raises(ConfigCompositionException, match=expected.replace(".", r"\.")) as info:
        compose(override)
    cause = str(info.value.__cause__)
    assert any(s in cause for s in ("not in", "Invalid value", "could not be converted"))


def test_an_unknown_rollout_engine_is_refused_naming_the_registered_ones():
    with pytest.raises(ValueError, match=re.escape("config rollout.backend='sglang' is invalid: one of ['exact', 'hf', 'vllm'], "
                                                   "or 'package.module:NAME' naming a RolloutEngine")):
        compose(["rollout.backend=sglang"])
    with pytest.raises(ValueError, match=r"rollout.backend='hybridflow.config.engines:ROLLOUT_ENGINES' is invalid: "
                                         r"hybridflow.config.engines:ROLLOUT_ENGINES is a Registry, not a RolloutEngine"):
        compose(["rollout.backend=hybridflow.config.engines:ROLLOUT_ENGINES"])


@pytest.mark.parametrize("override,message", [
    (["rollout.temperature=-1"], r"rollout.temperature=-1.0 is invalid: must be >= 0"),
    (["placement.roles.actor=nowhere"], r"placement.roles.actor='nowhere' is invalid: must name a pool in placement.pools: \['global'\]"),
    (["recipe.name=nope"], r"recipe.name='nope' is invalid: built-in recipes are"),
    (["data.train_path=/x.jsonl"], r"data.train_path/val_path"),
    (["logger.backends=[console,carrier_pigeon]"], r"logger.backends"),
    (["data.synthetic.operations=[pow]"], r"data.synthetic.operations"),
    (["recipe=grpo", "trainer.critic_warmup_steps=5"],
     r"trainer.critic_warmup_steps=5 is invalid: only a run with a critic \(algorithm.use_critic=true\)"),
    (["trainer.critic_warmup_steps=-1"], r"trainer.critic_warmup_steps=-1 is invalid: must be >= 0"),
    # data=files' prompt length on the tiny model: refused here, not by the engine after every worker started
    (["recipe=sft", "data=files", "data.train_path=/x.jsonl", "data.val_path=/y.jsonl"],
     r"data.max_prompt_tokens=512 is invalid: with rollout.max_response_tokens=8 that is 520 tokens, more than the "
     r"tiny model holds \(model.tiny.max_position_embeddings=256.*lower data.max_prompt_tokens to at most 248"),
])
def test_cross_field_rules_name_key_value_and_fix(override, message):
    with pytest.raises(ConfigError, match=message):
        compose(override)


def test_the_main_command_runs_the_default_pipeline():
    config = compose([])
    assert config.recipe.name == "pipeline"
    assert [s.recipe for s in config.pipeline.stages] == ["sft", "grpo"]
    assert config.pipeline.stages[1].init.name == "pma_sma" and config.pipeline.stages[1].evaluate_init


def test_a_bad_override_in_a_later_pipeline_stage_fails_before_any_stage_runs(tmp_path):
    from hybridflow.config.schema import StageConfig
    from recipes.pipeline import check_stages

    config = compose(["recipe=pipeline"])
    check_stages(config, tmp_path)  # the shipped pipeline composes
    config.pipeline.stages = [StageConfig(name="sft", recipe="sft"),
                              StageConfig(name="grpo", recipe="grpo", overrides=["actor.optim.lr=-1"])]
    with pytest.raises(ConfigError, match=r"pipeline.stages\[1\] \(grpo, recipe=grpo\).*optim.lr=-1"):
        check_stages(config, tmp_path)
    assert not any(tmp_path.iterdir())  # nothing was written


def test_schedule_steps_let_a_run_stop_partway_down_its_schedule():
    import torch

    from hybridflow.training.fsdp import build_optimizer

    config = compose(["recipe=sft", "trainer.total_steps=800", "actor.optim.schedule_steps=1500",
                      "actor.optim.warmup_steps=0", "actor.optim.lr=1.0", "actor.optim.min_lr_ratio=0"])
    optimizer, scheduler = build_optimizer(torch.nn.Linear(2, 2), config.actor.optim, config.trainer.total_steps)
    for _ in range(750):
        optimizer.step()  # no gradients: only the schedule moves
        scheduler.step()
    # cosine at half of its 1500 steps: 0.5 * (1 + cos(pi / 2)) = 0.5, not the floor it reaches at 800 of 800
    assert scheduler.get_last_lr()[0] == pytest.approx(0.5)
    # without schedule_steps the schedule spans trainer.total_steps: at 400 of 800, also half way
    config = compose(["recipe=sft", "trainer.total_steps=800", "actor.optim.lr=1.0", "actor.optim.min_lr_ratio=0",
                      "actor.optim.lr_schedule=cosine", "actor.optim.warmup_steps=0"])
    optimizer, scheduler = build_optimizer(torch.nn.Linear(2, 2), config.actor.optim, config.trainer.total_steps)
    for _ in range(400):
        optimizer.step()
        scheduler.step()
    assert scheduler.get_last_lr()[0] == pytest.approx(0.5)
    with pytest.raises(ConfigError, match=r"optim.schedule_steps=0 is invalid"):
        compose(["actor.optim.schedule_steps=0"])


def test_rollout_tp_is_any_divisor_of_the_pool_and_several_engines_are_refused_with_agents(tmp_path):
    """4 ranks at TP 2 are two engines (vLLM's data parallel); TP 3 divides nothing; with an agent the engines
    of one pool would step in lockstep through different numbers of turns, so only 1 or the whole pool."""
    four = ["placement.pools.global.devices_per_node=4"]
    config = compose_command(["recipe=grpo", *four, "rollout.tensor_parallel_size=2"])
    plan = Plan.from_config(config)
    assert (plan.rollout_tp, plan.devices_of("rollout"), plan.rollout_replicas) == (2, 4, 2)
    with pytest.raises(ConfigError, match=r"4 rank\(s\), which 3-rank engines do not divide: use one of \[1, 2, 4\]"):
        compose_command(["recipe=grpo", *four, "rollout.tensor_parallel_size=3"])
    (tmp_path / "guess.py").write_text("class Guess:\n    stop = ('?',)\n    def reset(self, ground_truth):\n"
                                       "        return 'guess?'\n    def step(self, response):\n        return None, 1.0, True\n")
    agent = [f"rollout.agent=[{tmp_path / 'guess.py'}:Guess]"]
    with pytest.raises(ConfigError, match="2 engines of TP 2 step in lockstep, and agent turns differ"):
        compose_command(["recipe=grpo", *four, "rollout.tensor_parallel_size=2", *agent])
    assert compose_command(["recipe=grpo", *four, "rollout.tensor_parallel_size=4", *agent]).rollout.tensor_parallel_size == 4
