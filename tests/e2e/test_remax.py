"""ReMax end to end through the CLI, in one process without Ray (placement=local: the claim is the
recipe's): each step the recipe generates one greedy response per prompt, scores it, and uses that
reward as the baseline of the prompt's samples."""

from __future__ import annotations

import pytest

from tests.e2e.test_rl_recipes import local, metrics

# A reward with a spread on the untrained tiny model (exact match is almost always 0 there, which
# would give ReMax a zero baseline and zero advantages): the response's length in characters.
LENGTH_REWARD = '''
def score(response, **_):
    return float(len(response))
'''


@pytest.mark.slow  # ~31 s; the ReMax estimator has hand-worked unit tests (test_algos_advantages)
def test_remax_trains_for_3_steps_with_the_greedy_baseline(tmp_path):
    reward_file = tmp_path / "length_reward.py"
    reward_file.write_text(LENGTH_REWARD)
    result = local(["recipe=grpo", "algorithm.advantage_estimator=remax", "trainer.total_steps=3",
                    f"reward.fn={reward_file}:score", "trainer.export_hf=false", "trainer.val_every_steps=0"],
                   tmp_path, "remax")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = metrics(tmp_path / "remax")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        # The baseline is the greedy responses' reward: a length in characters of at most 4 tokens.
        assert 0 < row["advantages/baseline_mean"] <= 4 * 8
        assert row["advantages/advantage_std"] > 0  # samples differ from the greedy response
        assert row["actor/grad_norm"] > 0 and "actor/loss" in row
