"""Benchmark: seconds per GRPO step, synchronous against one-step-off, on this machine.

    PYTHONPATH=. .venv/bin/python bench/async_steps.py [--steps 12] [--extra KEY=VALUE ...]
    PYTHONPATH=. .venv/bin/python bench/async_steps.py --dry-run [--extra KEY=VALUE ...]   # compose, check; run nothing

Runs `hybridflow recipe=grpo` (the tiny model, the synthetic task, the default sizes unless
`--extra` overrides them) in three schedules: colocated synchronous (both roles on both
cores), disaggregated synchronous (one core each) and disaggregated `trainer.max_staleness=1`
with `trainer.old_log_probs=actor`. Per schedule it reports, over the steps after the first
two (warm-up): the median step seconds (differences of `time/elapsed_s`), the median
generate, update and weight-sync stage seconds, the median time the trainer waited for its
batch and the overlap fraction (docs/async.md). Results go to docs/async.md by hand.

`--dry-run` composes and checks each schedule's command as `hybridflow` checks it (the schedule's
placement, staleness and step count must reach the composed config) and runs the reading of a
run's metrics.jsonl on a small one it writes itself (two warm-up steps slower than the rest); it
starts no Ray, engine or training.
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
sys.path.insert(0, str(ROOT / "bench"))

from composed import carried, write_metrics  # noqa: E402
SCHEDULES = {
    "colocated, sync": ["placement=colocated"],
    "disaggregated, sync": ["placement=disaggregated"],
    "disaggregated, max_staleness=1": ["placement=disaggregated", "trainer.max_staleness=1",
                                       "trainer.old_log_probs=actor"],
}
KEYS = ["timing/generate_s", "timing/update_s", "timing/weight_sync_s", "weight_sync/seconds",
        "timing/generate_wait_s", "timing/overlap_fraction"]


def run_name(name: str) -> str:
    return name.replace(",", "").replace(" ", "_").replace("=", "")


def command(name: str, overrides: list[str], steps: int, extra: list[str], root: Path) -> list[str]:
    """The `hybridflow` overrides of one schedule's run."""
    return ["recipe=grpo", f"trainer.total_steps={steps}", "trainer.export_hf=false", "trainer.val_every_steps=0",
            *overrides, *extra, f"logger.output_root={root}", f"logger.run_name={run_name(name)}"]


def run(name: str, overrides: list[str], steps: int, extra: list[str], root: Path) -> dict:
    cmd = [str(Path(sys.executable).parent / "hybridflow"), *command(name, overrides, steps, extra, root)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return summarize(root / run_name(name))


def summarize(run_dir: Path) -> dict:
    """One finished run, from its metrics.jsonl: the medians over the steps after the first two."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    elapsed = [r["time/elapsed_s"] for r in rows]
    out = {"step_s": statistics.median(b - a for a, b in zip(elapsed[2:], elapsed[3:]))}
    for key in KEYS:
        values = [r[key] for r in rows[2:] if key in r]
        if values:
            out[key] = statistics.median(values)
    return out


def result_line(name: str, result: dict) -> str:
    return f"{name:32s} " + "  ".join(f"{k.split('/')[-1]}={v:.3f}" for k, v in result.items())


DRY_RUN_STEP_S = 1.25  # the dry run's metrics: every step after the first two (warm-up: 5 s, each stage 9 s)


def dry_run(steps: int, extra: list[str], root: Path) -> list[list[str]]:
    """Each schedule's command composed and checked as `hybridflow` checks it, nothing run; the reading of
    its metrics.jsonl run on a small one written here, with the keys a run of that schedule writes."""
    from hybridflow.run.pipeline_stages import compose_command

    commands = []
    for name, overrides in SCHEDULES.items():
        composed = command(name, overrides, steps, extra, root)
        config = compose_command(composed)
        missed = [o for o in [*overrides, f"trainer.total_steps={steps}"] if not carried(config, o)]
        if missed:
            raise SystemExit(f"{name}: the composed config does not carry {' '.join(missed)} (an --extra override "
                             "undoes the schedule?)")
        print(f"{name}: hybridflow {' '.join(composed)}")
        rows = [{"step": s, "time/elapsed_s": 5.0 * min(s, 2) + DRY_RUN_STEP_S * max(s - 2, 0),
                 **{key: 9.0 if s <= 2 else 0.5 for key in KEYS}} for s in range(1, steps + 1)]
        print(result_line(name, summarize(write_metrics(root / run_name(name), rows).parent)))
        commands.append(composed)
    return commands


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--extra", nargs="*", default=[])
    parser.add_argument("--dry-run", action="store_true", help="compose and check each schedule's command, read a "
                                                               "small metrics.jsonl written here; run nothing")
    args = parser.parse_args()
    if args.steps < 4:
        parser.error(f"--steps {args.steps}: the first two steps are warm-up and a median needs two more; give 4 or more")
    with tempfile.TemporaryDirectory() as tmp:
        if args.dry_run:
            dry_run(args.steps, args.extra, Path(tmp))
            return
        for name, overrides in SCHEDULES.items():
            result = run(name, overrides, args.steps, args.extra, Path(tmp))
            print(result_line(name, result), flush=True)


if __name__ == "__main__":
    main()
