"""GRPO and PPO (with a critic) from the default pipeline's SFT model, on several seeds: the learning
claims of docs/results/learning.md and the README, each seed's curve and its gain, the CPU named by its
instruction sets.

    python bench/learning_seeds.py [--seeds 0 1 2] [--pipelines runs/pipeline_seeds] [--root runs/learning_seeds]
                                   [--recipes grpo ppo] [--out bench/results/learning_seeds.json] [key=value ...]
    python bench/learning_seeds.py --dry-run   # compose and check every run's command; run nothing

The starting model of seed s is the default pipeline's PMA merge of that seed's SFT stage
(`<pipelines>/seed<s>/01-grpo/init_model`, the model the pipeline's GRPO stage starts from), written
by `bench/pipeline_seeds.py --seeds s --root <pipelines> stages.sft.data.synthetic.train_rows_not_below=0`
for docs/results/learning.md's runs (the default pipeline's SFT stage before it showed 200 rows of the other half,
docs/results/default_pipeline.md); its held-out accuracy is the pipeline's
own evaluation of it (`01-grpo/init_eval/metrics.jsonl`). So each run starts where the SFT curve has
levelled off, on every seed, not in the middle of a climb. Each recipe then runs its
docs/results/learning.md command (RECIPES below) with `seed=<s>`, one run after another in
`<root>/seed<s>/<recipe>`: a rerun keeps a run whose metrics.jsonl already holds its last step's
validation and runs the others again (`trainer.resume=true`; the runs save no checkpoints, so an
interrupted one starts over). Extra `key=value` arguments go to every run (a learning rate, a length).

Written: `--out` (JSON: the CPU, the commands, per seed and recipe the start, every validation with
its minutes, the first validation 20 points above the start, the accuracy at 5 minutes, the end
and the gain), and the same as a markdown table on stdout. Minutes are `time/elapsed_s`, the wall
clock of the recipe's step loop, validation included (the runs' own metrics.jsonl).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from learning_curves import curve  # noqa: E402

from hybridflow.precision import cpu_description  # noqa: E402

# The tiny model, one rank with both cores, the whole task: what every docs/results/learning.md command takes.
COMMON = ["placement.pools.global.devices_per_node=1", "placement.pools.global.cpus_per_device=2",
          "data.synthetic.train_rows=7700", "data.synthetic.val_rows=500", "trainer.val_prompts=500",
          "trainer.val_every_steps=25", "trainer.prompts_per_step=64", "actor.clip_ratio_high=0.28",
          "actor.optim.lr=1e-4", "actor.optim.warmup_steps=10", "actor.optim.lr_schedule=cosine",
          "trainer.old_log_probs=sampler", "trainer.export_hf=false"]
RECIPES = {
    "grpo": ["recipe=grpo", "trainer.total_steps=500", "rollout.samples_per_prompt=8", "rollout.max_num_seqs=512",
             "actor.samples_per_micro_batch=512", "actor.samples_per_mini_batch=128"],
    "ppo": ["recipe=ppo", "trainer.total_steps=450", "rollout.samples_per_prompt=4", "rollout.max_num_seqs=256",
            "actor.samples_per_micro_batch=256", "actor.samples_per_mini_batch=64",
            "critic.samples_per_micro_batch=256", "critic.samples_per_mini_batch=64",
            "critic.optim.lr=5e-4", "critic.optim.warmup_steps=5", "trainer.critic_warmup_steps=10"],
}
GAIN_MARK = 0.20  # the "+20 points reached" column of docs/results/learning.md
MINUTES_MARK = 5.0


def start_model(pipelines: Path, seed: int) -> tuple[Path, float | None]:
    """The pipeline's merged SFT model for `seed` and its held-out accuracy (None when not yet evaluated)."""
    merge = pipelines / f"seed{seed}" / "01-grpo" / "init_model"
    evaluation = pipelines / f"seed{seed}" / "01-grpo" / "init_eval" / "metrics.jsonl"
    if not (merge / "config.json").is_file():
        return merge, None
    rows = [json.loads(line) for line in evaluation.read_text().splitlines()] if evaluation.is_file() else []
    accuracy = next((r["val/accuracy"] for r in rows if "val/accuracy" in r), None)
    return merge, accuracy


def run_overrides(recipe: str, seed: int, merge: Path, root: Path, extra: list[str]) -> list[str]:
    return [*RECIPES[recipe], *COMMON, f"model.path={merge}", f"seed={seed}",
            f"logger.output_root={root / f'seed{seed}'}", f"logger.run_name={recipe}", "trainer.resume=true", *extra]


def finished(run_dir: Path, overrides: list[str]) -> bool:
    """Whether the run's metrics.jsonl already holds the validation of its last step (the last
    `trainer.total_steps=` of `overrides` wins, as on the command line)."""
    total = [o.split("=", 1)[1] for o in overrides if o.startswith("trainer.total_steps=")][-1]
    return (run_dir / "metrics.jsonl").is_file() and any(step == int(total) for step, _, _ in curve(run_dir))


def summarize(run_dir: Path, start: float) -> dict:
    """A finished run's validations: (step, minutes, accuracy) each, and the columns of the table."""
    points = [[step, round(minutes, 2), round(accuracy, 4)] for step, minutes, accuracy in curve(run_dir)]
    if not points:
        raise SystemExit(f"{run_dir}/metrics.jsonl has no val/accuracy: did the run validate?")
    reached = next((p for p in points if p[2] >= start + GAIN_MARK), None)
    at_mark = [p for p in points if p[1] <= MINUTES_MARK]
    end = points[-1]
    return {"run_dir": str(run_dir), "start_accuracy": round(start, 4), "validations": points,
            "first_plus_20_points": reached, "last_within_5_minutes": at_mark[-1] if at_mark else None,
            "end": end, "gain": round(end[2] - start, 4), "best": max(p[2] for p in points)}


def table(rows: dict[str, dict]) -> str:
    lines = ["| seed | run | start (the merge) | +20 points reached | within 5 min | end | gain at the end |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for key, row in rows.items():
        seed, recipe = key.split("/")
        reached = row["first_plus_20_points"]
        at_mark = row["last_within_5_minutes"]
        lines.append(f"| {seed} | {recipe} | {row['start_accuracy']:.3f} | "
                     + ("not reached" if reached is None else f"{reached[2]:.3f} at {reached[1]:.1f} min") + " | "
                     + ("-" if at_mark is None else f"{at_mark[2]:.3f} ({at_mark[1]:.1f} min)") + " | "
                     + f"{row['end'][2]:.3f} at {row['end'][1]:.1f} min | **{row['gain'] * 100:+.1f}** |")
    return "\n".join(lines)


def dry_run(seeds: list[int], recipes: list[str], pipelines: Path, root: Path, extra: list[str]) -> None:
    """Every run's command composed and checked as `hybridflow` checks it, nothing run; a seed whose
    merge is not there yet is composed against its future path."""
    from hybridflow.run.pipeline_stages import compose_command

    for seed in seeds:
        merge, _ = start_model(pipelines, seed)
        for recipe in recipes:
            overrides = run_overrides(recipe, seed, merge, root, extra)
            config = compose_command(overrides)
            if config.recipe.name != recipe or config.seed != seed:
                raise SystemExit(f"seed {seed}, {recipe}: composed recipe={config.recipe.name} seed={config.seed}")
            print(f"seed {seed} {recipe}: hybridflow {' '.join(overrides)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--recipes", nargs="+", choices=sorted(RECIPES), default=["grpo", "ppo"])
    parser.add_argument("--pipelines", type=Path, default=ROOT / "runs" / "pipeline_seeds")
    parser.add_argument("--root", type=Path, default=ROOT / "runs" / "learning_seeds")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("extra", nargs="*", help="key=value overrides for every run")
    args = parser.parse_args()
    if args.dry_run:
        dry_run(args.seeds, args.recipes, args.pipelines, args.root, args.extra)
        return
    missing = [s for s in args.seeds if start_model(args.pipelines, s)[1] is None]
    if missing:
        raise SystemExit(f"no evaluated PMA merge for seed(s) {missing} under {args.pipelines} "
                         f"(seed<s>/01-grpo/init_model and init_eval/): run the default pipeline first, "
                         f"`python bench/pipeline_seeds.py --seeds {' '.join(map(str, missing))} "
                         f"--root {args.pipelines}`")
    hybridflow = Path(sys.executable).with_name("hybridflow")
    report = {"cpu": cpu_description(), "extra_overrides": args.extra, "commands": {}, "runs": {}}
    for seed in args.seeds:
        merge, start = start_model(args.pipelines, seed)
        for recipe in args.recipes:
            overrides = run_overrides(recipe, seed, merge, args.root, args.extra)
            report["commands"][f"{seed}/{recipe}"] = "hybridflow " + " ".join(overrides)
            run_dir = args.root / f"seed{seed}" / recipe
            if finished(run_dir, overrides):
                print(f"seed {seed} {recipe}: finished before, kept ({run_dir})", flush=True)
            else:
                print(f"seed {seed} {recipe}: hybridflow {' '.join(overrides)}", flush=True)
                done = subprocess.run([str(hybridflow), *overrides], cwd=ROOT,
                                      env={**os.environ, "PYTHONPATH": str(ROOT)})
                if done.returncode != 0 or not finished(run_dir, overrides):
                    raise SystemExit(f"seed {seed} {recipe}: exited with status {done.returncode} without its last "
                                     f"step's validation; its logs are under {run_dir / 'logs'}")
            report["runs"][f"{seed}/{recipe}"] = summarize(run_dir, start)
            if args.out:  # after every run: a long study stopped midway keeps what it measured
                args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{report['cpu']}\n\n{table(report['runs'])}")


if __name__ == "__main__":
    main()
