"""Combining functions with weights, extras and metrics; the reward worker in-process."""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.controller import WorkerContext
from hybridflow.rewards import (
    RewardComposer, RewardConfig, RewardFunction, RewardFunctionConfig, build_reward, reward_metrics,
)
from workers.reward import RewardWorker

ROWS = [
    {"prompt": "1+1=", "response": "2", "ground_truth": "2"},
    {"prompt": "2+2=", "response": "5", "ground_truth": "4"},
    {"prompt": "3+3=", "response": "so 6", "ground_truth": "6"},
]


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text(textwrap.dedent('''
        def brevity(response):
            return {"score": 1.0 / len(response), "chars": len(response)}

        def tagged(response, data_source):
            return {"score": 1.0, data_source: 1.0}
    '''))
    return path


def test_weights_combine_hand_computed(user_file):
    cfg = RewardConfig(fn=None, functions=[
        RewardFunctionConfig(fn="exact_match", weight=0.5),
        RewardFunctionConfig(fn="math_answer", weight=2.0),
        RewardFunctionConfig(fn=f"{user_file}:brevity", weight=-1.0),
    ])
    result = build_reward(cfg).score(ROWS)
    # exact_match: [1, 0, 0]; math_answer (last number): [1, 0, 1]; brevity = 1/len: [1, 1, 1/4]
    # total = 0.5 * exact + 2 * math - brevity
    expected = [0.5 + 2 - 1, 0 + 0 - 1, 0 + 2 - 0.25]
    assert result.scores == pytest.approx(expected)
    assert result.extras["exact_match/score"] == [1.0, 0.0, 0.0]
    assert result.extras["math_answer/score"] == [1.0, 0.0, 1.0]
    # With several functions, extras are namespaced by the function that returned them.
    assert result.extras["exact_match/accuracy"] == [1.0, 0.0, 0.0]
    assert result.extras["brevity/chars"] == [1.0, 1.0, 4.0]
    assert result.metrics["reward/score"] == pytest.approx(sum(expected) / 3)
    assert result.metrics["reward/math_answer/accuracy"] == pytest.approx(2 / 3)
    assert result.metrics["reward/brevity/chars"] == pytest.approx(2.0)
    assert result.metrics["reward/fallback_count"] == 0


def test_metrics_from_tensors_equal_the_results(user_file):
    rows = [dict(r, data_source=s) for r, s in zip(ROWS, ["a", "b", "a"])]
    result = build_reward(RewardConfig(fn=f"{user_file}:tagged")).score(rows)
    tensors = result.tensors(extra_names=["never_seen"])
    assert torch.isnan(tensors["reward_extra/never_seen"]).all()
    assert tensors["reward_extra/a"].tolist()[0] == 1.0 and math.isnan(tensors["reward_extra/a"].tolist()[1])
    assert reward_metrics(Batch(tensors)) == result.metrics
    assert "reward/never_seen" not in result.metrics  # no sample has it
    assert result.metrics["reward/a"] == 1.0 and result.metrics["reward/b"] == 1.0


def test_composer_from_plain_callables_and_empty_rows():
    composer = RewardComposer([RewardFunction(lambda response: len(response), "len", "len", weight=3.0)])
    assert composer.score([]).scores == []
    assert composer.score([{"prompt": "", "response": "abc"}]).scores == [9.0]


def test_worker_in_process(user_file):
    worker = RewardWorker(WorkerContext(), RewardConfig(fn=f"{user_file}:tagged"))
    assert worker.composer is None  # the constructor only stores
    worker.start()
    batch = Batch({"response_ids": torch.zeros(3, 2, dtype=torch.long)},
                  {"prompt": ["a", "b", "c"], "response": ["x", "y", "z"], "data_source": ["p", "q", "p"]})
    out = worker.compute_rewards(batch)
    assert out["sequence_rewards"].dtype == torch.float32 and out["sequence_rewards"].tolist() == [1.0, 1.0, 1.0]
    assert out["reward_fallback"].dtype == torch.bool and not out["reward_fallback"].any()
    assert out["reward_extra/p"].tolist()[::2] == [1.0, 1.0] and math.isnan(out["reward_extra/p"][1])
    assert reward_metrics(out)["reward/q"] == 1.0
    with pytest.raises(KeyError, match=r"no object\(s\) \['response'\]"):
        worker.compute_rewards(Batch(objects={"prompt": ["a"]}))
