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

    def uses_signal_alarm(response):
        import signal
        signal.signal(signal.SIGALRM, lambda *_: None)  # what math-verify's own timeout does
        return 1.0

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
    signals = RewardConfig(fn=f"{user_file}:uses_signal_alarm", on_error="fallback")
    roles = {"lenient": RoleSpec(RewardWorker, {"reward": lenient}), "strict": RoleSpec(RewardWorker, {"reward": strict}),
             "signals": RoleSpec(RewardWorker, {"reward": signals})}
    roles.update({name: RoleSpec(RewardWorker, {"reward": RewardConfig(fn=name)}) for name in ("math_answer", "math_verify")})
    groups = spawn_workers(ResourcePool(PoolSpec("reward", devices_per_node=2)), roles)
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


@pytest.mark.parametrize("name", ["math_answer", "math_verify"])
def test_the_math_reward_scores_every_answer_form_right_in_the_roles_threads(groups, name):
    """Through the role as a run calls it (two Ray ranks, each function call in a worker thread, where
    math-verify's own signal-based timeout raised on every sample): the docs' table of answer forms."""
    from tests.unit.test_rewards_math_table import FORMS

    batch = Batch(objects={"prompt": [form for form, *_ in FORMS], "response": [r for _, r, *_ in FORMS],
                           "ground_truth": [g for _, _, g, *_ in FORMS], "finish_reason": [f for *_, f, _ in FORMS]})
    out = groups[name].compute_rewards(batch)
    assert not out["reward_fallback"].any()
    assert dict(zip(batch.objects["prompt"], out["sequence_rewards"].tolist())) == {f[0]: f[-1] for f in FORMS}
    assert out["reward_extra/truncated"].tolist() == [float(f[3] == "length") for f in FORMS]


def test_a_function_using_signals_is_refused_with_the_fix_not_scored_with_the_fallback(groups):
    batch = Batch(objects={"prompt": ["a", "b"], "response": ["1", "2"]})
    with pytest.raises(WorkerError, match=r"uses_signal_alarm.*uses signals.*reward role calls functions in "
                                          r"threads; fix: turn the function's own timeout off.*reward.timeout_s=30"):
        groups["signals"].compute_rewards(batch)
