"""recipe=evaluate: pass@k against hand-worked values, and the recipe composes as a config group option."""

from __future__ import annotations

import pytest

from hybridflow.config import compose
from recipes.evaluate import _ks, pass_at_k


def test_pass_at_k_is_the_unbiased_estimator():
    # n=4 samples: c=1 correct -> pass@1 = 1/4, pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5, pass@4 = 1
    assert pass_at_k([1], 4, 1) == pytest.approx(0.25)
    assert pass_at_k([1], 4, 2) == pytest.approx(0.5)
    assert pass_at_k([1], 4, 4) == pytest.approx(1.0)
    # averaged over prompts: c=0 gives 0 at every k, c=4 gives 1
    assert pass_at_k([0, 4, 2], 4, 1) == pytest.approx((0 + 1 + 0.5) / 3)
    assert pass_at_k([0, 4, 2], 4, 2) == pytest.approx((0 + 1 + (1 - 1 / 6)) / 3)  # c=2: 1 - C(2,2)/C(4,2)
    assert _ks(8) == [1, 2, 4, 8] and _ks(6) == [1, 2, 4, 6] and _ks(1) == [1]


def test_recipe_evaluate_is_a_config_group_option():
    config = compose(["recipe=evaluate", "model.path=/models/m", "recipe.eval_samples=4"])
    assert config.recipe.name == "evaluate" and config.recipe.eval_samples == 4
    with pytest.raises(Exception, match="recipe.eval_samples=-1 is invalid"):
        compose(["recipe=evaluate", "recipe.eval_samples=-1"])
