"""The reward worker on real Ray: two ranks score their halves; extras line up across ranks."""

from __future__ import annotations

import textwrap

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.controller import PoolSpec, ResourcePool, RoleSpec, WorkerError, spawn_workers
from hybridflow.rewards import RewardConfig, RewardFunctionConfig, reward_metrics
from workers.reward import RewardWorker

USER_FILE = textwrap.dedent('''
    def by_source(response, ground_truth, data_source):
        s = float(response.strip() == ground_truth)
        return {"score": s, f"{data_source}_accuracy": s}

    def fails_on_boom(response):
        if response == "boom":
            raise RuntimeError("boom is not a number")
        return 1.0
''')


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "user_rewards.py"
    path.write_text(USER_FILE)
    return path


@pytest.fixture(scope="module")
def groups(ray_local, user_file):
    """Two reward roles fused on one 2-rank pool: one falls back on errors, one raises."""
    lenient = RewardConfig(fn=None, on_error="fallback", fallback_score=-1.0, functions=[
        RewardFunctionConfig(fn=f"{user_file}:by_source"),
        RewardFunctionConfig(fn=f"{user_file}:fails_on_boom", weight=0.5),
    ])
    strict = RewardConfig(fn=f"{user_file}:fails_on_boom")
    groups = spawn_workers(ResourcePool(PoolSpec("reward", devices_per_node=2)),
                           {"lenient": RoleSpec(RewardWorker, {"reward": lenient}),
                            "strict": RoleSpec(RewardWorker, {"reward": strict})})
    for group in groups.values():
        group.start()
    return groups


def test_two_ranks_score_and_extras_line_up(groups):
    group = groups["lenient"]
    # 5 rows on 2 ranks: rank 0 gets rows 0-2 (all gsm8k), rank 1 rows 3-4 (math) and a pad row.
    batch = Batch(objects={"prompt": [f"q{i}" for i in range(5)],
                           "response": ["1", "2", "x", "boom", "5"],
                           "ground_truth": ["1", "2", "3", "4", "5"],
                           "data_source": ["gsm8k"] * 3 + ["math"] * 2})
    out = group.compute_rewards(batch)
    assert len(out) == 5
    # by_source: [1, 1, 0, 0, 1]; fails_on_boom: [1, 1, 1, fallback -1, 1] at weight 0.5
    assert out["sequence_rewards"].tolist() == [1.5, 1.5, 0.5, -0.5, 1.5]
    assert out["reward_fallback"].tolist() == [False, False, False, True, False]
    gsm8k, math_acc = out["reward_extra/by_source/gsm8k_accuracy"], out["reward_extra/by_source/math_accuracy"]
    assert gsm8k[:3].tolist() == [1.0, 1.0, 0.0] and torch.isnan(gsm8k[3:]).all()
    assert torch.isnan(math_acc[:3]).all() and math_acc[3:].tolist() == [0.0, 1.0]
    metrics = reward_metrics(out)
    assert metrics["reward/by_source/gsm8k_accuracy"] == pytest.approx(2 / 3)
    assert metrics["reward/by_source/math_accuracy"] == pytest.approx(0.5)
    assert metrics["reward/fallback_count"] == 1 and metrics["reward/fallback/raised"] == 1
    assert metrics["reward/score"] == pytest.approx(sum([1.5, 1.5, 0.5, -0.5, 1.5]) / 5)


def test_error_names_function_sample_and_rank(groups):
    group = groups["strict"]
    batch = Batch(objects={"prompt": ["a", "b", "c", "d"], "response": ["1", "2", "3", "boom"]})
    with pytest.raises(WorkerError) as info:
        group.compute_rewards(batch)
    text = str(info.value)
    assert "RewardWorker.compute_rewards failed on rank 1 of 2" in text
    # Rank 1 holds rows 2-3: the sample number is the row's index in the whole batch.
    assert "fails_on_boom' (reward.fn) on sample 3 (prompt 'd'): raised RuntimeError: boom is not a number" in text
