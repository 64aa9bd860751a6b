import json

import pytest

from hybridflow.tracking import MetricsLogger, read_metrics


def test_metrics_are_one_json_object_per_step(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, ["console", "jsonl"])
    logger.log(1, {"reward/score": 0.5, "val/accuracy": 0.25})
    logger.log(2, {"reward/score": float("nan")})
    logger.close()
    rows = read_metrics(tmp_path)
    elapsed = [row.pop("time/elapsed_s") for row in rows]
    assert rows[0] == {"step": 1, "reward/score": 0.5, "val/accuracy": 0.25} and rows[1]["step"] == 2
    assert 0 <= elapsed[0] <= elapsed[1]
    assert "non-finite metrics ['reward/score']" in capsys.readouterr().out
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1


def test_a_backend_that_is_not_installed_says_what_to_install(tmp_path):
    pytest.importorskip("torch")
    try:
        import wandb  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install wandb"):
            MetricsLogger(tmp_path, ["wandb"])
    else:
        pytest.skip("wandb is installed")


def test_validation_accuracy_is_split_by_data_source():
    import torch

    from hybridflow.batch import Batch
    from hybridflow.runner import accuracy_by_source

    rewards = Batch({"sequence_rewards": torch.tensor([1.0, 0.0, 0.5, 1.0]),
                     "reward_extra/accuracy": torch.tensor([1.0, 0.0, 0.0, 1.0])})
    out = accuracy_by_source(rewards, ["add/1d", "add/2d", "add/2d", "add/2d"])
    assert out == {"val/accuracy/add/1d": 1.0, "val/accuracy/add/2d": pytest.approx(1 / 3)}
    assert accuracy_by_source(rewards, ["gsm8k"] * 4) == {}  # one source: val/accuracy says it all
    no_extra = Batch({"sequence_rewards": torch.tensor([1.0, 0.0, 0.5, 1.0])})
    assert accuracy_by_source(no_extra, ["a", "a", "b", "b"]) == {"val/accuracy/a": 0.5, "val/accuracy/b": 0.75}
