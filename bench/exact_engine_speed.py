"""What the exact engine costs in generation speed: GRPO steps with rollout.backend=exact against
rollout.backend=hf on the same run settings, and the mismatch each leaves.

    PYTHONPATH=. .venv/bin/python bench/exact_engine_speed.py [--shapes tiny:128x8 tiny:128x32 real:8x32] \
        [--repeats 2] [--steps 4] [--out bench/results/exact_engine_speed.json]
    PYTHONPATH=. .venv/bin/python bench/exact_engine_speed.py --dry-run   # tiny:16x4, 2 steps, once each, no doc

A shape is `model:ROWSxTOKENS`: `tiny` the tiny model and its synthetic task (hybridflow.builders), `real`
SmolLM2-135M-Instruct on two-digit additions as chat (tests/real_model.py); ROWS samples a step (ROWS / 4
prompts x 4 samples), answers of up to TOKENS tokens. Each run is `hybridflow placement=local recipe=grpo` in
float32 (model.dtype, rollout.dtype) with trainer.old_log_probs=actor for both engines (the exact engine's
`auto`), so the steps differ in the engine alone; the engines alternate (exact, hf, exact, hf: timings
drift, docs/results/ci_times.md), `--repeats` runs each. Reported per shape, from each run's metrics.jsonl,
over the steps after the first (its warm-up): the median `timing/generate_s` of each engine and their
ratio, the response tokens per second, the median `timing/actor_forward_s` (the actor's π_old pass: the
exact engine's replays its decode, the hf run's is the usual pass), the median `timing/weight_sync_s` (the exact engine moves no
weights and runs no sync probe), and the largest `rollout_mismatch/abs_diff_max` of any step. JSON to `--out`;
the table between the markers of docs/results/rollout_mismatch.md. Run nothing else heavy meanwhile.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

ENGINES = ("exact", "hf")
SAMPLES_PER_PROMPT = 4
BEGIN, END = "<!-- exact_engine_speed:begin -->", "<!-- exact_engine_speed:end -->"
# `hybridflow placement=local` with Ray's import blocked, as tests/e2e/cli_in_one_process.py runs it
WITHOUT_RAY = "import sys; sys.modules['ray'] = None; from hybridflow.cli import main; sys.exit(main())"


def overrides(model: str, rows: int, tokens: int, engine: str, steps: int, inputs: dict, run_dir: Path) -> list[str]:
    """One run's command-line overrides."""
    common = ["placement=local", "recipe=grpo", f"rollout.backend={engine}", "trainer.old_log_probs=actor",
              f"trainer.total_steps={steps}", f"trainer.prompts_per_step={rows // SAMPLES_PER_PROMPT}",
              f"rollout.samples_per_prompt={SAMPLES_PER_PROMPT}", f"rollout.max_response_tokens={tokens}",
              "trainer.val_every_steps=0", "trainer.export_hf=false", "trainer.save_every_steps=0",
              "logger.backends=[jsonl]", f"logger.output_root={run_dir.parent}", f"logger.run_name={run_dir.name}"]
    if model == "tiny":
        return [*common, "model.dtype=float32", "rollout.dtype=float32"]
    from tests.real_model import real_overrides

    real = [o for o in real_overrides(inputs["model"], inputs["train"], inputs["val"])
            if not o.startswith("rollout.max_response_tokens=")]  # the shape's, above
    return [*real, *common, "trainer.val_prompts=16"]  # the data written holds 16; no validation runs


def one_run(args: list[str], run_dir: Path) -> dict:
    """Run it; the per-step rows of its metrics.jsonl, or the error."""
    shutil.rmtree(run_dir, ignore_errors=True)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", WITHOUT_RAY, *args], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        return {"error": f"exit status {done.returncode}", "tail": (done.stdout + done.stderr)[-3000:]}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"wall_s": time.perf_counter() - start, "steps": rows}


def summarize(runs: list[dict]) -> dict:
    """One engine's runs at one shape: medians over the steps after each run's first."""
    later = [r for run in runs for r in run["steps"][1:]]
    generate = [r["timing/generate_s"] for r in later]
    return {"generate_s_median": statistics.median(generate),
            "response_tokens_per_s": statistics.median(r["response/tokens"] / r["timing/generate_s"] for r in later),
            "response_length_mean": statistics.fmean(r["response/length_mean"] for r in later),
            "weight_sync_s_median": statistics.median(r["timing/weight_sync_s"] for r in later),
            "old_log_probs_s_median": statistics.median(r["timing/actor_forward_s"] for r in later),
            "abs_diff_max": max(r["rollout_mismatch/abs_diff_max"] for run in runs for r in run["steps"]),
            "abs_diff_mean_max": max(r["rollout_mismatch/abs_diff_mean"] for run in runs for r in run["steps"]),
            "steps_timed": len(later)}


def measure(spec: str, repeats: int, steps: int, inputs: dict, work: Path) -> dict:
    model, shape = spec.split(":")
    rows, tokens = (int(n) for n in shape.split("x"))
    runs: dict[str, list[dict]] = {e: [] for e in ENGINES}
    commands = {}
    for repeat in range(repeats):
        for engine in ENGINES:  # interleaved
            run_dir = work / "runs" / f"{model}_{rows}x{tokens}_{engine}_{repeat}"
            args = overrides(model, rows, tokens, engine, steps, inputs, run_dir)
            commands[engine] = "hybridflow " + " ".join(a for a in args if not a.startswith("logger."))
            print(f"{spec} {engine} #{repeat + 1}: {commands[engine]}", flush=True)
            result = one_run(args, run_dir)
            if "error" in result:
                return {"shape": spec, "error": f"{engine}: {result['error']}", "tail": result["tail"]}
            runs[engine].append(result)
    out = {"shape": spec, "model": model, "rows": rows, "tokens": tokens, "commands": commands,
           **{engine: summarize(runs[engine]) for engine in ENGINES}}
    out["generate_ratio"] = out["exact"]["generate_s_median"] / out["hf"]["generate_s_median"]
    return out


def render(report: dict) -> str:
    a = report["args"]
    lines = [f"Measured {report['date']} on {report['cpu']}: `bench/exact_engine_speed.py --shapes "
             f"{' '.join(a['shapes'])} --repeats {a['repeats']} --steps {a['steps']}` (GRPO in one process, float32, "
             "`trainer.old_log_probs=actor` for both engines; the medians over every step after each run's first).", "",
             "| shape (rows x tokens) | generate s: exact | hf | exact / hf | response tokens/s: exact | hf | "
             "π_old pass s: exact | hf | weight sync s: exact | hf | largest \\|Δ\\|: exact | hf |",
             "| --- |" + " ---: |" * 11]
    for s in report["shapes"]:
        if "error" in s:
            lines.append(f"| {s['shape']} | did not run: {s['error']} |" + " |" * 10)
            continue
        e, h = s["exact"], s["hf"]
        lines.append(f"| {s['shape']} | {e['generate_s_median']:.2f} | {h['generate_s_median']:.2f} | "
                     f"{s['generate_ratio']:.1f}x | {e['response_tokens_per_s']:.0f} | "
                     f"{h['response_tokens_per_s']:.0f} | {e['old_log_probs_s_median']:.2f} | "
                     f"{h['old_log_probs_s_median']:.2f} | {e['weight_sync_s_median']:.2f} | {h['weight_sync_s_median']:.3f} | {e['abs_diff_max']:.1e} | "
                     f"{h['abs_diff_max']:.1e} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=["tiny:128x8", "tiny:128x32", "real:8x32"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--work", default="/tmp/exact_engine_speed")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "exact_engine_speed.json"))
    p.add_argument("--doc", default=str(ROOT / "docs" / "results" / "rollout_mismatch.md"))
    p.add_argument("--dry-run", action="store_true", help="tiny:16x4, 2 steps, each engine once; no doc written")
    p.add_argument("--render-only", action="store_true", help="rewrite the doc's table from --out, running nothing")
    args = p.parse_args()
    from doc_markers import write_between

    if args.render_only:
        write_between(Path(args.doc), BEGIN, END, render(json.loads(Path(args.out).read_text())))
        return
    if args.dry_run:
        args.shapes, args.repeats, args.steps = ["tiny:16x4"], 1, 2
    from hybridflow.precision import cpu_description

    work = Path(args.work).resolve()
    inputs = {}
    if any(s.startswith("real:") for s in args.shapes):
        from tests.real_model import real_model_dir, write_chat_addition

        train, val = write_chat_addition(work / "data", train_rows=500, val_rows=16)
        inputs = {"model": real_model_dir(), "train": train, "val": val}
    report = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "cpu": cpu_description(), "args": vars(args),
              "shapes": []}
    for spec in args.shapes:
        report["shapes"].append(measure(spec, args.repeats, args.steps, inputs, work))
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")  # as it goes
    print(render(report))
    if not args.dry_run:
        write_between(Path(args.doc), BEGIN, END, render(report))


if __name__ == "__main__":
    main()
