"""The algorithm and actor settings that would fail after Ray and the models started are
refused while the config is composed, naming the key, the value and the fix."""

from __future__ import annotations

import pytest

from hybridflow.config import ConfigError, compose

GOOD_ESTIMATOR = '''
def mine(*, token_rewards, response_mask, values=None, group_ids=None, baseline_token_rewards=None,
         gamma=1.0, lam=1.0, eps=1e-6):
    return token_rewards, token_rewards, {}
'''
BAD_ESTIMATOR = '''
def mine(token_rewards, response_mask):
    return token_rewards, token_rewards, {}
'''


@pytest.mark.parametrize("override,message", [
    (["algorithm.kl_controller=adaptive"],
     r"algorithm.kl_penalty_coef=0.0 is invalid: algorithm.kl_controller=adaptive starts from "
     r"algorithm.kl_penalty_coef .* set algorithm.kl_penalty_coef to its starting value"),
    (["algorithm.kl_controller=adaptive", "algorithm.kl_penalty_coef=0.1", "algorithm.kl_target=0"],
     r"algorithm.kl_target=0.0 is invalid: must be > 0"),
    (["algorithm.kl_horizon=0"], r"algorithm.kl_horizon=0 is invalid: must be > 0"),
    (["actor.clip_ratio_low=1.0"], r"actor.clip_ratio_low=1.0 is invalid: must be in \[0, 1\)"),
    (["actor.clip_ratio_high=-0.1"], r"actor.clip_ratio_high=-0.1 is invalid: must be >= 0"),
    (["actor.kl_loss_coef=-1"], r"actor.kl_loss_coef=-1.0 is invalid: must be >= 0"),
    (["algorithm.advantage_estimator=no_such_module:fn"],
     r"algorithm.advantage_estimator='no_such_module:fn' is invalid: .*cannot import module 'no_such_module'"),
])
def test_a_setting_that_cannot_run_is_refused_with_key_value_and_fix(override, message):
    with pytest.raises(ConfigError, match=message):
        compose(["recipe=grpo", *override])


def test_the_adaptive_controller_with_a_starting_coefficient_is_accepted():
    config = compose(["recipe=grpo", "algorithm.kl_controller=adaptive", "algorithm.kl_penalty_coef=0.05"])
    assert config.algorithm.kl_controller == "adaptive"


def test_a_custom_estimator_is_imported_and_its_signature_checked_before_start(tmp_path):
    good, bad = tmp_path / "good.py", tmp_path / "bad.py"
    good.write_text(GOOD_ESTIMATOR)
    bad.write_text(BAD_ESTIMATOR)
    assert compose(["recipe=grpo", f"algorithm.advantage_estimator={good}:mine"])
    with pytest.raises(ConfigError, match=r"algorithm.advantage_estimator=.*bad.py:mine' is invalid: .*"
                                          r"cannot take the recipe's keywords .* must have the signature"):
        compose(["recipe=grpo", f"algorithm.advantage_estimator={bad}:mine"])
