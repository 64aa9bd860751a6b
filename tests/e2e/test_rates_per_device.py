"""placement=auto on a device the planner has no rates for (a simulated identity): the first run
ranks with borrowed rates, says so, and saves what it measured as the device's rates; the second
run predicts with them, within 25% of its own measured step (issue: placement predicts right on the
user's machine; hybridflow/planning/device_rates.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

VENV_BIN = Path(sys.executable).parent
GRPO = ["recipe=grpo", "placement=auto", "trainer.total_steps=5", "trainer.prompts_per_step=8",
        "rollout.samples_per_prompt=8", "rollout.max_response_tokens=32", "trainer.val_every_steps=0",
        "trainer.save_every_steps=0", "trainer.export_hf=false"]


def _run(tmp_path: Path, name: str, env: dict) -> tuple[str, dict]:
    done = subprocess.run([str(VENV_BIN / "hybridflow"), *GRPO, f"logger.output_root={tmp_path}",
                           f"logger.run_name={name}"], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr, json.loads((tmp_path / name / "plan.json").read_text())


@pytest.mark.budget(100)  # two whole 5-step GRPO runs of the `hybridflow` command
def test_the_second_run_on_an_unknown_device_predicts_its_step_within_a_quarter(tmp_path):
    env = {**os.environ, "HYBRIDFLOW_DEVICE_IDENTITY": "Simulated CPU for rates", "HYBRIDFLOW_RATES_CACHE":
           str(tmp_path / "rates")}
    first, plan = _run(tmp_path, "first", env)
    assert plan["rates_choice"]["provenance"] == "borrowed"
    assert "ranked with rates BORROWED from another device" in first and "predicted" not in first.split(
        "placement=auto chose")[1].split("\n")[0]
    assert "this device had no rates; saved the rates this run measured as its own" in first
    assert len(list((tmp_path / "rates").glob("*.json"))) == 1
    second, plan = _run(tmp_path, "second", env)
    assert plan["rates_choice"]["provenance"] == "cached" and "with rates this device's, first measured" in second
    predicted, measured = plan["prediction"]["step_s"], plan["measured"]["stages"]["step"]
    assert abs(predicted - measured) <= 0.25 * measured, (predicted, measured, second)
