"""Benchmark: does asynchronous GRPO learn what synchronous GRPO learns, and how fast on the wall?

    PYTHONPATH=. .venv/bin/python bench/async_learning.py --sft SFT_HF_DIR \
        [--steps 120] [--seeds 0 1 2] [--schedules a b c d] [--root runs/async_learning] \
        [--plot bench/results/async_learning.png] [--start ACC] [--report-only]
    PYTHONPATH=. .venv/bin/python bench/async_learning.py --dry-run [--steps 6 --val-every 3] [--seeds 0 1] \
        [--plot x.png]   # compose and check every run's command, report on small metrics; run nothing

The same GRPO task (docs/results/learning.md section 2: 64 prompts x 8 samples, four mini-batches,
clip-higher, lr 1e-4 cosine, 500 held-out prompts) from the same SFT model, in four schedules:

  (a) colocated, synchronous: one rank holds both cores and both roles;
  (b) disaggregated, synchronous: the actor on one core, vLLM on the other;
  (c) disaggregated, trainer.max_staleness=1 (one-step-off);
  (d) disaggregated, trainer.max_staleness=2 with rollout.on_update=recompute (partial rollouts);
  (e) (only when named in --schedules) one-step-off clipping against the sampler's log-probs.

(c) and (d) clip against the actor's recomputed log-probs with the truncated importance weight
(trainer.old_log_probs=actor, algorithm.behavior_is_cap at its default). Every number comes from
the runs' own metrics.jsonl. A run whose metrics.jsonl already reaches --steps is not run again,
so an interrupted benchmark continues where it stopped.

Reported per schedule (mean over seeds): seconds per step (median of the step-to-step
differences of `time/elapsed_s` over steps without validation, after two warm-up steps), the
stage medians, staleness and importance-weight metrics, held-out accuracy at the end, and per
seed the first validated step at which the run reaches the synchronous run's final accuracy
(schedule b, same seed) minus 3 points, as a multiple of the synchronous run's step count.
The plot draws held-out accuracy against wall minutes, one line per run.

`--dry-run` composes and checks every run's command as `hybridflow` checks it (the schedule's
placement, staleness, clipping and partial rollouts, the seed, the step count and the SFT model
must reach the composed config), with the tiny model built into a temporary directory as the SFT
model unless `--sft` is given; then it writes each run a small metrics.jsonl with the keys a run
of that schedule logs and runs the report (and, with `--plot`, the plot, into the temporary
directory) on them. It starts no Ray, engine or training and writes nothing under `--root`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from composed import carried, write_metrics  # noqa: E402
GRPO = ["recipe=grpo", "trainer.prompts_per_step=64", "rollout.samples_per_prompt=8",
        "actor.samples_per_micro_batch=512", "actor.samples_per_mini_batch=128", "actor.clip_ratio_high=0.28",
        "actor.optim.lr=1e-4", "actor.optim.warmup_steps=10", "actor.optim.lr_schedule=cosine",
        "data.synthetic.train_rows=7700", "data.synthetic.val_rows=500", "trainer.val_prompts=500",
        "trainer.export_hf=false", "trainer.save_every_steps=0"]
SCHEDULES = {
    "a": ("colocated, sync", ["placement.pools.global.devices_per_node=1",
                              "placement.pools.global.cpus_per_device=2"]),
    "b": ("disaggregated, sync", ["placement=disaggregated"]),
    "c": ("disaggregated, max_staleness=1", ["placement=disaggregated", "trainer.max_staleness=1",
                                             "trainer.old_log_probs=actor"]),
    "d": ("disaggregated, max_staleness=2, recompute", ["placement=disaggregated", "trainer.max_staleness=2",
                                                        "trainer.old_log_probs=actor",
                                                        "rollout.on_update=recompute"]),
    # not in the default set: one-step-off clipping against the sampler (TRL's way), which leaves
    # the actor's pi_old forward pass off the trainer's path
    "e": ("disaggregated, max_staleness=1, old_log_probs=sampler", ["placement=disaggregated",
                                                                    "trainer.max_staleness=1",
                                                                    "trainer.old_log_probs=sampler"]),
}
DEFAULT_SCHEDULES = ["a", "b", "c", "d"]
STAGE_KEYS = ["timing/generate_s", "timing/generate_wait_s", "timing/update_s", "timing/weight_sync_s",
              "timing/overlap_fraction", "async/rollout_weights_wait_s"]
MEAN_KEYS = ["async/staleness_mean", "rollout_correction/weight_mean", "rollout_correction/clipped_fraction"]
MAX_KEYS = ["async/staleness_max", "async/version_span_max"]
REACH_MARGIN = 0.03


def run_dir(root: Path, schedule: str, seed: int) -> Path:
    return root / f"{schedule}_seed{seed}"


def read_rows(path: Path) -> list[dict]:
    metrics = path / "metrics.jsonl"
    if not metrics.exists():
        return []
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def finished(path: Path, steps: int) -> bool:
    return any(row.get("step") == steps and "val/accuracy" in row for row in read_rows(path))


def command(sft: Path, root: Path, schedule: str, seed: int, steps: int, val_every: int) -> list[str]:
    """The `hybridflow` overrides of one run."""
    return [*GRPO, *SCHEDULES[schedule][1], f"model.path={sft}", f"seed={seed}", f"trainer.total_steps={steps}",
            f"trainer.val_every_steps={val_every}", f"logger.output_root={root}",
            f"logger.run_name={run_dir(root, schedule, seed).name}"]


def launch(sft: Path, root: Path, schedule: str, seed: int, steps: int, val_every: int) -> None:
    path = run_dir(root, schedule, seed)
    if finished(path, steps):
        print(f"{path.name}: done already", flush=True)
        return
    cmd = [str(Path(sys.executable).parent / "hybridflow"), *command(sft, root, schedule, seed, steps, val_every)]
    if path.exists():
        shutil.rmtree(path)  # an interrupted run starts over: its seed fixes what it draws
    print("$ " + " ".join(cmd[1:]), flush=True)
    with open(root / f"{path.name}.log", "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def summarize(rows: list[dict]) -> dict:
    by_step = {row["step"]: row for row in rows if "step" in row}
    steps = sorted(by_step)
    plain = [s for s in steps[2:] if s - 1 in by_step and "val/accuracy" not in by_step[s]
             and "val/accuracy" not in by_step[s - 1]]
    out = {"step_s": statistics.median(by_step[s]["time/elapsed_s"] - by_step[s - 1]["time/elapsed_s"]
                                       for s in plain)}
    for key in STAGE_KEYS:
        values = [by_step[s][key] for s in plain if key in by_step[s]]
        if values:
            out[key] = statistics.median(values)
    for key in MEAN_KEYS:
        values = [by_step[s][key] for s in steps if key in by_step[s]]
        if values:
            out[key] = statistics.fmean(values)
    for key in MAX_KEYS:
        values = [by_step[s][key] for s in steps if key in by_step[s]]
        if values:
            out[key] = max(values)
    curve = [(s, by_step[s]["time/elapsed_s"] / 60, by_step[s]["val/accuracy"]) for s in steps
             if "val/accuracy" in by_step[s]]
    out["curve"] = curve
    out["final_accuracy"] = curve[-1][2]
    out["minutes"] = curve[-1][1]
    return out


def first_reach(curve: list[tuple[int, float, float]], target: float) -> tuple[int, float] | None:
    """(step, wall minutes) of the first validation at or above `target`."""
    return next(((step, minutes) for step, minutes, acc in curve if acc >= target), None)


def report(root: Path, schedules: list[str], seeds: list[int], steps: int) -> dict:
    results = {k: {seed: summarize(read_rows(run_dir(root, k, seed))) for seed in seeds
                   if finished(run_dir(root, k, seed), steps)} for k in schedules}
    print("\n| schedule | s/step | generate s | trainer waited s | update s | sync s | overlap | "
          "staleness mean / max | IS weight mean | IS clipped | held-out acc at the end | minutes |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for k in schedules:
        runs = list(results[k].values())
        if not runs:
            continue

        def mean(key: str, fmt: str = "{:.3f}") -> str:
            values = [r[key] for r in runs if key in r]
            return fmt.format(statistics.fmean(values)) if values else "-"

        accs = [r["final_accuracy"] for r in runs]
        spread = f" ± {statistics.stdev(accs):.3f}" if len(accs) > 1 else ""
        staleness = (f"{mean('async/staleness_mean', '{:.2f}')} / {mean('async/staleness_max', '{:.0f}')}"
                     if any("async/staleness_mean" in r for r in runs) else "0 / 0")
        print(f"| ({k}) {SCHEDULES[k][0]} | {mean('step_s')} | {mean('timing/generate_s')} | "
              f"{mean('timing/generate_wait_s')} | {mean('timing/update_s')} | {mean('timing/weight_sync_s')} | "
              f"{mean('timing/overlap_fraction', '{:.2f}')} | {staleness} | {mean('rollout_correction/weight_mean', '{:.4f}')} | "
              f"{mean('rollout_correction/clipped_fraction', '{:.4f}')} | {statistics.fmean(accs):.3f}{spread} | "
              f"{mean('minutes', '{:.1f}')} |")
    val_steps = sorted({s for runs in results.values() for r in runs.values() for s, _, _ in r["curve"]})
    print("\nHeld-out accuracy by step, mean over seeds:\n")
    print("| schedule | " + " | ".join(f"step {s}" for s in val_steps) + " |")
    print("| --- |" + " --- |" * len(val_steps))
    for k in schedules:
        if results[k]:
            cells = [statistics.fmean(acc for r in results[k].values() for s2, _, acc in r["curve"] if s2 == s)
                     for s in val_steps]
            print(f"| ({k}) | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    if "b" in schedules and results["b"]:
        print("\nLargest shortfall against (b) at the same validated step (points; mean over seeds, then the "
              "worst single seed against the same seed):")
        for k in [k for k in schedules if k != "b" and results[k]]:
            def by_step(run: dict) -> dict[int, float]:
                return {s: acc for s, _, acc in run["curve"]}
            mean_gap = max(statistics.fmean(by_step(results["b"][seed])[s] - by_step(r)[s]
                                            for seed, r in results[k].items() if seed in results["b"])
                           for s in val_steps)
            seed_gap = max(by_step(results["b"][seed])[s] - by_step(r)[s]
                           for seed, r in results[k].items() if seed in results["b"] for s in val_steps)
            print(f"  ({k}) {100 * mean_gap:+.1f} mean, {100 * seed_gap:+.1f} worst seed")
        sync = list(results["b"].values())
        generate = statistics.fmean(r["timing/generate_s"] for r in sync)
        update = statistics.fmean(r["timing/update_s"] for r in sync)
        trainer = statistics.fmean(r["step_s"] - r["timing/generate_s"] for r in sync)
        print(f"\nSynchronous disaggregated step (b): generate {generate:.3f} s, update stage {update:.3f} s, "
              f"the trainer's part (the step but generation: rewards and the actor's "
              f"log-probs, advantages, update, sync) {trainer:.3f} s")
        for k in [k for k in schedules if k in "cde" and results[k]]:
            step = statistics.fmean(r["step_s"] for r in results[k].values())
            print(f"  ({k}) {step:.3f} s/step = {step / max(generate, update):.2f}x max(generate, update stage), "
                  f"{step / max(generate, trainer):.2f}x max(generate, trainer's part), "
                  f"{statistics.fmean(r['step_s'] for r in sync) / step:.2f}x faster than (b)")
        print(f"\nFirst validated step reaching the synchronous run's (b, same seed) final accuracy - "
              f"{REACH_MARGIN:.2f}, over {steps} steps:")
        for k in schedules:
            cells = []
            for seed, r in results[k].items():
                if seed not in results["b"]:
                    continue
                target = results["b"][seed]["final_accuracy"] - REACH_MARGIN
                reached = first_reach(r["curve"], target)
                cells.append(f"seed {seed}: target {target:.3f}, "
                             + (f"step {reached[0]} ({reached[0] / steps:.2f}x), {reached[1]:.2f} min"
                                if reached else "not reached"))
            print(f"  ({k}) " + "; ".join(cells))
    return results


def plot(results: dict, out: Path, start: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    colors = {"a": "tab:gray", "b": "tab:blue", "c": "tab:orange", "d": "tab:green", "e": "tab:purple"}
    for k, runs in results.items():
        for i, r in enumerate(runs.values()):
            start_point = [(0, 0.0, start)] if start is not None else []  # every run starts from the SFT model
            minutes = [m for _, m, _ in start_point + r["curve"]]
            accs = [a for _, _, a in start_point + r["curve"]]
            ax.plot(minutes, accs, color=colors[k], alpha=0.8, marker=".",
                    label=f"({k}) {SCHEDULES[k][0]}" if i == 0 else None)
    if start is not None:
        ax.axhline(start, color="black", linestyle="--", linewidth=1, label=f"the SFT model ({start:.3f})")
    ax.set_xlabel("wall minutes (time/elapsed_s, validation included)")
    ax.set_ylabel("held-out accuracy (500 prompts, greedy)")
    seeds = max(len(runs) for runs in results.values())
    ax.set_title(f"GRPO from the same SFT model, {seeds} seeds per schedule, one line per run")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot: {out}")


def dry_run_rows(config, steps: int) -> list[dict]:
    """A small metrics.jsonl of a run of `config`: the keys its schedule logs (staleness when
    asynchronous, importance weights when clipping against the actor, version spans with partial
    rollouts), a step of 2 s synchronous and 1 s asynchronous, accuracy rising from 0.2 to 0.6."""
    t = config.trainer
    step_s = 1.0 if t.max_staleness else 2.0
    rows = []
    for step in range(1, steps + 1):
        row = {"step": step, "time/elapsed_s": step * step_s, "timing/generate_s": 0.8, "timing/update_s": 0.6,
               "timing/weight_sync_s": 0.1, "timing/generate_wait_s": 0.2 if t.max_staleness else 0.8,
               "timing/overlap_fraction": 0.75 if t.max_staleness else 0.0}
        if t.max_staleness:
            row.update({"async/staleness_mean": 1.0, "async/staleness_max": float(t.max_staleness),
                        "async/rollout_weights_wait_s": 0.0})
            if t.old_log_probs == "actor":
                row.update({"rollout_correction/weight_mean": 0.99, "rollout_correction/clipped_fraction": 0.01})
        if config.rollout.on_update == "recompute":
            row["async/version_span_max"] = 1.0
        if t.val_every_steps and step % t.val_every_steps == 0 or step == steps:  # hybridflow.run.runner.validation_due
            row["val/accuracy"] = 0.2 + 0.4 * step / steps
        rows.append(row)
    return rows


def dry_run(args) -> None:
    """Every run's command composed and checked as `hybridflow` checks it, nothing run; the report (and
    the plot) on small metrics written into a temporary directory, never under --root."""
    import tempfile

    from hybridflow.builders import build_tiny_model
    from hybridflow.run.pipeline_stages import compose_command

    with tempfile.TemporaryDirectory() as tmp:
        sft = args.sft.resolve() if args.sft else build_tiny_model(Path(tmp) / "sft")  # the tiny model as "SFT"
        fake_root = Path(tmp) / "runs"
        for seed in args.seeds:
            for k in args.schedules:
                overrides = command(sft, args.root.resolve(), k, seed, args.steps, args.val_every)
                config = compose_command(overrides)
                varied = [*SCHEDULES[k][1], f"model.path={sft}", f"seed={seed}", f"trainer.total_steps={args.steps}",
                          f"trainer.val_every_steps={args.val_every}"]
                missed = [o for o in varied if not carried(config, o)]
                if missed:
                    raise SystemExit(f"({k}) seed {seed}: the composed config does not carry {' '.join(missed)}")
                print(f"{run_dir(args.root, k, seed).name}: hybridflow {' '.join(overrides)}")
                write_metrics(run_dir(fake_root, k, seed), dry_run_rows(config, args.steps))
        results = report(fake_root, args.schedules, args.seeds, args.steps)
        if any(len(runs) != len(args.seeds) for runs in results.values()):
            raise SystemExit("the report did not read every run's metrics.jsonl as finished")
        if args.plot:
            out = Path(tmp) / args.plot.name
            plot(results, out, args.start)
            if out.stat().st_size == 0:
                raise SystemExit(f"{out}: the plot is empty")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sft", type=Path, default=None,
                        help="the SFT model (a checkpoint's hf/ directory); required but in a dry run")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--val-every", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--schedules", nargs="+", default=DEFAULT_SCHEDULES, choices=list(SCHEDULES))
    parser.add_argument("--root", type=Path, default=ROOT / "runs" / "async_learning")
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--start", type=float, default=None, help="the SFT model's held-out accuracy, drawn dashed")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--dry-run", action="store_true",
                        help="compose and check every run's command, report on small metrics written here; run nothing")
    args = parser.parse_args()
    if args.val_every < 3:
        parser.error(f"--val-every {args.val_every}: a step is timed between two steps without a validation, "
                     "and the curve needs validations; give 3 or more")
    if args.sft is None and not args.dry_run:
        parser.error("the following arguments are required: --sft")
    if args.sft is not None and not (args.sft / "config.json").exists():
        sys.exit(f"--sft {args.sft}: no config.json there; pass a checkpoint's hf/ directory "
                 "(docs/results/learning.md section 1 makes one)")
    if args.dry_run:
        dry_run(args)
        return
    args.root.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        for seed in args.seeds:
            for k in args.schedules:
                launch(args.sft.resolve(), args.root.resolve(), k, seed, args.steps, args.val_every)
    results = report(args.root, args.schedules, args.seeds, args.steps)
    if args.plot:
        plot(results, args.plot, args.start)


if __name__ == "__main__":
    main()
