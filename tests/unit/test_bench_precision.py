"""The precision benches (issue 80) at their smallest shape, so they cannot rot: bench/precision_study.py
composes and checks each run's command and renders its table from stand-in runs, bench/update_resolution.py
runs its study on the tiny model for two Adam steps."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(monkeypatch, script: str, *args: str) -> dict:
    monkeypatch.setattr(sys, "argv", [script, *args])
    return runpy.run_path(str(ROOT / "bench" / script), run_name="__main__")


def test_the_precision_study_composes_every_run_with_its_dtypes_and_renders_its_table(tmp_path, monkeypatch):
    doc = ROOT / "docs" / "results" / "precision.md"
    before = doc.read_text()
    bench = _run(monkeypatch, "precision_study.py", "--dry-run", "--work", str(tmp_path), "--out",
                 str(tmp_path / "dry.json"))
    report = json.loads((tmp_path / "dry.json").read_text())
    assert report["runs"] == list(bench["RUNS"]) and {"fp32", "bf16", "fp16"} <= set(report["runs"])
    assert "| fp32-seed0 | 1.00 | 0.200 / 0.400 | 0.500 / 0.500 | 0.04 | 30.0 |" in report["table"]
    assert report["table"] in Path(report["doc"]).read_text() and doc.read_text() == before
    command = bench["overrides"]("fp16", type("A", (), {"steps": 10, "seed": 0}), bench["prepare"](tmp_path),
                                 tmp_path / "model", tmp_path)
    assert command[-2:] == ["model.dtype=float16", "rollout.dtype=float16"]
    assert not [o for o in command[:-2] if "dtype=" in o]  # only the run's own dtypes


def test_the_update_resolution_study_runs_on_the_tiny_model(monkeypatch, capsys):
    _run(monkeypatch, "update_resolution.py", "--dry-run")
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(table) == 2 + 3  # header, rule, steps 0-2
    moved = [float(cell.strip(" %")) for cell in table[-1].split("|")[5:7]]
    assert 0 < moved[0] < moved[1] <= 100  # float16 keeps more of each step than bfloat16
