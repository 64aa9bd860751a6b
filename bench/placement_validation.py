"""Predicted against measured seconds per step for the planner's plans, on this machine.

For each workload: calibrate the rates on it (`hybridflow plan --calibrate`: profiling runs at 1 and
2 devices), rank every plan, run the top three and two others (the median and the slowest predicted)
for STEPS steps each through the `hybridflow` command, and compare each stage's prediction with the
mean of its measured `timing/<stage>_s` over the steps after the first. Writes JSON to OUT
(default bench/results/placement_validation.json; another CPU kind's to a file of its own), each workload's
results with the device they were measured on; docs/placement.md has the tables.

    .venv/bin/python bench/placement_validation.py [gen|update ...] [--out OUT]
    .venv/bin/python bench/placement_validation.py --dry-run --out /tmp/pv.json   # no calibration, no runs
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridflow.run.pipeline_stages import compose_command  # noqa: E402
from hybridflow.planning.calibrate import calibrate, stage_means  # noqa: E402
from hybridflow.planning.cost import Analytical  # noqa: E402
from hybridflow.planning.device_rates import choose_rates, this_device  # noqa: E402
from hybridflow.planning.search import SearchOptions, search  # noqa: E402
from hybridflow.planning.workload import Cluster, Workload  # noqa: E402
from hybridflow.output.tracking import read_metrics  # noqa: E402

STEPS = 6
WORKLOADS = {
    # long answers: generation dominates the step
    "gen": ["recipe=grpo", "rollout.max_response_tokens=160", "trainer.prompts_per_step=32",
            "rollout.samples_per_prompt=4", "model.tiny.max_position_embeddings=256"],
    # PPO with a critic and a reference, a larger model, short answers: the forward passes and updates dominate
    "update": ["recipe=ppo", "algorithm.kl_penalty_coef=0.01", "model.tiny.hidden_size=256",
               "model.tiny.intermediate_size=1024", "model.tiny.num_hidden_layers=6", "rollout.max_response_tokens=16",
               "trainer.prompts_per_step=64", "rollout.samples_per_prompt=2"],
}


def run_overrides(overrides: list[str]) -> list[str]:
    """A measured run's overrides: the workload's and the plan's, STEPS steps, no validation or export."""
    return [*overrides, f"trainer.total_steps={STEPS}", "trainer.val_every_steps=0", "trainer.export_hf=false"]


def measure(overrides: list[str], root: Path, name: str) -> dict[str, float]:
    command = [sys.executable, "-m", "hybridflow.cli", *run_overrides(overrides), f"logger.output_root={root}",
               f"logger.run_name={name}"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise RuntimeError(f"{shlex.join(command)} failed:\n{done.stderr[-3000:]}")
    return stage_means(read_metrics(root / name)[1:])


def chosen_ranks(count: int) -> list[int]:
    """The top three plans, the median and the slowest predicted (indices into the ranking)."""
    return list(dict.fromkeys([0, 1, 2, count // 2, count - 1]))


def dry_run(name: str, overrides: list[str]) -> dict:
    """The plans `validate` would run, ranked with the rates this machine already has (no calibration,
    no runs), each one's command composed as `measure` composes it."""
    config = compose_command(overrides)
    workload = Workload.from_config(config, name)
    cluster = Cluster.this_machine()
    choice = choose_rates(None, "cpu")
    ranked = search(workload, cluster, Analytical(choice.rates), options=SearchOptions()).ranked
    runs = []
    for i in chosen_ranks(len(ranked)):
        c = ranked[i]
        composed = compose_command(run_overrides([*overrides, *c.plan.overrides()]))
        runs.append({"rank": i + 1, "plan": c.plan.describe(), "overrides": c.plan.overrides(),
                     "predicted": {**c.prediction.stages, "step": c.prediction.step_s},
                     "composed_total_steps": composed.trainer.total_steps})
    return {"workload": name, "overrides": overrides, "device": this_device("cpu").describe(),
            "rates": choice.to_dict(), "candidates": len(ranked), "runs": runs, "dry_run": True}


def validate(name: str, overrides: list[str], root: Path) -> dict:
    config = compose_command(overrides)
    workload = Workload.from_config(config, name)
    cluster = Cluster.this_machine()
    start = time.perf_counter()
    rates, profiles = calibrate(overrides, workload, cluster.devices, root / name / "calibration")
    calibration_s = time.perf_counter() - start
    result = search(workload, cluster, Analytical(rates), options=SearchOptions())
    ranked = result.ranked
    chosen = chosen_ranks(len(ranked))
    runs = []
    for i in chosen:
        c = ranked[i]
        measured = measure([*overrides, *c.plan.overrides()], root / name, f"plan-{i + 1}")
        runs.append({"rank": i + 1, "plan": c.plan.describe(), "family": c.plan.family(),
                     "overrides": c.plan.overrides(), "predicted": {**c.prediction.stages, "step": c.prediction.step_s},
                     "measured": measured})
        print(f"{name} #{i + 1} {c.plan.describe()}: predicted {c.prediction.step_s:.2f} s, measured "
              f"{measured['step']:.2f} s", flush=True)
    return {"workload": name, "overrides": overrides, "device": this_device("cpu").describe(), "rates": rates.to_dict(),
            "calibration_s": calibration_s, "profiles": [p.__dict__ for p in profiles], "candidates": len(ranked),
            "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workloads", nargs="*", help=f"of {sorted(WORKLOADS)} (default: all)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "placement_validation.json"),
                        help="the JSON report; a workload already in it is replaced")
    parser.add_argument("--dry-run", action="store_true",
                        help="rank each workload's plans with the rates this machine has, compose the chosen "
                             "plans' commands, and run nothing")
    args = parser.parse_args()
    names = args.workloads or list(WORKLOADS)
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workload(s) {unknown}: choose from {sorted(WORKLOADS)}")
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() and not args.dry_run else {}
    root = None if args.dry_run else Path(tempfile.mkdtemp(prefix="placement-validation-"))
    for name in names:
        results[name] = dry_run(name, WORKLOADS[name]) if args.dry_run else validate(name, WORKLOADS[name], root)
        out.write_text(json.dumps(results, indent=2))
    print(f"written {out}")


if __name__ == "__main__":
    main()
