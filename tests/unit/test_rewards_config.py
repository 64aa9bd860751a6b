"""reward.* config: OmegaConf structured-config compatibility and errors naming key, value, fix."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from hybridflow.rewards import RewardConfig, RewardFunctionConfig, RewardModelConfig


def from_dotlist(*overrides: str) -> RewardConfig:
    """Merge command-line style overrides into the schema and build the dataclasses, like Hydra."""
    base = OmegaConf.structured(RewardConfig)
    return OmegaConf.to_object(OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides))))


def test_defaults_are_exact_match():
    cfg = from_dotlist()
    assert cfg.fn == "exact_match" and cfg.functions == [] and cfg.on_error == "raise"
    assert [s.fn for s in cfg.function_specs()] == ["exact_match"]


def test_file_reference_on_the_command_line(tmp_path):
    path = tmp_path / "r.py"
    path.write_text("def f(response):\n    return 1.0\n")
    assert from_dotlist(f"fn={path}:f").fn == f"{path}:f"


def test_list_of_functions_with_weights_and_kwargs(tmp_path):
    cfg = from_dotlist("fn=null", "functions=[{fn: exact_match, weight: 0.5}, "
                       "{fn: math_answer, weight: 2, name: math, kwargs: {tolerance: 0.1}}]")
    assert all(isinstance(s, RewardFunctionConfig) for s in cfg.functions)
    assert [(s.fn, s.weight, s.metric_name) for s in cfg.functions] == [("exact_match", 0.5, "exact_match"),
                                                                       ("math_answer", 2.0, "math")]
    assert cfg.functions[1].kwargs == {"tolerance": 0.1}
    assert cfg.function_keys() == ["reward.functions[0]", "reward.functions[1]"]


def test_fn_and_functions_together_name_both_keys():
    with pytest.raises(ValueError, match=r"reward.fn and reward.functions are both set.*reward.fn=null"):
        RewardConfig(functions=[RewardFunctionConfig(fn="exact_match")])


@pytest.mark.parametrize("kwargs, match", [
    (dict(fn=None, functions=[RewardFunctionConfig(), RewardFunctionConfig(fn="math_answer", weight=float("nan"))]),
     r"config reward.functions\[1\].weight=nan is invalid: must be a finite number"),
    (dict(fn="missing_file.py:f"), r"reward.fn='missing_file.py:f' is invalid: file .*missing_file.py does not exist"),
    (dict(fn=None, functions=[RewardFunctionConfig(fn="mod:a"), RewardFunctionConfig(fn="other:a")]),
     r"reward.functions\[1\].name=None is invalid: reward.functions\[0\] is also named 'a'"),
    (dict(fn=None, functions=[RewardFunctionConfig(kwargs={"response": 1})]),
     r"reward.functions\[0\].kwargs=.* \['response'\] are filled from each sample"),
    (dict(fn=None), r"no reward source: set reward.fn, reward.functions or reward.reward_model.path"),
    (dict(on_error="ignore"), r"reward.on_error='ignore' is invalid: must be one of \['raise', 'fallback'\]"),
    (dict(timeout_s=0), r"reward.timeout_s=0 is invalid"),
    (dict(max_concurrency=0), r"reward.max_concurrency=0 is invalid"),
    (dict(fallback_score=float("inf")), r"reward.fallback_score=inf is invalid"),
    (dict(fn=""), r"reward.fn='' is invalid: name a reward function"),
])
def test_invalid_values_name_key_value_and_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RewardConfig(**kwargs)


def test_an_unregistered_reward_name_is_refused_at_compose_naming_the_registered_ones():
    """The schema checks a reference's form; that a bare name is registered is a rule that asks the runtime
    (hybridflow/checks/rules.py `check_reward_names`), run on every composed config."""
    from hybridflow.config import ConfigError, compose

    with pytest.raises(ConfigError, match=r"config reward.fn='no_such_reward' is invalid: not a registered reward "
                                          r"function \(digit_match, environment, exact_match, last_number, math_answer, "
                                          r"math_verify, reasoning_gym\)"):
        compose(["reward.fn=no_such_reward"])
    with pytest.raises(ConfigError, match=r"config reward.functions\[1\].fn='nope' is invalid: not a registered"):
        compose(["recipe=grpo", "reward.fn=null", "reward.functions=[{fn: exact_match}, {fn: nope}]"])


def test_reward_model_checks(tmp_path):
    with pytest.raises(ValueError, match=r"reward.reward_model.path='/nonexistent/rm' is invalid: must be a Hugging"):
        RewardModelConfig(path="/nonexistent/rm")
    with pytest.raises(ValueError, match=r"reward.reward_model.micro_batch_rows=0"):
        RewardModelConfig(micro_batch_rows=0)
    only_model = RewardConfig(fn=None, reward_model=RewardModelConfig(path=str(tmp_path)))
    assert only_model.function_specs() == [] and only_model.reward_model.path == str(tmp_path)


def test_errors_survive_omegaconf_conversion():
    with pytest.raises(Exception, match=r"reward.on_error='sometimes'"):
        from_dotlist("on_error=sometimes")
