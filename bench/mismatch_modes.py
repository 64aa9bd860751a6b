"""The rollout-training mismatch on the real model in bfloat16, four ways side by side: no correction, a
correction preset, an fp32 output head, and the exact engine.

    PYTHONPATH=. .venv/bin/python bench/mismatch_modes.py [--steps 10] [--val-every 5] [--val-rows 50] \
        [--modes none,token_tis,fp32_head,exact] [--out bench/results/mismatch_modes.json]
    PYTHONPATH=. .venv/bin/python bench/mismatch_modes.py --dry-run   # each mode's command composed and checked
    PYTHONPATH=. .venv/bin/python bench/mismatch_modes.py --render-only A.json   # the doc's table again

The same `recipe=grpo` run from the same seed on SmolLM2-135M-Instruct (tests/real_model.py: two-digit
additions as chat, answers of up to `--response-tokens`), in bfloat16 (model.dtype and rollout.dtype), in one
process (placement=local), with the `hf` engine in every mode but the exact one, so that each mode
changes one thing: `none` (algorithm.rollout_correction=none), `token_tis` (token-level truncated
importance sampling, C = 2, with the actor's recomputed old log-probs), `fp32_head` (the output head's
matmul and logits in float32 in the actor and the engine), `exact` (rollout.backend=exact: the engine
samples from the actor's own forward pass). Reported per mode, from the run's own metrics.jsonl:
`rollout_mismatch/*` per step (mean and largest |log pi_trainer - log pi_sampler|, the share of tokens
outside the band, k3 KL), the training batch's accuracy, held-out accuracy (greedy, `--val-rows`
prompts) at every validation, the generation seconds per step and the minutes. JSON to `--out` as it
goes; the table between the markers in docs/results/rollout_mismatch.md. Run nothing else heavy meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

MODES = {  # what each mode changes, on top of the common overrides
    "none": ["rollout.backend=hf", "algorithm.rollout_correction=none"],
    "token_tis": ["rollout.backend=hf", "algorithm.rollout_correction=token_tis"],
    "fp32_head": ["rollout.backend=hf", "algorithm.rollout_correction=none", "actor.fp32_lm_head=true",
                  "rollout.fp32_lm_head=true"],
    "exact": ["rollout.backend=exact", "algorithm.rollout_correction=none"],
}
METRICS = ("abs_diff_mean", "abs_diff_max", "outside_band_fraction", "k3_kl")
BEGIN, END = "<!-- mismatch_modes:begin -->", "<!-- mismatch_modes:end -->"


def command(args, mode: str, inputs: dict, work: Path) -> list[str]:
    """The `hybridflow` overrides of one mode's run."""
    from tests.real_model import real_overrides

    common = ["recipe=grpo", "placement=local", f"seed={args.seed}", f"trainer.total_steps={args.steps}",
              f"trainer.val_every_steps={args.val_every}", f"trainer.prompts_per_step={args.prompts_per_step}",
              f"rollout.samples_per_prompt={args.samples_per_prompt}", "trainer.export_hf=false",
              "trainer.save_every_steps=0", f"logger.output_root={work / 'runs'}", f"logger.run_name={mode}",
              "logger.backends=[jsonl]", *MODES[mode]]
    if args.dry_run:  # the tiny model and the synthetic task
        return [*common, "trainer.val_prompts=4", "data.synthetic.val_rows=4", "rollout.max_response_tokens=4"]
    return [*real_overrides(inputs["model"], inputs["train"], inputs["val"]), *common,
            f"trainer.val_prompts={args.val_rows}", f"rollout.max_response_tokens={args.response_tokens}",
            "model.dtype=bfloat16", "rollout.dtype=bfloat16"]


def summarize(run_dir: Path, command: list[str], wall_s: float) -> dict:
    """One mode's finished run, from its metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollout_mismatch/abs_diff_mean" in r]
    return {"command": command, "wall_s": wall_s,
            "per_step": [{"step": r["step"], **{m: r[f"rollout_mismatch/{m}"] for m in METRICS},
                          "accuracy": r.get("reward/accuracy")} for r in steps],
            "means": {m: statistics.fmean(r[f"rollout_mismatch/{m}"] for r in steps) for m in METRICS},
            "generate_s_median": statistics.median(r["timing/generate_s"] for r in rows if "timing/generate_s" in r),
            "validation": [{"step": r["step"], "accuracy": r["val/accuracy"]} for r in rows if "val/accuracy" in r]}


def dry_run(args, work: Path) -> list[list[str]]:
    """Each mode's command on the tiny model, composed and checked as the command checks it; nothing run."""
    from hybridflow.run.pipeline_stages import compose_command

    commands = []
    for mode in args.modes.split(","):
        overrides = command(args, mode, {}, work)
        config = compose_command(overrides)
        backend = "exact" if mode == "exact" else "hf"
        if config.rollout.backend != backend:
            raise SystemExit(f"{mode}: the composed config runs rollout.backend={config.rollout.backend}, not {backend}")
        print(f"{mode}: hybridflow {' '.join(overrides)}")
        commands.append(overrides)
    return commands


def run(args, mode: str, inputs: dict, work: Path) -> dict:
    overrides = command(args, mode, inputs, work)
    shutil.rmtree(work / "runs" / mode, ignore_errors=True)
    log = work / f"{mode}.log"
    print(f"{mode}: hybridflow {' '.join(overrides)}\n  log: {log}", flush=True)
    start = time.perf_counter()
    with open(log, "w") as out:
        done = subprocess.run([str(Path(sys.executable).parent / "hybridflow"), *overrides], cwd=ROOT, stdout=out,
                              stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode:
        return {"command": ["hybridflow", *overrides], "error": f"exit status {done.returncode}",
                "log_tail": log.read_text().splitlines()[-20:]}
    return summarize(work / "runs" / mode, ["hybridflow", *overrides], time.perf_counter() - start)


def render(report: dict) -> str:
    """The table for docs/results/rollout_mismatch.md: one row per mode."""
    a = report["args"]
    val_steps = sorted({v["step"] for r in report["modes"].values() for v in r.get("validation", [])})
    lines = [f"Measured {report['date']} on this machine ({report['cpu']}): `bench/mismatch_modes.py` (SmolLM2-135M-"
             f"Instruct, bfloat16, GRPO, {a['prompts_per_step']} prompts x {a['samples_per_prompt']} samples, answers "
             f"of up to {a['response_tokens']} tokens, seed {a['seed']}, {a['steps']} steps, one process; held-out accuracy greedy on "
             f"{a['val_rows']} prompts). Mismatch columns: the mean over the steps of each step's value.", "",
             "| mode | mean \\|Δ\\| | largest \\|Δ\\| | outside the band | k3 KL | "
             + " | ".join(f"accuracy at step {s}" for s in val_steps) + " | generate s (median) | minutes |",
             "| --- |" + " ---: |" * (6 + len(val_steps))]
    for mode, r in report["modes"].items():
        if "error" in r:
            lines.append(f"| {mode} | did not run: {r['error']} |" + " |" * (5 + len(val_steps)))
            continue
        m, acc = r["means"], {v["step"]: v["accuracy"] for v in r["validation"]}
        lines.append(f"| {mode} | {m['abs_diff_mean']:.2e} | {m['abs_diff_max']:.2e} | "
                     f"{m['outside_band_fraction']:.2%} | {m['k3_kl']:.2e} | "
                     + " | ".join(f"{acc[s]:.2f}" if s in acc else "" for s in val_steps)
                     + f" | {r['generate_s_median']:.1f} | {r['wall_s'] / 60:.1f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--val-every", type=int, default=5)
    p.add_argument("--val-rows", type=int, default=50)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--samples-per-prompt", type=int, default=4)
    p.add_argument("--response-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default="/tmp/mismatch_modes")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "mismatch_modes.json"))
    p.add_argument("--dry-run", action="store_true", help="compose and check each mode's command on the tiny model")
    p.add_argument("--doc", default=str(ROOT / "docs" / "results" / "rollout_mismatch.md"))
    p.add_argument("--render-only", nargs="?", const="", metavar="JSON", help="rewrite the doc's table, run nothing")
    args = p.parse_args()
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown:
        raise SystemExit(f"--modes: unknown {unknown}; known: {list(MODES)}")
    from doc_markers import write_between

    if args.render_only is not None:
        write_between(Path(args.doc), BEGIN, END, render(json.loads(Path(args.render_only or args.out).read_text())))
        return
    work = Path(args.work).resolve()
    if args.dry_run:
        args.steps, args.val_every = 1, 1
        dry_run(args, work)
        return
    work.mkdir(parents=True, exist_ok=True)
    from hybridflow.precision import cpu_description
    from tests.real_model import real_model_dir, write_chat_addition

    train, val = write_chat_addition(work / "data", train_rows=2000, val_rows=args.val_rows)
    inputs = {"model": real_model_dir(), "train": train, "val": val}
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_description(),
              "args": vars(args), "modes": {}}
    for mode in args.modes.split(","):
        report["modes"][mode] = run(args, mode, inputs, work)
        Path(args.out).write_text(json.dumps(report, indent=1))  # as it goes
    write_between(Path(args.doc), BEGIN, END, render(report))
    print(render(report))


if __name__ == "__main__":
    main()
