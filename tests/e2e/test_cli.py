"""The `hybridflow` command end to end: local Ray, tiny model built offline, vLLM on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

VENV_BIN = Path(sys.executable).parent


def test_main_command_runs_the_controller_demo(tmp_path):
    cmd = [str(VENV_BIN / "hybridflow"), "recipe=demo", "recipe.demo_prompts=4", f"logger.output_root={tmp_path}",
           "logger.run_name=demo"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = tmp_path / "demo"
    assert result.stdout.count(f"run directory {run_dir}") == 2  # printed at start and end
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["step"] == 0 and metrics[0]["demo/samples"] == 4
    assert metrics[0]["demo/rollout_ranks"] == 2 and metrics[0]["demo/response_tokens"] > 0
    assert (run_dir / "base_model" / "config.json").is_file() and (run_dir / "data" / "val.parquet").is_file()


def test_bad_config_fails_before_ray_starts(tmp_path):
    cmd = [str(VENV_BIN / "hybridflow"), "rollout.samples_per_prompt=0", f"logger.output_root={tmp_path}"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "rollout.samples_per_prompt=0 is invalid: must be >= 1" in result.stderr
    assert "Ray" not in result.stdout and not any(tmp_path.iterdir())
