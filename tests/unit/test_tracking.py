import json
import os
from pathlib import Path

import pytest

from hybridflow.output.tracking import MetricsLogger, read_metrics


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


def test_a_backend_that_is_not_installed_says_what_to_install(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ImportError, match=r"the wandb package is not installed; fix: pip install -e '.\[wandb\]'"):
        MetricsLogger(tmp_path, ["console", "wandb"])
    assert not (tmp_path / "metrics.jsonl").exists()


def test_the_command_refuses_a_missing_backend_before_anything_starts(tmp_path):
    import importlib.util
    import subprocess
    import sys

    absent = [b for b in ("mlflow", "wandb", "tensorboard") if importlib.util.find_spec(b) is None] or ["mlflow"]
    hidden = tmp_path / "hide"  # the test extra installs every backend: hide one from the command
    hidden.mkdir()
    (hidden / "sitecustomize.py").write_text(f"import sys\nsys.modules[{absent[0]!r}] = None  # find_spec: None\n")
    run_dir, ray_tmp = tmp_path / "runs", tmp_path / "ray_tmp"  # ray_tmp: where a Ray it started would write
    done = subprocess.run([sys.executable, "-m", "hybridflow.cli", f"logger.backends=[console,jsonl,{absent[0]}]",
                           f"logger.output_root={run_dir}"], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2],
                          env={**os.environ, "PYTHONPATH": str(hidden), "RAY_TMPDIR": str(ray_tmp)})
    assert done.returncode == 2 and f"pip install -e '.[{absent[0]}]'" in done.stderr, done.stderr
    assert not run_dir.exists() and not ray_tmp.exists()  # docs/recipes.md: before anything starts


def test_project_and_tags_reach_wandb_offline(tmp_path, monkeypatch):
    import wandb  # noqa: F401 - in the test extra: this runs wherever the tests do
    from hybridflow.config import compose

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for where in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(where, str(tmp_path / where.lower()))  # nothing written outside the test's directory
    logger_config = compose(["recipe=grpo", "logger.backends=[jsonl,wandb]", "logger.project=hf-test",
                             "logger.tags=[smoke,cpu]", "logger.entity=team"]).logger
    (tmp_path / "run1").mkdir()
    logger = MetricsLogger(tmp_path / "run1", logger_config)
    run = logger.wandb
    assert (run.project, tuple(run.tags), run.name) == ("hf-test", ("smoke", "cpu"), "run1")
    logger.log(1, {"reward/score": 0.5})
    logger.close()
    assert list((tmp_path / "run1" / "wandb").glob("offline-run-*/run-*.wandb"))


def _wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for where in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(where, str(tmp_path / where.lower()))


def test_a_run_that_continues_in_its_directory_continues_its_wandb_run(tmp_path, monkeypatch):
    """trainer.resume and automatic restarts reuse the run directory: the W&B run id is kept there
    (tracking_ids.json) and resumed; a new run directory is a new W&B run."""
    _wandb_offline(tmp_path, monkeypatch)
    (tmp_path / "run1").mkdir()
    ids = []
    for step in (1, 2):  # the run, then its resumption in the same directory
        logger = MetricsLogger(tmp_path / "run1", ["jsonl", "wandb"])
        ids.append(logger.wandb.id)
        logger.log(step, {"reward/score": 0.5})
        logger.close()
    assert ids[0] == ids[1] == json.loads((tmp_path / "run1" / "tracking_ids.json").read_text())["wandb"]
    segments = [p.name for p in (tmp_path / "run1" / "wandb").glob("offline-run-*")]  # offline: one per start,
    assert len(segments) == 2 and all(ids[0] in name for name in segments)  # both of the one run (wandb sync)
    (tmp_path / "run2").mkdir()
    other = MetricsLogger(tmp_path / "run2", ["jsonl", "wandb"])
    assert other.wandb.id != ids[0]
    other.close()


def test_a_run_that_continues_in_its_directory_continues_its_mlflow_run(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow", reason="mlflow is not installed (pip install -e '.[mlflow]')")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a file store under the test's directory, offline
    mlflow.set_tracking_uri(f"file://{tmp_path / 'mlruns'}")
    (tmp_path / "run1").mkdir()
    for step in (1, 2):
        logger = MetricsLogger(tmp_path / "run1", ["jsonl", "mlflow"])
        logger.log(step, {"reward/score": 0.25 * step})
        logger.close()
    run_id = json.loads((tmp_path / "run1" / "tracking_ids.json").read_text())["mlflow"]
    history = mlflow.tracking.MlflowClient().get_metric_history(run_id, "reward_score")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.5)]
    experiment = mlflow.get_experiment_by_name("hybridflow")
    assert len(mlflow.tracking.MlflowClient().search_runs([experiment.experiment_id])) == 1


def test_project_and_tags_reach_tensorboard(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install -e '.[tensorboard]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hybridflow.config import compose

    logger_config = compose(["recipe=sft", "logger.backends=[tensorboard]", "logger.project=hf-test",
                             "logger.tags=[smoke]"]).logger
    logger = MetricsLogger(tmp_path, logger_config)
    logger.log(1, {"actor/loss": 2.0})
    logger.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    assert [e.value for e in events.Scalars("actor/loss")] == [2.0]
    text = events.Tensors("run/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "project: hf-test" in text and "tags: smoke" in text


def test_validation_accuracy_is_split_by_data_source():
    import torch

    from hybridflow.batch import Batch
    from hybridflow.run.runner import accuracy_by_source

    rewards = Batch({"sequence_rewards": torch.tensor([1.0, 0.0, 0.5, 1.0]),
                     "reward_extra/accuracy": torch.tensor([1.0, 0.0, 0.0, 1.0])})
    out = accuracy_by_source(rewards, ["add/1d", "add/2d", "add/2d", "add/2d"])
    assert out == {"val/accuracy/add/1d": 1.0, "val/accuracy/add/2d": pytest.approx(1 / 3)}
    assert accuracy_by_source(rewards, ["gsm8k"] * 4) == {}  # one source: val/accuracy says it all
    no_extra = Batch({"sequence_rewards": torch.tensor([1.0, 0.0, 0.5, 1.0])})
    assert accuracy_by_source(no_extra, ["a", "a", "b", "b"]) == {"val/accuracy/a": 0.5, "val/accuracy/b": 0.75}


def test_a_step_loop_is_one_progress_line_plus_validation_and_summary_lines(tmp_path, capsys):
    from hybridflow.output import console

    with console.stage("grpo"):
        logger = MetricsLogger(tmp_path, ["console", "jsonl"], total_steps=50)
        for step in range(1, 51):
            metrics = {"reward/score": step / 100, "reward/accuracy": 0.5, "actor/loss": 1.0,
                       "perf/tokens_per_s": 1234.5, "timing/generate_s": 0.1}
            if step % 25 == 0:
                metrics["val/accuracy"] = step / 100
            logger.log(step, metrics)
        logger.close()
    out = capsys.readouterr().out
    lines = out.split("\n")
    assert len(lines) == 5 and lines[-1] == "", lines  # validation x2, the progress line, the summary
    assert lines[0].endswith("grpo step 25/50: held-out accuracy 0.250")
    assert lines[1].endswith("grpo step 50/50: held-out accuracy 0.500")
    progress = lines[2].split("\r")[-1]
    assert progress.startswith("grpo 50/50 [") and "reward=0.500 acc=0.500 tok/s=1234" in progress
    assert "loss=" not in progress  # with a reward to watch, the loss is left out
    assert lines[3].startswith("grpo: 50 steps in 0m0") and lines[3].endswith(", held-out accuracy 0.500 "
                                                                             "(last step: reward=0.500 acc=0.500 tok/s=1234)")
    assert len(read_metrics(tmp_path)) == 50


def test_a_resumed_step_loop_counts_from_the_last_logged_step(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    logger = MetricsLogger(tmp_path, ["console"], total_steps=4)
    logger.log(3, {"actor/loss": 0.5})
    logger.log(4, {"actor/loss": 0.25})
    logger.close()
    out = capsys.readouterr().out
    assert f"{tmp_path.name}: 2 steps in" in out and "loss=0.250" in out


def test_a_resumed_run_rewrites_the_steps_it_logs_again(tmp_path):
    """A run killed after logging steps 1-5 resumes from its step-3 checkpoint: steps 4 and 5 are
    logged again, and the file holds each step once, the new numbers for 4 and 5."""
    first = MetricsLogger(tmp_path, ["jsonl"])
    for step in range(1, 6):
        first.log(step, {"reward/score": float(step)})
    first.close()
    resumed = MetricsLogger(tmp_path, ["jsonl"])
    resumed.log(4, {"reward/score": 40.0})
    resumed.log(5, {"reward/score": 50.0})
    resumed.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["reward/score"] for r in rows] == [1.0, 2.0, 3.0, 40.0, 50.0]
    assert not (tmp_path / "metrics.jsonl.partial").exists()
    later = MetricsLogger(tmp_path, ["jsonl"])  # continuing past the end drops nothing
    later.log(6, {"reward/score": 6.0})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5, 6]
