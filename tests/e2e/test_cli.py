"""The `hybridflow` command refusing a bad config before anything starts (its demo run end to end is
tests/controller/test_cluster.py's, through `ray job submit`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

VENV_BIN = Path(sys.executable).parent


def test_bad_config_fails_before_ray_starts(tmp_path):
    cmd = [str(VENV_BIN / "hybridflow"), "rollout.samples_per_prompt=0", f"logger.output_root={tmp_path}"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "rollout.samples_per_prompt=0 is invalid: must be >= 1" in result.stderr
    assert "Ray" not in result.stdout and not any(tmp_path.iterdir())
