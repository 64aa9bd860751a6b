"""recipe=evaluate end to end: the tiny model scored on the synthetic validation rows, greedy and
sampled, through the `hybridflow` command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_recipe_evaluate_writes_val_metrics_and_a_report_line(tmp_path):
    done = subprocess.run([str(Path(sys.executable).parent / "hybridflow"), "recipe=evaluate", "recipe.eval_samples=4",
                           "trainer.val_prompts=8", "data.synthetic.val_rows=16", "rollout.max_response_tokens=4",
                           "placement.pools.global.devices_per_node=1", f"logger.output_root={tmp_path}",
                           "logger.run_name=eval"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    row = json.loads((tmp_path / "eval" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["step"] == 0
    for key in ("val/accuracy", "val/reward_mean", "val/pass@1", "val/pass@2", "val/pass@4", "val/sampled_reward_mean",
                "val/sampled_accuracy"):
        assert 0.0 <= row[key] <= 1.0, key
    assert row["val/pass@1"] <= row["val/pass@2"] <= row["val/pass@4"]
    assert row["val/pass@1"] == pytest.approx(row["val/sampled_accuracy"])  # pass@1 is the mean accuracy
    report = (tmp_path / "eval" / "report.md").read_text()
    assert "on the synthetic task: accuracy" in report and "pass@4" in report
