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
