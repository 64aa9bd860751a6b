"""Benchmark: seconds per GRPO step, synchronous against one-step-off, on this machine.

    PYTHONPATH=. .venv/bin/python bench/async_steps.py [--steps 12] [--extra KEY=VALUE ...]

Runs `hybridflow recipe=grpo` (the tiny model, the synthetic task, the default sizes unless
`--extra` overrides them) in three schedules: colocated synchronous (both roles on both
cores), disaggregated synchronous (one core each) and disaggregated `trainer.max_staleness=1`
with `trainer.old_log_probs=actor`. Per schedule it reports, over the steps after the first
two (warm-up): the median step seconds (differences of `time/elapsed_s`), the median
generate, update and weight-sync stage seconds, the median time the trainer waited for its
batch and the overlap fraction (docs/async.md). Results go to docs/async.md by hand.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEDULES = {
    "colocated, sync": ["placement=colocated"],
    "disaggregated, sync": ["placement=disaggregated"],
    "disaggregated, max_staleness=1": ["placement=disaggregated", "trainer.max_staleness=1",
                                       "trainer.old_log_probs=actor"],
}
KEYS = ["timing/generate_s", "timing/update_s", "timing/weight_sync_s", "weight_sync/seconds",
        "timing/generate_wait_s", "timing/overlap_fraction"]


def run(name: str, overrides: list[str], steps: int, extra: list[str], root: Path) -> dict:
    run_name = name.replace(",", "").replace(" ", "_").replace("=", "")
    cmd = [str(Path(sys.executable).parent / "hybridflow"), "recipe=grpo", f"trainer.total_steps={steps}",
           "trainer.export_hf=false", "trainer.val_every_steps=0", *overrides, *extra,
           f"logger.output_root={root}", f"logger.run_name={run_name}"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in (root / run_name / "metrics.jsonl").read_text().splitlines()]
    elapsed = [r["time/elapsed_s"] for r in rows]
    out = {"step_s": statistics.median(b - a for a, b in zip(elapsed[2:], elapsed[3:]))}
    for key in KEYS:
        values = [r[key] for r in rows[2:] if key in r]
        if values:
            out[key] = statistics.median(values)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--extra", nargs="*", default=[])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in SCHEDULES.items():
            result = run(name, overrides, args.steps, args.extra, Path(tmp))
            print(f"{name:32s} " + "  ".join(f"{k.split('/')[-1]}={v:.3f}" for k, v in result.items()), flush=True)


if __name__ == "__main__":
    main()
