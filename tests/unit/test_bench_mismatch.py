"""The rollout-mismatch benches at their smallest shape: bench/mismatch_modes.py composes and checks each
mode's command on the tiny model, bench/exact_engine_speed.py runs both engines for two steps and reads
the runs it timed, so neither can rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_mismatch_modes_bench_composes_every_mode_on_the_engine_it_changes(tmp_path):
    done = subprocess.run([sys.executable, "bench/mismatch_modes.py", "--dry-run", "--work", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = {line.split(":")[0]: line for line in done.stdout.splitlines() if ": hybridflow " in line}
    assert list(lines) == ["none", "token_tis", "fp32_head", "exact"]
    assert "rollout.backend=exact" in lines["exact"] and "rollout.fp32_lm_head=true" in lines["fp32_head"]
    assert "algorithm.rollout_correction=token_tis" in lines["token_tis"]


def test_the_exact_engine_speed_bench_times_both_engines_and_finds_no_mismatch_with_the_exact_one(tmp_path):
    out = tmp_path / "exact.json"
    done = subprocess.run([sys.executable, "bench/exact_engine_speed.py", "--dry-run", "--out", str(out),
                           "--work", str(tmp_path / "work")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    shape = json.loads(out.read_text())["shapes"][0]
    assert "error" not in shape, shape
    assert shape["exact"]["abs_diff_max"] == 0.0 and shape["exact"]["generate_s_median"] > 0
    assert shape["hf"]["generate_s_median"] > 0
