"""Bench scripts' dry runs: each runs its real code path at the smallest shape, so it cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_sft_step_bench_times_the_actor_and_the_plain_loop(tmp_path):
    out = tmp_path / "sft_step.json"
    done = subprocess.run([sys.executable, "bench/sft_step.py", "--dry-run", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["actor_sft_step_s"] > 0 and report["plain_loop_step_s"] > 0
    assert report["ratio"] == report["actor_sft_step_s"] / report["plain_loop_step_s"]
    assert report["last_loss"] < report["first_loss"]  # both sides train: the actor's loss falls
    assert report["cpu"] and report["rows_per_step"] == 8
