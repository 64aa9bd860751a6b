"""ruff's lint (configured in pyproject.toml) is clean: CI runs it through this test."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_finds_nothing():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], capture_output=True,
                         text=True, cwd=ROOT)
    assert "No module named ruff" not in out.stderr, "ruff is missing: bash scripts/setup.sh installs the test extra"
    assert out.returncode == 0, out.stdout + out.stderr
