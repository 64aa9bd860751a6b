"""Every YAML under conf/ composes; bad keys and values fail before Ray starts."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException

from hybridflow.config import CONF_DIR, ConfigError, compose
from hybridflow.config.schema import RolloutBackend

GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir())
REQUIRED_VALUES = {  # options whose '???' values a user must supply
    "model/local_hf": ["model.path=/some/model"],
    "data/files": ["data.train_path=/a.jsonl", "data.val_path=/b.jsonl"],
    "recipe/grpo_gsm8k": ["model.path=/some/model", "data.train_path=/a.parquet", "data.val_path=/b.parquet"],
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
    assert config.rollout.backend is RolloutBackend.hf and config.rollout.temperature == 0.5
    assert config.placement.roles["critic"] == "critic"


@pytest.mark.parametrize("override,expected", [
    (["model.no_such_key=1"], "model.no_such_key"),
    (["rollout.backend=sglang"], "rollout.backend"),
    (["rollout.max_response_tokens=many"], "rollout.max_response_tokens"),
])
def test_unknown_keys_and_bad_types_fail_in_composition(override, expected):
    with pytest.raises(ConfigCompositionException, match=expected.replace(".", r"\.")) as info:
        compose(override)
    cause = str(info.value.__cause__)
    assert any(s in cause for s in ("not in", "Invalid value", "could not be converted"))


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
])
def test_cross_field_rules_name_key_value_and_fix(override, message):
    with pytest.raises(ConfigError, match=message):
        compose(override)


def test_the_main_command_runs_the_default_pipeline():
    config = compose([])
    assert config.recipe.name == "pipeline"
    assert [s.recipe for s in config.pipeline.stages] == ["sft", "grpo"]
    assert config.pipeline.stages[1].init.name == "pma_sma" and config.pipeline.stages[1].evaluate_init
