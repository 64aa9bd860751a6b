"""The default pipeline (`hybridflow`, conf/recipe/pipeline.yaml) on several seeds: each stage's
held-out accuracy and minutes per seed, the CPU named by its instruction sets.

    python bench/pipeline_seeds.py [--seeds 0 1 2] [--root runs/pipeline_seeds] [--out bench/results/pipeline_seeds.json] [key=value ...]
    python bench/pipeline_seeds.py --kernels avx2 ...    # torch's CPU kernels limited to AVX2: another rounding
    python bench/pipeline_seeds.py --dry-run            # compose and check every seed's command; run nothing
    python bench/pipeline_seeds.py --summarize RUN_DIR  # the table row of one finished pipeline run

Each seed is the README's main command with `seed=<s> model.tiny.seed=<s>` (the model's
initialisation, sampling and data order; the held-out set is the same for every seed), run one
after another in its own run directory under `--root`, with `trainer.resume=true`: a rerun skips
the seeds and stages already finished. Extra `key=value` arguments go to every seed's command (a
candidate stage length, learning rate or task). A stage's minutes are wall clock between the
`STAGE_COMPLETE` markers (the first from the command's start), so start-up and the merged model's
evaluation are counted where they happen; the whole run's minutes are the command's own.

`--kernels avx2` runs every seed with torch's CPU kernels limited to AVX2 (`AVX2_KERNELS`: ATen's
vectorised kernels, MKL's GEMMs and oneDNN), so a CPU with AVX-512 rounds its sums in another order,
as a CPU without AVX-512 does: a check that a gain is the recipe's, not one machine's rounding,
without the other machine. It does not reproduce an AVX2-only CPU's numbers (seed 0's SFT accuracy
at step 300 was 0.256 on a 2-core AMD EPYC with AVX2 only, 0.220 forced here, 0.140 unforced, and none
of MKL's other code paths gave 0.256; docs/results/default_pipeline.md), nor its speed, and vLLM's own kernels stay
those the CPU has.

Written: `--out` (JSON: the CPU, the commands, per seed the stages' starting and final accuracy,
minutes, and GRPO's gain over its start), and the same as a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridflow.precision import cpu_description  # noqa: E402

# torch's CPU kernels limited to AVX2 (--kernels avx2): ATen's dispatch, MKL's and oneDNN's code paths
AVX2_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
KERNELS = {"native": {}, "avx2": AVX2_KERNELS}


def kernels_in_effect(env: dict[str, str]) -> str:
    """ATen's CPU capability in a Python started with `env` (what torch says, not what was asked)."""
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise SystemExit(f"torch did not start with {env}: {done.stderr[-2000:]}")
    return done.stdout.strip()


def seed_overrides(seed: int, root: Path, extra: list[str]) -> list[str]:
    return [f"seed={seed}", f"model.tiny.seed={seed}", f"logger.output_root={root}", f"logger.run_name=seed{seed}",
            "trainer.resume=true", *extra]


def summarize(run_dir: Path, started_s: float | None = None) -> dict:
    """One finished pipeline run: per stage its starting and final held-out accuracy and minutes."""
    stages, previous_s = [], started_s
    for marker in sorted(run_dir.glob("*/STAGE_COMPLETE")):
        result = json.loads(marker.read_text())
        done_s = marker.stat().st_mtime
        ran_now = previous_s is not None and done_s >= previous_s  # not a stage a resumed run skipped
        stages.append({"stage": result["stage"], "recipe": result["recipe"],
                       "init_accuracy": result.get("init_accuracy"), "final_accuracy": result.get("final_accuracy"),
                       "minutes": round((done_s - previous_s) / 60, 2) if ran_now else None})
        previous_s = done_s if previous_s is None else max(previous_s, done_s)  # a skipped stage's old mark
    if not stages:
        raise SystemExit(f"{run_dir}: no finished stage (no */STAGE_COMPLETE); is it a pipeline's run directory?")
    last = stages[-1]
    gain = (None if last["init_accuracy"] is None or last["final_accuracy"] is None
            else round(last["final_accuracy"] - last["init_accuracy"], 4))
    return {"run_dir": str(run_dir), "stages": stages, "last_stage_gain": gain}


def table(rows: dict[int, dict]) -> str:
    names = [s["stage"] for s in next(iter(rows.values()))["stages"]]
    head = ["seed"] + [f"{n} start / end (min)" for n in names] + ["last stage's gain", "minutes in all"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for seed, row in rows.items():
        cells = [str(seed)]
        for s in row["stages"]:
            start = "" if s["init_accuracy"] is None else f"{s['init_accuracy']:.3f} -> "
            minutes = "" if s["minutes"] is None else f" ({s['minutes']:.1f})"
            end = "-" if s["final_accuracy"] is None else f"{s['final_accuracy']:.3f}"
            cells.append(f"{start}{end}{minutes}")
        gain = row["last_stage_gain"]
        cells.append("" if gain is None else f"{gain * 100:+.1f} points")
        cells.append("" if row.get("minutes") is None else f"{row['minutes']:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def dry_run(seeds: list[int], root: Path, extra: list[str], kernels: str) -> None:
    """Every seed's command composed and checked as the command checks it, and the kernels torch
    runs with `--kernels`; nothing run."""
    from hybridflow.run.pipeline_stages import compose_command

    print(f"kernels: {kernels} (torch: {kernels_in_effect({**os.environ, **KERNELS[kernels]})})")

    for seed in seeds:
        config, by_name = compose_command(seed_overrides(seed, root, extra), with_stages=True)
        stages = list(by_name.values())
        if not all(s.seed == seed and s.model.tiny.seed == seed for s in stages):
            raise SystemExit(f"seed {seed} does not reach every stage of {config.recipe.name}")
        print(f"seed {seed}: hybridflow {' '.join(seed_overrides(seed, root, extra))} "
              f"({len(stages)} stages: {', '.join(s.recipe.name for s in stages)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--root", type=Path, default=ROOT / "runs" / "pipeline_seeds")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--summarize", type=Path, default=None)
    parser.add_argument("--kernels", choices=sorted(KERNELS), default="native",
                        help="avx2: torch's CPU kernels limited to AVX2 (another rounding on a CPU with AVX-512)")
    parser.add_argument("extra", nargs="*", help="key=value overrides for every seed's command")
    args = parser.parse_args()
    if args.summarize:
        print(json.dumps(summarize(args.summarize), indent=2))
        return
    if args.dry_run:
        dry_run(args.seeds, args.root, args.extra, args.kernels)
        return
    hybridflow = Path(sys.executable).with_name("hybridflow")
    env = {**os.environ, **KERNELS[args.kernels], "PYTHONPATH": str(ROOT)}
    cpu = cpu_description()
    if args.kernels != "native":
        cpu += f", torch's kernels limited to {kernels_in_effect(env)} ({', '.join(f'{k}={v}' for k, v in KERNELS[args.kernels].items())})"
    report = {"cpu": cpu, "kernels": args.kernels, "extra_overrides": args.extra, "seeds": {}}
    for seed in args.seeds:
        command = [str(hybridflow), *seed_overrides(seed, args.root, args.extra)]
        print(f"seed {seed}: {' '.join(command)}", flush=True)
        started_s = time.time()
        done = subprocess.run(command, cwd=ROOT, env=env)
        if done.returncode != 0:
            raise SystemExit(f"seed {seed}: the pipeline exited with status {done.returncode}; "
                             f"its logs are under {args.root / f'seed{seed}' / 'logs'}")
        row = summarize(args.root / f"seed{seed}", started_s)
        row["minutes"] = round((time.time() - started_s) / 60, 2)
        report["seeds"][seed] = row
        if args.out:  # after every seed: a long run stopped midway keeps what it measured
            args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{report['cpu']}\n\n{table(report['seeds'])}")


if __name__ == "__main__":
    main()
